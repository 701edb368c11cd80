package nilcheck

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestIs(t *testing.T) {
	var rt http.RoundTripper
	assert.True(t, Is(nil))
	assert.True(t, Is(rt))
	assert.True(t, Is(http.RoundTripper((*http.Transport)(nil))))
	assert.True(t, Is((func())(nil)))
	assert.True(t, Is(map[string]int(nil)))
	assert.True(t, Is([]int(nil)))
	assert.True(t, Is((chan int)(nil)))
	assert.False(t, Is(http.DefaultTransport))
	assert.False(t, Is(0))
	assert.False(t, Is(struct{}{}))
	assert.False(t, Is(func() {}))
}
