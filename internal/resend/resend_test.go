package resend

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The key fields go under their lower-case names, in a copy unless the map
// is the Transport's own, and the caller's value slices are never modified;
// net/http then finds no field that makes the request replayable.
func TestRespellMovesTheKeyFieldsOutOfNetHTTPsSight(t *testing.T) {
	callers := http.Header{"Idempotency-Key": {"k1"}, "X-Idempotency-Key": {"k2"}, "Accept": {"*/*"}}
	clones := 0
	clone := func(h http.Header) http.Header { clones++; return h.Clone() }
	h, own := Respell(callers, false, clone)
	require.True(t, own)
	assert.Equal(t, 1, clones)
	assert.Equal(t, http.Header{"idempotency-key": {"k1"}, "x-idempotency-key": {"k2"}, "Accept": {"*/*"}}, h)
	assert.Equal(t, http.Header{"Idempotency-Key": {"k1"}, "X-Idempotency-Key": {"k2"}, "Accept": {"*/*"}},
		callers, "the caller's map is the caller's")
	assert.False(t, Replays(&http.Request{Method: http.MethodPost, Header: h}))
	assert.True(t, Replays(&http.Request{Method: http.MethodPost, Header: callers}))

	mine := http.Header{"Idempotency-Key": {"k1"}, "idempotency-key": {"k0"}}
	h, own = Respell(mine, true, clone)
	assert.True(t, own)
	assert.Equal(t, 1, clones, "the Transport's own map is changed in place")
	assert.Equal(t, http.Header{"idempotency-key": {"k0", "k1"}}, h, "one field, every line kept")

	none := http.Header{"Accept": {"*/*"}}
	h, own = Respell(none, false, clone)
	assert.False(t, own, "nothing to move: no copy")
	assert.Equal(t, none, h)
}

// A GET, HEAD, OPTIONS or TRACE is re-sent whatever its header.
func TestReplaysByMethod(t *testing.T) {
	for _, m := range []string{"", http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace} {
		assert.True(t, Replays(&http.Request{Method: m, Header: http.Header{}}), m)
	}
	for _, m := range []string{http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete} {
		assert.False(t, Replays(&http.Request{Method: m, Header: http.Header{}}), m)
	}
}
