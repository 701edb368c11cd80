package sqlstore

import (
	"bytes"
	"testing"

	"github.com/saferetry/saferetry/idempotency"
)

// TestScopeHashSeparatesParts checks that the digest depends on where each
// part ends, not only on the concatenated bytes.
func TestScopeHashSeparatesParts(t *testing.T) {
	a := scopeHash(idempotency.Scope{Principal: "ab", Method: "c", Route: "d", Key: "e"})
	b := scopeHash(idempotency.Scope{Principal: "a", Method: "bc", Route: "d", Key: "e"})
	c := scopeHash(idempotency.Scope{Principal: "ab", Method: "c", Route: "d", Key: "e"})
	if bytes.Equal(a, b) || !bytes.Equal(a, c) || len(a) != 32 {
		t.Fatalf("scopeHash: %x %x %x", a, b, c)
	}
}
