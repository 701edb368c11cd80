// Package consume is what the broker adapters (idempotency/natsconsumer,
// idempotency/amqpconsumer) share: the scope of a message, and the one pure
// function that decides what a call's outcome does to its message.
package consume

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/jitter"
	"github.com/saferetry/saferetry/keygen"
)

// Action is what an adapter does to a message.
type Action int

const (
	// Ack acknowledges the message: its outcome is stored (or it was a
	// duplicate of a stored one).
	Ack Action = iota
	// Redeliver has the broker deliver the message again after Verdict.Delay.
	Redeliver
	// DeadLetter moves the message to the dead-letter path at once.
	DeadLetter
)

// Reason is why a message got its Action: a snake_case label for logs and
// dead-letter headers.
type Reason string

// The reasons.
const (
	Completed        Reason = "completed"          // the handler ran, its outcome is stored
	Replayed         Reason = "replayed"           // a duplicate of a completed message
	InProgress       Reason = "in_progress"        // another execution holds the key
	Failed           Reason = "failed"             // the handler failed; redelivered
	StoreUnavailable Reason = "store_unavailable"  // the store failed; redelivered
	Definitive       Reason = "definitive"         // the handler's failure is final, stored
	Exhausted        Reason = "attempts_exhausted" // Failed on the last attempt
	KeyMissing       Reason = "key_missing"        // no key in the message
	KeyInvalid       Reason = "key_invalid"        // the key function failed or keygen refused it
	TenantMissing    Reason = "tenant_missing"     // the tenant function failed or gave none
	KeyReused        Reason = "key_reused"         // the key was used for another payload
	Invalid          Reason = "invalid"            // the call was refused (payload too large)
)

// Verdict is what to do with a message, and why.
type Verdict struct {
	Action Action
	Reason Reason
	Delay  time.Duration // how long before a redelivery (Redeliver only)
}

// Policy bounds the redeliveries of failed messages.
type Policy struct {
	MaxAttempts int           // deliveries before a failing message is dead-lettered, at least 1
	Base, Cap   time.Duration // full-jitter backoff between them
}

// The defaults of Policy.
const (
	DefaultMaxAttempts = 5
	DefaultBase        = time.Second
	DefaultCap         = 30 * time.Second
)

// Outcome returns what a call of Do does to its message, delivered for the
// attempt-th time: err is Scope.Call's *PoisonError or Do's error, replayed
// Do's Result.Replayed. It is Decide with a random backoff, the wait of an
// *idempotency.InProgressError for a key another execution holds, and
// reason Replayed for an acknowledged duplicate.
func Outcome(err error, replayed bool, attempt int, p Policy) Verdict {
	var poison *PoisonError
	if errors.As(err, &poison) {
		return Verdict{Action: DeadLetter, Reason: poison.Reason}
	}
	r := rand.Float64()
	wait := p.Backoff(attempt, r)
	var busy *idempotency.InProgressError
	if errors.As(err, &busy) {
		wait = busy.RetryAfter // when the other execution's lease ends
	}
	v := Decide(err, attempt, p, wait, r)
	if v.Action == Ack && replayed {
		v.Reason = Replayed
	}
	return v
}

// Backoff returns the full-jitter wait before delivery attempt+1, for r in
// [0, 1): uniform in [0, min(Cap, Base*2^(attempt-1))).
func (p Policy) Backoff(attempt int, r float64) time.Duration {
	return jitter.Full(attempt-1, 0, p.Base, p.Cap, r)
}

