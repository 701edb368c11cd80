package memstore_test

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

var boundsT0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

func boundsClaim(key string, request []byte, now time.Time) idempotency.Claim {
	return idempotency.Claim{
		Scope:       idempotency.Scope{Principal: "p", Method: "POST", Route: "/r", Key: key},
		Fingerprint: "fp", FingerprintVersion: 1, Owner: "owner-" + key, Request: request,
		Now: now, LeaseFor: time.Minute, ReplayWindow: time.Hour,
	}
}

// The byte limit refuses a new record that would take the store over it,
// counts a record's stored request only while it is in progress, and makes
// room again when a completion drops it.
func TestMaxBytes(t *testing.T) {
	s := memstore.New(memstore.WithMaxBytes(10_000))
	req := bytes.Repeat([]byte("r"), 3000)
	a, ok, err := claimed(s.Claim(t.Context(), boundsClaim("a", req, boundsT0)))
	require.NoError(t, err)
	require.True(t, ok)
	one := s.Bytes()
	require.Greater(t, one, int64(3000), "the stored request is counted")
	_, ok, err = claimed(s.Claim(t.Context(), boundsClaim("b", req, boundsT0)))
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, 2*one, s.Bytes())

	_, ok, err = claimed(s.Claim(t.Context(), boundsClaim("c", req, boundsT0)))
	require.ErrorIs(t, err, idempotency.ErrStoreFull)
	require.False(t, ok)
	require.Equal(t, 2, s.Len())
	require.Equal(t, 2*one, s.Bytes(), "a refused claim changes nothing")
	_, ok, err = claimed(s.Claim(t.Context(), boundsClaim("small", nil, boundsT0)))
	require.NoError(t, err, "a record that fits is accepted")
	require.True(t, ok)
	small := s.Bytes() - 2*one

	// Completing a drops its request: room for c.
	resp := idempotency.Response{Status: 201, Body: []byte(`{"id":"a"}`)}
	require.NoError(t, s.Complete(t.Context(), a.Lease(), resp, boundsT0))
	got, err := s.Get(t.Context(), a.Scope)
	require.NoError(t, err)
	require.Equal(t, idempotency.Completed, got.State)
	require.Empty(t, got.Request, "a completed record keeps no request")
	require.Equal(t, resp.Body, got.Response.Body)
	require.Less(t, s.Bytes(), 2*one+small-3000+100)
	_, ok, err = claimed(s.Claim(t.Context(), boundsClaim("c", req, boundsT0)))
	require.NoError(t, err)
	require.True(t, ok)

	// A record larger than the whole limit never fits: not a full store
	// (which would pass) but a request too large for it.
	_, _, err = claimed(memstore.New(memstore.WithMaxBytes(1000)).Claim(t.Context(), boundsClaim("big", req, boundsT0)))
	require.ErrorIs(t, err, idempotency.ErrRecordTooLarge)
	require.NotErrorIs(t, err, idempotency.ErrStoreFull)
}

// The count of bytes follows every change of a record (a takeover's owner,
// recovery points, a unit's writes, completions) and returns to zero when
// the records are gone: released, evicted after their window, reaped.
func TestBytesReturnToZero(t *testing.T) {
	s := memstore.New()
	ctx := t.Context()
	req := []byte(`{"method":"POST","body":"` + string(bytes.Repeat([]byte("x"), 500)) + `"}`)
	claim := func(key string, now time.Time) idempotency.Record {
		t.Helper()
		rec, ok, err := claimed(s.Claim(ctx, boundsClaim(key, req, now)))
		require.NoError(t, err)
		require.True(t, ok)
		return rec
	}
	resp := idempotency.Response{Status: 201, Header: http.Header{"Location": {"/p/1"}, "Link": {"<a>", "<b>"}, "X-None": {}}, Body: []byte("body")}

	released := claim("released", boundsT0)
	require.NoError(t, s.SetRecoveryPoint(ctx, released.Lease(), "order", bytes.Repeat([]byte("d"), 100), boundsT0))
	require.NoError(t, s.Release(ctx, released.Lease()))
	require.Zero(t, s.Bytes(), "a released record leaves nothing counted")

	claim("taken", boundsT0)
	c := boundsClaim("taken", nil, boundsT0.Add(2*time.Minute))
	c.Owner = "a much longer owner token than the first one"
	taken, ok, err := claimed(s.Claim(ctx, c))
	require.NoError(t, err)
	require.True(t, ok)
	u, _, err := s.Begin(ctx, taken.Lease())
	require.NoError(t, err)
	require.NoError(t, u.SetRecoveryPoint(ctx, "a", bytes.Repeat([]byte("a"), 300), boundsT0))
	require.NoError(t, u.Complete(ctx, resp, boundsT0.Add(2*time.Minute)))
	require.NoError(t, u.Complete(ctx, idempotency.Response{Status: 200, Body: []byte("second")}, boundsT0.Add(2*time.Minute)))
	require.NoError(t, u.SetRecoveryPoint(ctx, "b", []byte("b"), boundsT0.Add(2*time.Minute)))
	require.NoError(t, u.Commit())

	done := claim("done", boundsT0)
	require.NoError(t, s.Complete(ctx, done.Lease(), resp, boundsT0))
	claim("abandoned", boundsT0)
	require.Equal(t, 3, s.Len())
	require.Positive(t, s.Bytes())

	// A claim an hour and more later evicts both completed records by
	// itself; the abandoned one stays until the reaper's call.
	later := boundsT0.Add(3 * time.Hour)
	fresh := claim("fresh", later)
	require.Equal(t, 2, s.Len())
	_, err = s.Get(ctx, taken.Scope)
	require.ErrorIs(t, err, idempotency.ErrNotFound)
	require.NoError(t, s.Release(ctx, fresh.Lease()))
	n, err := s.DeleteBefore(ctx, later, 10)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Zero(t, s.Len())
	require.Zero(t, s.Bytes())
}

