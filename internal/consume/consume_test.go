package consume

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/keygen"
)

func TestDecide(t *testing.T) {
	p := Policy{MaxAttempts: 3, Base: 100 * time.Millisecond, Cap: time.Second}
	invalidKey := fmt.Errorf("%w: %w", idempotency.ErrInvalidCall, keygen.Validate(""))
	cases := []struct {
		name    string
		err     error
		attempt int
		want    Verdict
	}{
		{"completed", nil, 1, Verdict{Action: Ack, Reason: Completed}},
		{"output too large", idempotency.ErrOutputTooLarge, 1,
			Verdict{Action: Ack, Reason: Completed}},
		{"definitive", fmt.Errorf("declined: %w", idempotency.ErrDefinitive), 1,
			Verdict{Action: DeadLetter, Reason: Definitive}},
		{"definitive on the last attempt", idempotency.ErrDefinitive, 3,
			Verdict{Action: DeadLetter, Reason: Definitive}},
		{"key reused", idempotency.ErrKeyReused, 1, Verdict{Action: DeadLetter, Reason: KeyReused}},
		{"key invalid", invalidKey, 1, Verdict{Action: DeadLetter, Reason: KeyInvalid}},
		{"payload too large", fmt.Errorf("%w: big", idempotency.ErrInvalidCall), 1,
			Verdict{Action: DeadLetter, Reason: Invalid}},
		{"record too large", idempotency.ErrRecordTooLarge, 1,
			Verdict{Action: DeadLetter, Reason: Invalid}},
		{"in progress", idempotency.ErrInProgress, 1,
			Verdict{Action: Redeliver, Reason: InProgress, Delay: 7 * time.Second}},
		{"in progress past the attempts", idempotency.ErrInProgress, 9,
			Verdict{Action: Redeliver, Reason: InProgress, Delay: 7 * time.Second}},
		{"lease lost", fmt.Errorf("%w: %w", idempotency.ErrInProgress, idempotency.ErrLeaseLost),
			1, Verdict{Action: Redeliver, Reason: InProgress, Delay: 7 * time.Second}},
		{"store down", fmt.Errorf("%w: down", idempotency.ErrStoreUnavailable), 1,
			Verdict{Action: Redeliver, Reason: StoreUnavailable, Delay: 50 * time.Millisecond}},
		{"store down past the attempts", idempotency.ErrStoreUnavailable, 9,
			Verdict{Action: Redeliver, Reason: StoreUnavailable, Delay: 500 * time.Millisecond}},
		{"failed", errors.New("boom"), 1,
			Verdict{Action: Redeliver, Reason: Failed, Delay: 50 * time.Millisecond}},
		{"failed again", errors.New("boom"), 2,
			Verdict{Action: Redeliver, Reason: Failed, Delay: 100 * time.Millisecond}},
		{"failed last", errors.New("boom"), 3, Verdict{Action: DeadLetter, Reason: Exhausted}},
		{"panicked last", &idempotency.PanicError{Value: 1}, 3,
			Verdict{Action: DeadLetter, Reason: Exhausted}},
		{"incomplete", idempotency.ErrIncomplete, 1,
			Verdict{Action: Redeliver, Reason: Failed, Delay: 50 * time.Millisecond}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := Decide(c.err, c.attempt, p, 7*time.Second, 0.5)
			if got != c.want {
				t.Fatalf("Decide(%v, %d) = %+v, want %+v", c.err, c.attempt, got, c.want)
			}
		})
	}
}

func TestOutcome(t *testing.T) {
	p := Policy{MaxAttempts: 3, Base: 100 * time.Millisecond, Cap: time.Second}
	busy := fmt.Errorf("do: %w", &idempotency.InProgressError{RetryAfter: 7 * time.Second})
	cases := []struct {
		name     string
		err      error
		replayed bool
		want     Verdict
	}{
		{"completed", nil, false, Verdict{Action: Ack, Reason: Completed}},
		{"replayed", nil, true, Verdict{Action: Ack, Reason: Replayed}},
		{"poison", &PoisonError{Reason: TenantMissing, Err: errors.New("no tenant")}, false,
			Verdict{Action: DeadLetter, Reason: TenantMissing}},
		{"held key waits for the lease", busy, false,
			Verdict{Action: Redeliver, Reason: InProgress, Delay: 7 * time.Second}},
		{"failed last", errors.New("boom"), false, Verdict{Action: DeadLetter, Reason: Exhausted}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := Outcome(c.err, c.replayed, 3, p); got != c.want {
				t.Fatalf("Outcome(%v, %t) = %+v, want %+v", c.err, c.replayed, got, c.want)
			}
		})
	}
	for range 100 {
		v := Outcome(errors.New("boom"), false, 2, p)
		if v.Action != Redeliver || v.Reason != Failed || v.Delay < 0 ||
			v.Delay >= 200*time.Millisecond {
			t.Fatalf("Outcome of a failure on attempt 2 = %+v, want a redelivery within [0, 200ms)", v)
		}
	}
}

func TestDecideOneAttemptAtLeast(t *testing.T) {
	got := Decide(errors.New("boom"), 1, Policy{MaxAttempts: 0}, 0, 0)
	if got.Action != DeadLetter || got.Reason != Exhausted {
		t.Fatalf("MaxAttempts 0 means 1: got %+v", got)
	}
}

