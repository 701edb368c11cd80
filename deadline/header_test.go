package deadline

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestParse(t *testing.T) {
	ok := []struct {
		in   string
		want time.Duration
	}{
		{"2500", 2500 * time.Millisecond},
		{"0", 0},
		{"007", 7 * time.Millisecond},
		{" 15\t", 15 * time.Millisecond},
		{"300000", 5 * time.Minute},
		{"300001", 5 * time.Minute},
		{"1000000000000", 5 * time.Minute},
		{"9223372036855", 5 * time.Minute},
		{"99999999999999999999999999", 5 * time.Minute}, // strconv.ErrRange: clamped as well
	}
	for _, c := range ok {
		got, valid := parse(c.in)
		require.True(t, valid, "parse(%q)", c.in)
		require.Equal(t, c.want, got, "parse(%q)", c.in)
	}
	for _, in := range []string{"", "  ", "-5", "+5", "1.5", "5ms", "1e3", "5, 6", "0x10", "1_000",
		"\u0661", // Arabic-Indic digit one
		"99999999999999999999999999x"} {
		d, valid := parse(in)
		require.False(t, valid, "parse(%q)", in)
		require.Zero(t, d, "parse(%q)", in)
	}
}

func TestFromHeader(t *testing.T) {
	h := http.Header{}
	_, ok := fromHeader(h)
	require.False(t, ok)

	h.Set(Header, "40")
	d, ok := fromHeader(h)
	require.True(t, ok)
	require.Equal(t, 40*time.Millisecond, d)

	h.Add(Header, "50")
	_, ok = fromHeader(h)
	require.False(t, ok, "two values: which one would the client mean?")

	h.Set(Header, "soon")
	_, ok = fromHeader(h)
	require.False(t, ok)
}

// seen is what the innermost handler observed about its context: whether
// it had a deadline, the time left when it looked, and ctx.Err().
type seen struct {
	has  bool
	left time.Duration
	err  error
}

// serve runs wrap(inner) in an httptest server, sends one GET with the given
// Header values and returns what inner saw.
func serve(t *testing.T, wrap func(http.Handler) http.Handler, values ...string) seen {
	t.Helper()
	got := make(chan seen, 1)
	inner := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		d, ok := r.Context().Deadline()
		s := seen{has: ok, err: r.Context().Err()}
		if ok {
			s.left = time.Until(d)
		}
		got <- s
		_, _ = io.WriteString(w, "ok")
	})
	srv := httptest.NewServer(wrap(inner))
	defer srv.Close()
	req, err := http.NewRequestWithContext(context.Background(), http.MethodGet, srv.URL, nil)
	require.NoError(t, err)
	for _, v := range values {
		req.Header.Add(Header, v)
	}
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, "ok", string(body))
	return <-got
}

const margin = 2 * time.Second // generous for a loaded CI machine; values differ by far more

func TestMiddlewareAppliesHeader(t *testing.T) {
	s := serve(t, Middleware, "60000")
	require.True(t, s.has, "handler must see a deadline")
	require.NoError(t, s.err)
	require.LessOrEqual(t, s.left, 60*time.Second)
	require.Greater(t, s.left, 60*time.Second-margin)
}

func TestMiddlewareClampsToMax(t *testing.T) {
	// One day, and a value too large for any integer type: both 5 minutes.
	for _, v := range []string{"86400000", "99999999999999999999"} {
		s := serve(t, Middleware, v)
		require.True(t, s.has, v)
		require.LessOrEqual(t, s.left, maxPropagated, v)
		require.Greater(t, s.left, maxPropagated-margin, v)
	}
}

func TestMiddlewareNeverExtendsEarlierDeadline(t *testing.T) {
	outer := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
			defer cancel()
			next.ServeHTTP(w, r.WithContext(ctx))
		})
	}
	s := serve(t, func(h http.Handler) http.Handler { return outer(Middleware(h)) }, "120000")
	require.True(t, s.has)
	require.LessOrEqual(t, s.left, 10*time.Second)
	require.Greater(t, s.left, 10*time.Second-margin)
}

func TestMiddlewareZeroIsAlreadyDone(t *testing.T) {
	s := serve(t, Middleware, "0")
	require.True(t, s.has)
	require.ErrorIs(t, s.err, context.DeadlineExceeded)
}

func TestMiddlewareIgnoresBadHeaders(t *testing.T) {
	for _, vals := range [][]string{nil, {"-5"}, {"soon"}, {"100", "200"}, {""}} {
		s := serve(t, Middleware, vals...)
		require.False(t, s.has, "values %q must be ignored", vals)
		require.NoError(t, s.err)
	}
}
