package idempotencytest

import (
	"bytes"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/saferetry/saferetry/idempotency"
)

// bytesTests are the subtests on what a store keeps byte for byte: scopes
// of any bytes and length, and responses replayed exactly.
var bytesTests = []suiteTest{
	{"ScopeAnyBytes", testScopeAnyBytes, 0},
	{"ScopePartsAreDistinct", testScopePartsDistinct, 0},
	{"ResponseBytesExact", testResponseBytesExact, 0},
}

// oddScopes are scopes a request can produce that are not valid UTF-8, hold a
// NUL, or are longer than a database index row may be (PostgreSQL refuses
// B-tree rows over 2704 bytes): the routes of POST /pay/%ff, /pay/%00 and a
// 4000-byte path segment, and principals and keys of the same kind.
func oddScopes() []idempotency.Scope {
	long := strings.Repeat("a", 4000)
	return []idempotency.Scope{
		{Principal: "acct-1", Method: http.MethodPost, Route: "/pay/\xff", Key: "k"},
		{Principal: "acct-1", Method: http.MethodPost, Route: "/pay/\x00", Key: "k"},
		{Principal: "acct-1", Method: http.MethodPost, Route: "/pay/" + long, Key: "k"},
		{Principal: "acct-\xe9\x00", Method: http.MethodPost, Route: "/pay", Key: "k"},
		{Principal: "acct-1", Method: "P\x00ST", Route: "/pay", Key: "k\xff\x00" + long},
		{Principal: strings.Repeat("\xff", 5000), Method: http.MethodPost, Route: "/pay/" + long,
			Key: long},
		{Principal: "", Method: "", Route: "", Key: ""},
	}
}

// testScopeAnyBytes claims, completes and reads back scopes of arbitrary
// bytes and length: each is its own record, returned with its scope intact.
func testScopeAnyBytes(t *testing.T, s idempotency.Store) {
	scopes := oddScopes()
	for i, sc := range scopes {
		c := claimOf(sc, fmt.Sprintf("o%d", i), "fp", at(0))
		rec := mustClaim(t, s, c, idempotency.ClaimCreated)
		if rec.Scope != sc {
			t.Fatalf("scope %d: claim returned scope %q, want %q", i, rec.Scope, sc)
		}
		// A second claim sees the first one's record, in progress.
		again := mustClaim(t, s, claimOf(sc, "other", "fp", at(1)), idempotency.ClaimExisting)
		if again.Owner != c.Owner || again.Scope != sc {
			t.Fatalf("scope %d: second claim saw owner %q scope %q", i, again.Owner, again.Scope)
		}
	}
	for i, sc := range scopes {
		resp := response(fmt.Sprintf("odd-%d", i))
		noErr(t, fmt.Sprintf("Complete scope %d", i),
			s.Complete(ctx(t), idempotency.Lease{Scope: sc, Owner: fmt.Sprintf("o%d", i),
				Generation: 1}, resp, at(2)))
	}
	for i, sc := range scopes {
		got := mustGet(t, s, sc)
		if got.Scope != sc || got.State != idempotency.Completed {
			t.Fatalf("scope %d: Get = scope %q state %v", i, got.Scope, got.State)
		}
		wantResponse(t, got, response(fmt.Sprintf("odd-%d", i)))
		replay := mustClaim(t, s, claimOf(sc, "late", "fp", at(3)), idempotency.ClaimExisting)
		wantResponse(t, replay, response(fmt.Sprintf("odd-%d", i)))
	}
	// The reaper's and the completer's queries return the same scopes.
	sw, ok := s.(idempotency.Sweeper)
	if !ok {
		return
	}
	for i, sc := range scopes[:3] {
		mustClaim(t, s, claimOf(idempotency.Scope{Principal: sc.Principal, Method: sc.Method,
			Route: sc.Route, Key: "abandoned"},
			fmt.Sprintf("a%d", i), "fp", at(i)), idempotency.ClaimCreated)
	}
	abandoned, err := sw.Abandoned(ctx(t), at(100), 10)
	noErr(t, "Abandoned", err)
	if len(abandoned) != 3 {
		t.Fatalf("Abandoned returned %d records, want 3", len(abandoned))
	}
	for i, rec := range abandoned {
		if rec.Scope.Route != scopes[i].Route || rec.Scope.Key != "abandoned" {
			t.Fatalf("Abandoned record %d: scope %q, want route %q", i, rec.Scope, scopes[i].Route)
		}
	}
}