func TestBackoffFullJitter(t *testing.T) {
	p := Policy{Base: time.Second, Cap: 4 * time.Second}
	for attempt, want := range map[int]time.Duration{1: time.Second, 2: 2 * time.Second,
		3: 4 * time.Second, 4: 4 * time.Second, 100: 4 * time.Second, -5: time.Second} {
		if got := p.Backoff(attempt, 0.999999999); got >= want || got < want*99/100 {
			t.Errorf("Backoff(%d, ~1) = %v, want just under %v", attempt, got, want)
		}
		if got := p.Backoff(attempt, 0); got != 0 {
			t.Errorf("Backoff(%d, 0) = %v, want 0", attempt, got)
		}
	}
}

type msg struct{ id, key, tenant string }

func scope() Scope[msg] {
	return Scope[msg]{
		Operation: "charge",
		Base:      func(m msg) string { return "orders" },
		MessageID: func(m msg) string { return m.id },
	}
}

func TestCallDefaultKeyIsMessageID(t *testing.T) {
	c, err := scope().Call(msg{id: "m-1"}, []byte("body"))
	if err != nil {
		t.Fatal(err)
	}
	want := idempotency.Call{Principal: "orders", Operation: "charge", Key: "m-1",
		Payload: []byte("body")}
	if c.Principal != want.Principal || c.Operation != want.Operation || c.Key != want.Key ||
		string(c.Payload) != "body" {
		t.Fatalf("Call = %+v, want %+v", c, want)
	}
}

func TestCallPoison(t *testing.T) {
	withKey := scope()
	withKey.Key = func(m msg) (string, error) {
		if m.key == "fail" {
			return "", errors.New("undecodable")
		}
		return m.key, nil
	}
	withTenant := scope()
	withTenant.Tenant = func(m msg) (string, error) { return m.tenant, nil }
	cases := []struct {
		name string
		s    Scope[msg]
		m    msg
		want Reason
	}{
		{"no message id", scope(), msg{}, KeyMissing},
		{"message id not a key", scope(), msg{id: "a\nb"}, KeyInvalid},
		{"key function fails", withKey, msg{id: "m-1", key: "fail"}, KeyInvalid},
		{"key function gives nothing", withKey, msg{id: "m-1"}, KeyInvalid},
		{"no tenant", withTenant, msg{id: "m-1"}, TenantMissing},
		{"tenant with a slash", withTenant, msg{id: "m-1", tenant: "a/b"}, TenantMissing},
		{"tenant too long", withTenant, msg{id: "m-1", tenant: strings.Repeat("t", 256)},
			TenantMissing},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := c.s.Call(c.m, nil)
			var p *PoisonError
			if !errors.As(err, &p) || p.Reason != c.want {
				t.Fatalf("Call(%+v) = %v, want a PoisonError %s", c.m, err, c.want)
			}
			if c.m.id != "" && strings.Contains(err.Error(), c.m.id) && c.m.id != "m-1" {
				t.Fatalf("the error %q names the raw key", err)
			}
		})
	}
}

func TestCallTenantAndPrincipal(t *testing.T) {
	s := scope()
	s.Principal = "payments"
	s.Tenant = func(m msg) (string, error) { return m.tenant, nil }
	c, err := s.Call(msg{id: "m-1", tenant: "acme"}, nil)
	if err != nil || c.Principal != "payments/acme" {
		t.Fatalf("Call = %+v, %v; want the principal payments/acme", c, err)
	}
}

func TestCheckOperation(t *testing.T) {
	for op, ok := range map[string]bool{"charge": true, "": false,
		strings.Repeat("o", 255): true, strings.Repeat("o", 256): false, "\xff": false} {
		if err := CheckOperation(op); (err == nil) != ok {
			t.Errorf("CheckOperation(%d bytes) = %v, want ok %v", len(op), err, ok)
		}
	}
}

// FuzzCall checks that no message makes Call panic, that every call it
// returns passes keygen.Validate, and that two tenants of one base never
// share a principal.
func FuzzCall(f *testing.F) {
	f.Add("m-1", "acme", "beta")
	f.Add("", "a/b", "a")
	f.Add("k\x00", "", "x")
	f.Fuzz(func(t *testing.T, id, t1, t2 string) {
		s := scope()
		s.Tenant = func(m msg) (string, error) { return m.tenant, nil }
		c1, err1 := s.Call(msg{id: id, tenant: t1}, nil)
		c2, err2 := s.Call(msg{id: id, tenant: t2}, nil)
		for _, r := range []struct {
			c   idempotency.Call
			err error
		}{{c1, err1}, {c2, err2}} {
			if r.err == nil {
				if err := keygen.Validate(r.c.Key); err != nil {
					t.Fatalf("Call returned the invalid key %q", r.c.Key)
				}
			} else if !errors.As(r.err, new(*PoisonError)) {
				t.Fatalf("Call's error %v is not a PoisonError", r.err)
			}
		}
		if err1 == nil && err2 == nil && t1 != t2 && c1.Principal == c2.Principal {
			t.Fatalf("tenants %q and %q share the principal %q", t1, t2, c1.Principal)
		}
	})
}
