package retry

import (
	"context"
	"errors"
	"net"
	"net/http"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

var errCustom = errors.New("custom: shard moving")

// onRequest applies r to the requests match accepts, as a user's rule
// that looks at the request would.
func onRequest(match func(*http.Request) bool, r Rule) Rule {
	return func(in Input, d Decision) Verdict {
		if in.Request == nil || !match(in.Request) {
			return Keep
		}
		return r(in, d)
	}
}

func TestRulesWidenAndNarrowTheAllowList(t *testing.T) {
	now := time.Unix(0, 0)
	get, _ := http.NewRequest(http.MethodGet, "http://a.example/orders", nil)
	other, _ := http.NewRequest(http.MethodGet, "http://b.example/orders", nil)
	onA := func(r *http.Request) bool { return r.URL.Host == "a.example" }
	custom := func(in Input, _ Decision) Verdict {
		if errors.Is(in.Err, errCustom) {
			return Allow
		}
		return Keep
	}
	p := []Rule{
		nil, // ignored
		onRequest(onA, Status(Allow, 500)),
		onRequest(func(r *http.Request) bool { return r.URL.Path == "/orders" }, Status(Deny, 503)),
		custom,
	}
	cases := []struct {
		name string
		in   Input
		want bool
	}{
		{"500 on the host retried", Input{Idempotent: true, Request: get, Response: &http.Response{StatusCode: 500}}, true},
		{"500 on another host not", Input{Idempotent: true, Request: other, Response: &http.Response{StatusCode: 500}}, false},
		{"503 on the path denied", Input{Idempotent: true, Request: get, Response: &http.Response{StatusCode: 503}}, false},
		{"502 kept", Input{Idempotent: true, Request: get, Response: &http.Response{StatusCode: 502}}, true},
		{"custom error retried", Input{Idempotent: true, Request: get, Err: errCustom}, true},
		{"404 kept final", Input{Idempotent: true, Request: get, Response: &http.Response{StatusCode: 404}}, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			assert.Equal(t, c.want, Classify(p, c.in, now).Retry)
		})
	}
}

func TestFirstDefinitiveRuleWins(t *testing.T) {
	p := []Rule{Status(Deny, 502), Status(Allow, 502)}
	d := Classify(p, Input{Idempotent: true, Response: &http.Response{StatusCode: 502}}, time.Time{})
	assert.False(t, d.Retry)
	assert.Equal(t, Class("status_502"), d.Class, "a rule changes Retry, not the class")
}

// No rule lifts the safety rules: an unsafe request is never retried after it
// may have reached the server, and the caller's cancellation is final.
func TestRulesCannotLiftSafety(t *testing.T) {
	everything := []Rule{func(Input, Decision) Verdict { return Allow }}
	now := time.Unix(0, 0)
	mayHaveLeft := []Input{
		{Response: &http.Response{StatusCode: 503}},
		{Response: &http.Response{StatusCode: 500}},
		{Err: errCustom},
		{Err: syscall.ECONNRESET},
		{Err: errors.New("read timeout"), AttemptTimedOut: true},
	}
	for _, in := range mayHaveLeft {
		assert.False(t, Classify(everything, in, now).Retry, "%+v", in)
	}
	assert.False(t, Classify(everything, Input{Idempotent: true, Response: &http.Response{StatusCode: 200}}, now).Retry, "a success is an answer")
	for _, err := range []error{context.Canceled, context.DeadlineExceeded} {
		assert.False(t, Classify(everything, Input{Idempotent: true, Err: err}, now).Retry, "%v", err)
	}
	// What provably never left is still retried, unsafe or not.
	dial := &net.OpError{Op: "dial", Err: syscall.ECONNREFUSED}
	assert.True(t, Classify(everything, Input{Err: dial}, now).Retry)
	// And Deny can turn that off too.
	deny := []Rule{func(Input, Decision) Verdict { return Deny }}
	assert.False(t, Classify(deny, Input{Err: dial}, now).Retry)
}
