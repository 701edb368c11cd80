package idempotency

import (
	"bytes"
	"strings"
	"testing"
)

var fuzzSecret = bytes.Repeat([]byte{7}, 32)

func fuzzIDs(t testing.TB) *ids {
	x, err := newIDs([][]byte{fuzzSecret})
	if err != nil {
		t.Fatal(err)
	}
	return x
}

// The parser of identifiers refuses whatever it did not seal, never
// panics, and what it opens is sealed back to the very same identifier:
// there is one identifier per operation and principal.
func FuzzMonitorID(f *testing.F) {
	x := fuzzIDs(f)
	id := x.seal("acct_1", operation{method: "POST", route: "POST /payments", key: "order-42",
		fingerprint: strings.Repeat("ab", 32)})
	f.Add(id, "acct_1")
	f.Add(id, "acct_2")
	f.Add(id[:len(id)-1], "acct_1")
	f.Add(id+"A", "acct_1")
	f.Add("", "")
	f.Add("AQ", "")
	f.Add(strings.Repeat("A", maxIDLength+1), "acct_1")
	f.Fuzz(func(t *testing.T, id, principal string) {
		op, err := x.open(principal, id)
		if err != nil {
			if err != errBadID {
				t.Fatalf("open: %v, want errBadID", err)
			}
			return
		}
		if op.method == "" || op.key == "" || len(op.fingerprint) > idFPPrefix {
			t.Fatalf("opened a malformed operation %+v", op)
		}
		if again := x.seal(principal, op); again != id {
			t.Fatalf("%q opened as %+v, which seals as %q", id, op, again)
		}
	})
}

// Any operation survives sealing and opening, for its principal only, and
// its identifier holds none of its key.
func FuzzMonitorIDRoundTrip(f *testing.F) {
	x := fuzzIDs(f)
	f.Add("acct_1", "POST", "POST /payments", "order-42", strings.Repeat("ab", 32))
	f.Add("", "PATCH", "/x/{id}", strings.Repeat("k", 255), "fp1")
	f.Fuzz(func(t *testing.T, principal, method, route, key, fp string) {
		if method == "" || key == "" {
			return
		}
		op := operation{method: method, route: route, key: key, fingerprint: fp}
		id := x.seal(principal, op)
		if len(key) >= 8 && strings.Contains(id, key) {
			t.Fatalf("the identifier %q holds the key %q", id, key)
		}
		got, err := x.open(principal, id)
		if len(id) > maxIDLength {
			if err == nil {
				t.Fatalf("an identifier of %d characters opened", len(id))
			}
			return // never issued (locate)
		}
		op.fingerprint = fp[:min(len(fp), idFPPrefix)]
		if err != nil || got != op {
			t.Fatalf("open(seal(%+v)) = %+v, %v", op, got, err)
		}
		if _, err := x.open(principal+"x", id); err == nil {
			t.Fatal("another principal opened the identifier")
		}
	})
}