// testScopePartsDistinct checks that the four parts of a scope are kept
// apart: moving bytes from one part to its neighbour (or adding a NUL where
// a separator might be) makes another scope.
func testScopePartsDistinct(t *testing.T, s idempotency.Store) {
	scopes := []idempotency.Scope{
		{Principal: "ab", Method: "POST", Route: "/r", Key: "k"},
		{Principal: "a", Method: "bPOST", Route: "/r", Key: "k"},
		{Principal: "ab", Method: "POS", Route: "T/r", Key: "k"},
		{Principal: "ab", Method: "POST", Route: "/", Key: "rk"},
		{Principal: "ab\x00", Method: "POST", Route: "/r", Key: "k"},
		{Principal: "ab", Method: "POST\x00/r", Route: "", Key: "k"},
	}
	for i, sc := range scopes {
		rec := mustClaim(t, s, claimOf(sc, fmt.Sprintf("o%d", i), "fp", at(0)),
			idempotency.ClaimCreated)
		if rec.Generation != 1 {
			t.Fatalf("scope %d: generation %d", i, rec.Generation)
		}
	}
	for i, sc := range scopes {
		if got := mustGet(t, s, sc); got.Owner != fmt.Sprintf("o%d", i) || got.Scope != sc {
			t.Fatalf("scope %d: Get = owner %q scope %q", i, got.Owner, got.Scope)
		}
	}
}

// testResponseBytesExact stores a response whose header values are not
// valid UTF-8 (a Latin-1 file name, as real servers send) and whose body
// holds every byte value, and requires Get and a replaying Claim to return
// it unchanged: same status, same header names, values and value order,
// same body.
func testResponseBytesExact(t *testing.T, s idempotency.Store) {
	all := make([]byte, 0, 512)
	for i := range 512 {
		all = append(all, byte(i*7+i/256))
	}
	cases := []idempotency.Response{
		{
			Status: http.StatusOK,
			Header: http.Header{
				"Content-Disposition": {"attachment; filename=\"r\xe9sum\xe9.pdf\""},
				"Content-Type":        {"application/pdf"},
				"X-Raw":               {"\xff\xfe\x00\x01", "", "second value", "\xc3\x28"},
				"X-Empty":             {},
			},
			Body: all,
		},
		{Status: 299, Header: http.Header{}, Body: []byte{}},
		{Status: http.StatusNoContent, Header: nil, Body: nil},
		{Status: http.StatusCreated, Header: http.Header{"Set-Cookie": {"a=\x80", "b=\x7f"}},
			Body: []byte("\x00")},
	}
	for i, resp := range cases {
		sc := scope(fmt.Sprintf("exact-%d", i))
		rec := mustClaim(t, s, claimOf(sc, "a", "fp", at(0)), idempotency.ClaimCreated)
		noErr(t, "Complete", s.Complete(ctx(t), rec.Lease(), resp, at(1)))
		wantExact(t, fmt.Sprintf("case %d: Get", i), mustGet(t, s, sc), resp)
		replayed := mustClaim(t, s, claimOf(sc, "b", "fp", at(2)), idempotency.ClaimExisting)
		wantExact(t, fmt.Sprintf("case %d: replaying Claim", i), replayed, resp)
	}
}

// wantExact requires rec's response to equal want byte for byte. A nil and
// an empty body are the same response; a nil and an empty header too (the
// middleware replays neither differently).
func wantExact(t *testing.T, what string, rec idempotency.Record, want idempotency.Response) {
	t.Helper()
	if rec.Response == nil {
		t.Fatalf("%s: no response", what)
	}
	got := *rec.Response
	if got.Status != want.Status {
		t.Fatalf("%s: status %d, want %d", what, got.Status, want.Status)
	}
	if !bytes.Equal(got.Body, want.Body) {
		t.Fatalf("%s: body %q, want %q", what, got.Body, want.Body)
	}
	if len(got.Header) != len(want.Header) {
		t.Fatalf("%s: header %q, want %q", what, got.Header, want.Header)
	}
	for k, wv := range want.Header {
		gv, ok := got.Header[k]
		if !ok || len(gv) != len(wv) {
			t.Fatalf("%s: header %q = %q, want %q", what, k, gv, wv)
		}
		for j := range wv {
			if gv[j] != wv[j] {
				t.Fatalf("%s: header %q value %d = %q, want %q", what, k, j, gv[j], wv[j])
			}
		}
	}
}
