package hop

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestParseAttempt(t *testing.T) {
	for v, want := range map[string]int{
		"1": 1, "2": 2, " 3\t": 3, "007": 7, "2147483647": 2147483647, "0000000001": 1,
		"": 0, " ": 0, "0": 0, "-1": 0, "+1": 0, "1.0": 0, "1, 2": 0, "0x1": 0, "1_0": 0, "one": 0,
		"2147483648": 0, "00000000001": 0, "99999999999999999999": 0, "\u0661": 0,
	} {
		assert.Equal(t, want, ParseAttempt(http.Header{AttemptHeader: {v}}), "%q", v)
	}
	assert.Zero(t, ParseAttempt(http.Header{}), "no header: unknown")
	assert.Zero(t, ParseAttempt(http.Header{AttemptHeader: {"1", "2"}}), "two field lines: which one?")
	assert.Zero(t, ParseAttempt(http.Header{AttemptHeader: {}}))
}

func TestAttemptValueRoundTrips(t *testing.T) {
	for _, n := range []int{1, 2, 8, 9, 10, 100, 1 << 20} {
		v := AttemptValue(n)
		assert.Equal(t, []string{strconv.Itoa(n)}, v)
		assert.Equal(t, n, ParseAttempt(http.Header{AttemptHeader: v}))
	}
}

// answer is a response with status and the mark's values vals.
func answer(status int, vals ...string) *http.Response {
	return &http.Response{StatusCode: status, Header: http.Header{MarkHeader: vals}}
}

func TestMarked(t *testing.T) {
	assert.True(t, Marked(answer(503, "true")))
	for _, vals := range [][]string{nil, {}, {""}, {"false"}, {"1"}, {"yes"}, {"true, true"}, {"truex"},
		{"TRUE"}, {"True"}, {" true"}, {"no", "true"}, {"true", "true"}} {
		assert.False(t, Marked(answer(503, vals...)), "%q", vals)
	}
	h := http.Header{}
	Mark(h)
	assert.Equal(t, "true", h.Get("retried-below"))
	assert.True(t, Marked(&http.Response{StatusCode: 502, Header: h}))
	assert.False(t, Marked(nil))
}

// The mark means something on a 5xx or a 429 only.
func TestMarkedOnlyOnAFailure(t *testing.T) {
	for _, status := range []int{500, 502, 503, 504, 599, 429} {
		assert.True(t, Failure(status), status)
		assert.True(t, Marked(answer(status, "true")), status)
	}
	for _, status := range []int{0, 100, 200, 201, 304, 400, 404, 408, 409, 422, 499} {
		assert.False(t, Failure(status), status)
		assert.False(t, Marked(answer(status, "true")), status)
	}
}

func TestRecordInContext(t *testing.T) {
	assert.Nil(t, FromContext(context.Background()))
	r := &Record{Attempt: 2}
	ctx := NewContext(context.Background(), r)
	assert.Same(t, r, FromContext(context.WithoutCancel(ctx)), "kept by derived contexts")
	assert.False(t, r.RetriedBelow())
	var wg sync.WaitGroup
	for range 4 { // a handler may make several calls at once
		wg.Go(r.NoteRetriedBelow)
	}
	wg.Wait()
	assert.True(t, r.RetriedBelow())
}

func FuzzParseAttempt(f *testing.F) {
	for _, s := range []string{"1", "2", " 3 ", "0", "-1", "+1", "007", "2147483647", "2147483648",
		"00000000001", "", "1, 2", "1.5"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		n := ParseAttempt(http.Header{AttemptHeader: {v}})
		if n == 0 {
			return
		}
		trimmed := strings.Trim(v, " \t")
		if n < 1 || len(trimmed) > maxAttemptDigits {
			t.Fatalf("ParseAttempt(%q) = %d", v, n)
		}
		// Accepted values are plain digits that strconv reads the same.
		for _, c := range []byte(trimmed) {
			if c < '0' || c > '9' {
				t.Fatalf("ParseAttempt(%q) = %d: accepted a non-digit", v, n)
			}
		}
		if m, err := strconv.Atoi(trimmed); err != nil || m != n {
			t.Fatalf("ParseAttempt(%q) = %d, strconv says %d, %v", v, n, m, err)
		}
		if back := ParseAttempt(http.Header{AttemptHeader: AttemptValue(n)}); back != n {
			t.Fatalf("round trip of %d: %d", n, back)
		}
	})
}

func FuzzMarked(f *testing.F) {
	for _, s := range []string{"true", "TRUE", " true ", "false", "", "true, true", "1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		got := Marked(answer(503, v))
		want := v == "true"
		if got != want {
			t.Fatalf("Marked(%q) = %v", v, got)
		}
	})
}
