package deadline

import (
	"context"
	"errors"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestFormat(t *testing.T) {
	cases := []struct {
		d    time.Duration
		want string
	}{
		{2500 * time.Millisecond, "2500"},
		{1999999 * time.Microsecond, "1999"},
		{time.Millisecond - 1, "0"},
		{0, "0"},
		{-time.Second, "0"},
		{time.Duration(math.MaxInt64), "9223372036854"},
	}
	for _, c := range cases {
		require.Equal(t, c.want, Format(c.d), "Format(%v)", c.d)
	}
}

func TestParse(t *testing.T) {
	ok := []struct {
		in   string
		want time.Duration
	}{
		{"2500", 2500 * time.Millisecond},
		{"0", 0},
		{"007", 7 * time.Millisecond},
		{" 15\t", 15 * time.Millisecond},
		{"9223372036854", 9223372036854 * time.Millisecond},
	}
	for _, c := range ok {
		got, err := Parse(c.in)
		require.NoError(t, err, "Parse(%q)", c.in)
		require.Equal(t, c.want, got, "Parse(%q)", c.in)
	}
	bad := []struct{ in, reason string }{
		{"", ReasonEmpty},
		{"  ", ReasonEmpty},
		{"-5", ReasonNegative},
		{"+5", ReasonSyntax},
		{"1.5", ReasonSyntax},
		{"5ms", ReasonSyntax},
		{"1e3", ReasonSyntax},
		{"5, 6", ReasonSyntax},
		{"0x10", ReasonSyntax},
		{"\u0661", ReasonSyntax}, // Arabic-Indic digit one
		{"9223372036855", ReasonOverflow},
		{"99999999999999999999999999", ReasonOverflow},
	}
	for _, c := range bad {
		_, err := Parse(c.in)
		require.ErrorIs(t, err, ErrInvalidHeader, "Parse(%q)", c.in)
		var he *HeaderError
		require.True(t, errors.As(err, &he))
		require.Equal(t, c.reason, he.Reason, "Parse(%q)", c.in)
	}
	_, err := Parse("-5")
	require.EqualError(t, err, `deadline: invalid Request-Deadline-Ms header "-5": negative`)
	_, err = Parse(strings.Repeat("\x00", 1000))
	require.Less(t, len(err.Error()), 250, "huge values are truncated in messages")
	require.NotContains(t, err.Error(), "\x00")
}

func TestFormatParseRoundTrip(t *testing.T) {
	for _, d := range []time.Duration{0, time.Millisecond, 1234 * time.Millisecond, time.Hour, time.Duration(math.MaxInt64)} {
		got, err := Parse(Format(d))
		require.NoError(t, err)
		require.Equal(t, d.Truncate(time.Millisecond), got)
	}
}

func TestFromHeader(t *testing.T) {
	h := http.Header{}
	_, ok, err := FromHeader(h)
	require.False(t, ok)
	require.NoError(t, err)

	h.Set(Header, "40")
	d, ok, err := FromHeader(h)
	require.True(t, ok)
	require.NoError(t, err)
	require.Equal(t, 40*time.Millisecond, d)

	h.Add(Header, "50")
	_, ok, err = FromHeader(h)
	require.False(t, ok)
	var he *HeaderError
	require.ErrorAs(t, err, &he)
	require.Equal(t, ReasonMultiple, he.Reason)

	h.Set(Header, "soon")
	_, ok, err = FromHeader(h)
	require.False(t, ok)
	require.ErrorIs(t, err, ErrInvalidHeader)
}

func TestPropagate(t *testing.T) {
	overall := t0.Add(2 * time.Second)
	h := http.Header{}
	Propagate(h, t0.Add(500*time.Microsecond), overall)
	require.Equal(t, "1999", h.Get(Header), "rounded down")

	Propagate(h, t0.Add(time.Second), overall)
	require.Equal(t, []string{"1000"}, h.Values(Header), "replaces, never appends")

	Propagate(h, overall.Add(time.Second), overall)
	require.Equal(t, "0", h.Get(Header), "never negative")

	h2 := http.Header{}
	Propagate(h2, t0, time.Time{})
	require.Empty(t, h2.Values(Header), "no deadline: omitted")

	Propagate(nil, t0, overall) // must not panic
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
	s := serve(t, Middleware, "86400000") // one day
	require.True(t, s.has)
	require.LessOrEqual(t, s.left, MaxPropagated)
	require.Greater(t, s.left, MaxPropagated-margin)
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
	for _, vals := range [][]string{nil, {"-5"}, {"soon"}, {"99999999999999999999"}, {"100", "200"}, {""}} {
		s := serve(t, Middleware, vals...)
		require.False(t, s.has, "values %q must be ignored", vals)
		require.NoError(t, s.err)
	}
}

func TestPropagateThroughMiddleware(t *testing.T) {
	// Client side writes the header, server side applies it: end to end.
	now := time.Now()
	h := http.Header{}
	Propagate(h, now, now.Add(45*time.Second))
	s := serve(t, Middleware, h.Values(Header)...)
	require.True(t, s.has)
	require.Greater(t, s.left, 45*time.Second-margin)
	require.LessOrEqual(t, s.left, 45*time.Second)
}