// Decide returns what a call of Do that returned err does to its message,
// delivered for the attempt-th time (1 for the first delivery). inProgress
// is the wait for a key held by another execution (the remainder of its
// lease), r a random value in [0, 1) for the backoff. Decide is pure.
func Decide(err error, attempt int, p Policy, inProgress time.Duration, r float64) Verdict {
	var panicked *idempotency.PanicError
	switch {
	case err == nil:
		return Verdict{Action: Ack, Reason: Completed}
	case errors.Is(err, idempotency.ErrOutputTooLarge):
		// The call completed; only its output could not be kept.
		return Verdict{Action: Ack, Reason: Completed}
	case errors.Is(err, idempotency.ErrDefinitive):
		return Verdict{Action: DeadLetter, Reason: Definitive}
	case errors.Is(err, idempotency.ErrKeyReused):
		return Verdict{Action: DeadLetter, Reason: KeyReused}
	case errors.Is(err, keygen.ErrInvalidKey):
		return Verdict{Action: DeadLetter, Reason: KeyInvalid}
	case errors.Is(err, idempotency.ErrInvalidCall), errors.Is(err, idempotency.ErrRecordTooLarge):
		return Verdict{Action: DeadLetter, Reason: Invalid}
	case errors.Is(err, idempotency.ErrInProgress):
		return Verdict{Action: Redeliver, Reason: InProgress, Delay: max(inProgress, 0)}
	case errors.Is(err, idempotency.ErrStoreUnavailable):
		// Nothing is wrong with the message: it waits for the store, and is
		// never dead-lettered for the store's outage.
		return Verdict{Action: Redeliver, Reason: StoreUnavailable, Delay: p.Backoff(attempt, r)}
	case errors.As(err, &panicked), errors.Is(err, idempotency.ErrIncomplete):
	}
	if attempt >= max(p.MaxAttempts, 1) {
		return Verdict{Action: DeadLetter, Reason: Exhausted}
	}
	return Verdict{Action: Redeliver, Reason: Failed, Delay: p.Backoff(attempt, r)}
}

// PoisonError is the error of a message that cannot be called at all: no
// key, a key or tenant function that failed. Its Reason says which.
type PoisonError struct {
	Reason Reason
	Err    error
}

func (e *PoisonError) Error() string { return fmt.Sprintf("%s: %v", e.Reason, e.Err) }
func (e *PoisonError) Unwrap() error { return e.Err }

// ErrKeyMissing is the cause of a KeyMissing PoisonError.
var ErrKeyMissing = errors.New("the message has no key (no message id and no key function)")

// Scope makes the calls of one operation from messages of type M.
type Scope[M any] struct {
	Operation string
	Principal string                  // "" means Base's
	Base      func(M) string          // the principal when Principal is "": the stream or queue
	Key       func(M) (string, error) // nil means MessageID
	MessageID func(M) string          // the producer's message id
	Tenant    func(M) (string, error) // nil means no tenant
}

// CheckOperation returns an error unless op is a valid Call.Operation: 1 to
// 255 bytes of valid UTF-8.
func CheckOperation(op string) error {
	if op == "" || len(op) > 255 || !utf8.ValidString(op) {
		return fmt.Errorf("an operation is 1 to 255 bytes of valid UTF-8; got %d bytes", len(op))
	}
	return nil
}

// Call returns the call of Do for m with its payload, or a *PoisonError.
// The principal is the Scope's (or Base's), followed by "/" and the tenant
// when there is a Tenant function; a tenant is 1 to 255 bytes of valid
// UTF-8 without "/", so that no two (principal, tenant) pairs meet.
func (s Scope[M]) Call(m M, payload []byte) (idempotency.Call, error) {
	c := idempotency.Call{Principal: s.Principal, Operation: s.Operation, Payload: payload}
	if c.Principal == "" && s.Base != nil {
		c.Principal = s.Base(m)
	}
	if s.Tenant != nil {
		t, err := s.Tenant(m)
		switch {
		case err != nil:
			return c, &PoisonError{Reason: TenantMissing, Err: err}
		case t == "" || len(t) > 255 || !utf8.ValidString(t) || strings.Contains(t, "/"):
			return c, &PoisonError{Reason: TenantMissing, Err: fmt.Errorf(
				"a tenant is 1 to 255 bytes of valid UTF-8 without \"/\"; got %d bytes", len(t))}
		}
		c.Principal += "/" + t
	}
	if s.Key == nil {
		if c.Key = s.MessageID(m); c.Key == "" {
			return c, &PoisonError{Reason: KeyMissing, Err: ErrKeyMissing}
		}
	} else {
		k, err := s.Key(m)
		if err != nil {
			return c, &PoisonError{Reason: KeyInvalid, Err: fmt.Errorf("the key function: %w", err)}
		}
		c.Key = k
	}
	if err := keygen.Validate(c.Key); err != nil {
		return c, &PoisonError{Reason: KeyInvalid, Err: err}
	}
	return c, nil
}