// What a record costs: the heap a store's records keep (after a garbage
// collection), against what the store counts (Bytes), for requests with
// 64-byte and 64 KiB bodies through the middleware, and for records in
// progress that hold a 64 KiB request. The count must follow the heap, or
// WithMaxBytes bounds nothing. go test -run TestCountsWhatItHolds
// -v prints the figures.
func TestCountsWhatItHolds(t *testing.T) {
	respBody := []byte(`{"id":"pay_0123456789abcdef01234567","status":"created","amount":1}`) // 64 bytes
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(respBody)
	})
	heapNow := func() int64 {
		var ms runtime.MemStats
		runtime.GC()
		runtime.GC()
		runtime.ReadMemStats(&ms)
		return int64(ms.HeapAlloc)
	}
	measure := func(name string, n int, s *memstore.Store, before int64) (kept, counted float64) {
		t.Helper()
		kept = float64(heapNow()-before) / float64(n)
		counted = float64(s.Bytes()) / float64(n)
		t.Logf("%s: %.0f bytes per record kept on the heap, %.0f counted", name, kept, counted)
		require.Equal(t, n, s.Len())
		return kept, counted
	}
	for _, tc := range []struct {
		name string
		n    int
		body int
	}{{"completed, 64-byte body", 3000, 64}, {"completed, 64 KiB body", 100, 64 << 10}} {
		s := memstore.New()
		h := idempotency.New(s, idempotency.WithLogger(nil)).Wrap(handler)
		body := bytes.Repeat([]byte("a"), tc.body)
		before := heapNow()
		for i := range tc.n {
			r := httptest.NewRequest(http.MethodPost, "/payments", bytes.NewReader(body))
			r.Header.Set("Content-Type", "application/json")
			r.Header.Set("Authorization", "Bearer tok_0123456789")
			r.Header.Set("Idempotency-Key", "0f8fad5b-d9cb-469f-a165-70867728950e-"+strconv.Itoa(i))
			w := httptest.NewRecorder()
			h.ServeHTTP(w, r)
			require.Equal(t, http.StatusCreated, w.Code)
		}
		kept, counted := measure(tc.name, tc.n, s, before)
		if tc.body > 1024 {
			// Too few records to compare: what matters is that the
			// request (65 KiB encoded) is gone.
			require.Less(t, kept, 4096.0, "a completed record keeps its request")
			require.Less(t, counted, 4096.0, "a completed record's request is counted")
			continue
		}
		require.InDelta(t, 1, counted/kept, 0.35, "%s: counted %.0f bytes per record, the heap kept %.0f", tc.name, counted, kept)
	}

	// In progress, a record holds the request the middleware stores.
	const n = 100
	s := memstore.New()
	before := heapNow()
	for i := range n {
		req := append([]byte(`{"id":"0123456789abcdef","method":"POST","url":"/payments","host":"example.com",`+
			`"content_type":"application/json"}`+"\n"), bytes.Repeat([]byte("a"), 64<<10)...)
		_, ok, err := claimed(s.Claim(t.Context(), boundsClaim(strconv.Itoa(i), req, boundsT0)))
		require.NoError(t, err)
		require.True(t, ok)
	}
	kept, counted := measure("in progress, 64 KiB body", n, s, before)
	require.InDelta(t, 1, counted/kept, 0.35, "in progress: counted %.0f bytes per record, the heap kept %.0f", counted, kept)
}
