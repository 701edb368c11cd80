package idempotencytest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/saferetry/saferetry/idempotency"
)

// functionTests run the function door (Middleware.Do) over the store, at
// the real clock and without sleeping: the same states as requests, its
// conflicts, failures and resumes, a takeover of an expired lease, the
// Completer, and a claim whose answer was lost.
var functionTests = []suiteTest{
	{"DoRunsOnceAndReplaysBytes", testDoReplays, 0},
	{"DoScopeIsPrincipalOperationKey", testDoScope, 0},
	{"DoKeyReused", testDoKeyReused, 0},
	{"DoInProgress", testDoInProgress, 0},
	{"DoErrorReleasesOrResumes", testDoFailures, 0},
	{"DoDefinitiveFailureIsStored", testDoDefinitive, 0},
	{"DoOutputTooLarge", testDoOutputTooLarge, 0},
	{"DoPanic", testDoPanic, 0},
	{"DoInvalidCall", testDoInvalid, 0},
	{"DoTakeoverIsFenced", testDoTakeover, 0},
	{"DoCompleterResumes", testDoCompleter, needsSweeper},
	{"DoClaimAnswerLost", testDoClaimAnswerLost, 0},
}

// oddBytes are output and payload bytes that no text encoding keeps.
var oddBytes = []byte("out\x00\xff\xfe \"\\\n\u2028 end")

// doer returns the Middleware a function door's subtest calls, over s.
func doer(s idempotency.Store, opts ...idempotency.Option) *idempotency.Middleware {
	return idempotency.New(s, append([]idempotency.Option{idempotency.WithLogger(discard)},
		opts...)...)
}

// call is the Call of the subtests: principal acct-1, operation
// "réconcilier ☃" (any UTF-8), key and payload as given.
func call(key string, payload []byte) idempotency.Call {
	return idempotency.Call{Principal: "acct-1", Operation: "réconcilier ☃", Key: key,
		Payload: payload}
}

// counted returns fn that counts its runs in n and returns out.
func counted(n *int, out []byte) func(context.Context, *idempotency.Run) ([]byte, error) {
	return func(context.Context, *idempotency.Run) ([]byte, error) {
		*n++
		return out, nil
	}
}

// wantResult fails unless Do returned out with replayed and no error.
func wantResult(t *testing.T, what string, res idempotency.Result, err error, out []byte,
	replayed bool) {
	t.Helper()
	if err != nil || !bytes.Equal(res.Output, out) || res.Replayed != replayed {
		t.Fatalf("%s: Result{%q, Replayed %v}, %v; want %q, Replayed %v", what, res.Output,
			res.Replayed, err, out, replayed)
	}
}

// testDoReplays: a fresh key runs fn once and stores its output; every
// later call gets those bytes back, Replayed, without running fn, and a
// caller that modifies its Output changes no other caller's.
func testDoReplays(t *testing.T, s idempotency.Store) {
	mw := doer(s)
	runs := 0
	res, err := mw.Do(ctx(t), call("replay", oddBytes), counted(&runs, bytes.Clone(oddBytes)))
	wantResult(t, "the first call", res, err, oddBytes, false)
	for i := range 2 {
		res, err = mw.Do(ctx(t), call("replay", oddBytes), counted(&runs, nil))
		wantResult(t, fmt.Sprintf("replay %d", i), res, err, oddBytes, true)
		res.Output[0] = 'X' // the caller's copy
	}
	if runs != 1 {
		t.Fatalf("fn ran %d times, want 1", runs)
	}
	empty := 0
	res, err = mw.Do(ctx(t), call("empty", nil), counted(&empty, nil))
	wantResult(t, "an empty output", res, err, nil, false)
	res, err = mw.Do(ctx(t), call("empty", nil), counted(&empty, []byte("other")))
	if err != nil || len(res.Output) != 0 || !res.Replayed || empty != 1 {
		t.Fatalf("the replay of an empty output: %q, Replayed %v, %v after %d runs", res.Output,
			res.Replayed, err, empty)
	}
}

// testDoScope: the same key under another principal or another operation
// is another record: fn runs for each.
func testDoScope(t *testing.T, s idempotency.Store) {
	mw := doer(s)
	runs := 0
	calls := []idempotency.Call{
		call("scope", []byte("p")),
		{Principal: "acct-2", Operation: "réconcilier ☃", Key: "scope", Payload: []byte("p")},
		{Principal: "acct-1", Operation: "refund", Key: "scope", Payload: []byte("p")},
	}
	for i, c := range calls {
		out := []byte(fmt.Sprintf("out %d", i))
		res, err := mw.Do(ctx(t), c, counted(&runs, out))
		wantResult(t, fmt.Sprintf("call %d", i), res, err, out, false)
	}
	for i, c := range calls {
		res, err := mw.Do(ctx(t), c, counted(&runs, nil))
		wantResult(t, fmt.Sprintf("replay %d", i), res, err, []byte(fmt.Sprintf("out %d", i)), true)
	}
	if runs != len(calls) {
		t.Fatalf("fn ran %d times, want %d", runs, len(calls))
	}
}

// testDoKeyReused: the same key with another payload is refused with
// ErrKeyReused, before and after the first call completed; fn does not run.
func testDoKeyReused(t *testing.T, s idempotency.Store) {
	mw := doer(s)
	runs := 0
	_, err := mw.Do(ctx(t), call("reused", []byte("a")), func(ctx context.Context,
		run *idempotency.Run) ([]byte, error) {
		runs++
		_, err := mw.Do(ctx, call("reused", []byte("b")), counted(&runs, nil))
		if !errors.Is(err, idempotency.ErrKeyReused) {
			t.Errorf("another payload while the first runs: %v, want ErrKeyReused", err)
		}
		return []byte("a"), nil
	})
	noErr(t, "the first call", err)
	_, err = mw.Do(ctx(t), call("reused", []byte("b")), counted(&runs, nil))
	if !errors.Is(err, idempotency.ErrKeyReused) || runs != 1 {
		t.Fatalf("another payload after the first completed: %v after %d runs; want "+
			"ErrKeyReused after 1", err, runs)
	}
}

// testDoInProgress: a call while the first runs gets ErrInProgress at once
// (no wait), and with a wait it gets the first call's output once that
// completes.
func testDoInProgress(t *testing.T, s idempotency.Store) {
	mw := doer(s)
	runs := 0
	res, err := mw.Do(ctx(t), call("busy", nil), func(ctx context.Context,
		run *idempotency.Run) ([]byte, error) {
		runs++
		_, err := mw.Do(ctx, call("busy", nil), counted(&runs, nil))
		var busy *idempotency.InProgressError
		switch {
		case !errors.Is(err, idempotency.ErrInProgress) || !errors.As(err, &busy):
			t.Errorf("a call while the first runs: %v, want an InProgressError", err)
		case busy.RetryAfter < 20*time.Second || busy.RetryAfter > 30*time.Second+time.Millisecond:
			t.Errorf("RetryAfter %v: want what the first call's lease (30 s) has left",
				busy.RetryAfter)
		}
		return []byte("first"), nil
	})
	wantResult(t, "the first call", res, err, []byte("first"), false)

	waiting := doer(s, idempotency.WithMaxInProgressWait(time.Minute))
	started, finish := make(chan struct{}), make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		res, err := mw.Do(ctx(t), call("wait", nil), func(context.Context,
			*idempotency.Run) ([]byte, error) {
			close(started)
			<-finish
			return []byte("waited for"), nil
		})
		if err != nil || string(res.Output) != "waited for" {
			t.Errorf("the first call: %q, %v", res.Output, err)
		}
	}()
	<-started
	got := make(chan error, 1)
	go func() {
		res, err := waiting.Do(ctx(t), call("wait", nil), counted(&runs, nil))
		if err == nil && (string(res.Output) != "waited for" || !res.Replayed) {
			err = fmt.Errorf("got %q, Replayed %v", res.Output, res.Replayed)
		}
		got <- err
	}()
	close(finish)
	wg.Wait()
	noErr(t, "a call that waited for the first", <-got)
	if runs != 1 {
		t.Fatalf("fn ran %d more times", runs-1)
	}
}

// testDoFailures: a plain error of fn releases the key (the next call runs
// fn again); after a committed phase, the next call resumes after it; the
// error comes back as fn returned it.
func testDoFailures(t *testing.T, s idempotency.Store) {
	mw := doer(s)
	boom := errors.New("boom")
	runs := 0
	fail := func(context.Context, *idempotency.Run) ([]byte, error) {
		runs++
		return nil, boom
	}
	if _, err := mw.Do(ctx(t), call("fails", nil), fail); err != boom {
		t.Fatalf("fn's error came back as %v", err)
	}
	res, err := mw.Do(ctx(t), call("fails", nil), counted(&runs, []byte("ok")))
	wantResult(t, "after a released failure", res, err, []byte("ok"), false)
	if runs != 2 {
		t.Fatalf("fn ran %d times, want 2", runs)
	}

	var orders, charges int
	phased := func(failAfter bool) func(context.Context, *idempotency.Run) ([]byte, error) {
		return func(ctx context.Context, run *idempotency.Run) ([]byte, error) {
			order, err := run.Phase(ctx, "order", func(context.Context) ([]byte, error) {
				orders++
				return []byte("ord_1"), nil
			})
			if err != nil {
				return nil, err
			}
			if failAfter {
				return nil, boom
			}
			charges++
			return append(order, " charged"...), nil
		}
	}
	if _, err := mw.Do(ctx(t), call("resumes", nil), phased(true)); err != boom {
		t.Fatalf("the first call: %v, want fn's error", err)
	}
	res, err = mw.Do(ctx(t), call("resumes", nil), phased(false))
	wantResult(t, "the resume", res, err, []byte("ord_1 charged"), false)
	if orders != 1 || charges != 1 {
		t.Fatalf("after the resume: %d orders and %d charges, want 1 each", orders, charges)
	}
}

// testDoDefinitive: a failure fn marks with ErrDefinitive is stored: every
// later call gets an error with the same message that matches
// ErrDefinitive, Replayed, and fn does not run again.
func testDoDefinitive(t *testing.T, s idempotency.Store) {
	mw := doer(s)
	runs := 0
	declined := fmt.Errorf("card declined \xff: %w", idempotency.ErrDefinitive)
	_, err := mw.Do(ctx(t), call("declined", nil), func(context.Context,
		*idempotency.Run) ([]byte, error) {
		runs++
		return nil, declined
	})
	if err != declined {
		t.Fatalf("the first call: %v, want fn's own error", err)
	}
	for i := range 2 {
		res, err := mw.Do(ctx(t), call("declined", nil), counted(&runs, []byte("ok")))
		if !errors.Is(err, idempotency.ErrDefinitive) || err.Error() != declined.Error() ||
			!res.Replayed {
			t.Fatalf("replay %d: %v (Replayed %v); want %q matching ErrDefinitive, Replayed", i,
				err, res.Replayed, declined)
		}
	}
	if runs != 1 {
		t.Fatalf("fn ran %d times, want 1", runs)
	}
}

// testDoOutputTooLarge: an output over WithMaxStoredBody reaches the call
// that ran fn and completes the record without it; later calls get
// ErrOutputTooLarge, Replayed, and fn never runs again.
func testDoOutputTooLarge(t *testing.T, s idempotency.Store) {
	mw := doer(s, idempotency.WithMaxStoredBody(4))
	runs := 0
	res, err := mw.Do(ctx(t), call("large", nil), counted(&runs, []byte("12345")))
	wantResult(t, "the first call", res, err, []byte("12345"), false)
	res, err = mw.Do(ctx(t), call("large", nil), counted(&runs, nil))
	if !errors.Is(err, idempotency.ErrOutputTooLarge) || !res.Replayed || runs != 1 {
		t.Fatalf("a later call: %v, Replayed %v, after %d runs; want ErrOutputTooLarge, "+
			"Replayed, after 1", err, res.Replayed, runs)
	}
	res, err = mw.Do(ctx(t), call("fits", nil), counted(&runs, []byte("1234")))
	wantResult(t, "an output at the limit", res, err, []byte("1234"), false)
	res, err = mw.Do(ctx(t), call("fits", nil), counted(&runs, nil))
	wantResult(t, "its replay", res, err, []byte("1234"), true)
}

// testDoPanic: a panic of fn is caught and returned as a *PanicError; the
// key is given up, and the next call runs fn.
func testDoPanic(t *testing.T, s idempotency.Store) {
	mw := doer(s)
	_, err := mw.Do(ctx(t), call("panics", nil), func(context.Context,
		*idempotency.Run) ([]byte, error) {
		panic("kaboom")
	})
	var pe *idempotency.PanicError
	if !errors.As(err, &pe) || pe.Value != "kaboom" || len(pe.Stack) == 0 {
		t.Fatalf("a panicking fn: %v, want a *PanicError with its value and stack", err)
	}
	runs := 0
	res, err := mw.Do(ctx(t), call("panics", nil), counted(&runs, []byte("ok")))
	wantResult(t, "after the panic", res, err, []byte("ok"), false)
}

// testDoInvalid: bad input gets ErrInvalidCall before anything runs or is
// stored.
func testDoInvalid(t *testing.T, s idempotency.Store) {
	mw := doer(s)
	runs := 0
	fn := counted(&runs, nil)
	long := string(bytes.Repeat([]byte("k"), 256))
	for _, tc := range []struct {
		name string
		c    idempotency.Call
		fn   func(context.Context, *idempotency.Run) ([]byte, error)
	}{
		{"no operation", idempotency.Call{Principal: "p", Key: "k"}, fn},
		{"operation too long", idempotency.Call{Principal: "p", Operation: long, Key: "k"}, fn},
		{"operation not UTF-8", idempotency.Call{Principal: "p", Operation: "op\xff", Key: "k"},
			fn},
		{"no key", idempotency.Call{Principal: "p", Operation: "op"}, fn},
		{"key too long", idempotency.Call{Principal: "p", Operation: "op", Key: long}, fn},
		{"key with a control byte", idempotency.Call{Principal: "p", Operation: "op",
			Key: "k\x00"}, fn},
		{"no principal", idempotency.Call{Operation: "op", Key: "k"}, fn},
		{"payload too large", idempotency.Call{Principal: "p", Operation: "op", Key: "k",
			Payload: make([]byte, 1<<20+1)}, fn},
		{"nil function", idempotency.Call{Principal: "p", Operation: "op", Key: "k"}, nil},
	} {
		if _, err := mw.Do(ctx(t), tc.c, tc.fn); !errors.Is(err, idempotency.ErrInvalidCall) {
			t.Fatalf("%s: %v, want ErrInvalidCall", tc.name, err)
		}
		sc := idempotency.Scope{Principal: tc.c.Principal, Route: tc.c.Operation, Key: tc.c.Key}
		if _, err := s.Get(ctx(t), sc); !errors.Is(err, idempotency.ErrNotFound) {
			t.Fatalf("%s: a record was stored (Get: %v)", tc.name, err)
		}
	}
	if runs != 0 {
		t.Fatalf("fn ran %d times", runs)
	}
}

// testDoTakeover: a call whose lease ends while fn runs (a stall) is taken
// over by the next call, which resumes after the phase the first
// committed and completes; the first, fenced, commits nothing more, and
// gets the successor's output.
func testDoTakeover(t *testing.T, s idempotency.Store) {
	mw := doer(s)
	var orders, charges int
	var second idempotency.Result
	var secondErr error
	fn := func(ctx context.Context, run *idempotency.Run) ([]byte, error) {
		_, err := run.Phase(ctx, "order", func(context.Context) ([]byte, error) {
			orders++
			return []byte("ord"), nil
		})
		if err != nil {
			return nil, err
		}
		_, err = run.Phase(ctx, "charge", func(context.Context) ([]byte, error) {
			charges++
			return []byte("ch"), nil
		})
		if err != nil {
			return nil, err
		}
		return []byte(fmt.Sprintf("generation %d", run.Lease.Generation)), nil
	}
	first, err := mw.Do(ctx(t), call("takeover", []byte("pay")), func(ctx context.Context,
		run *idempotency.Run) ([]byte, error) {
		_, err := run.Phase(ctx, "order", func(context.Context) ([]byte, error) {
			orders++
			return []byte("ord"), nil
		})
		noErr(t, "the first call's phase", err)
		// The process stalls: its lease ends, and the next call takes over.
		noErr(t, "ending the lease", s.Heartbeat(ctx, run.Lease, time.Now().Add(-time.Second)))
		second, secondErr = mw.Do(ctx, call("takeover", []byte("pay")), fn)
		// Its next phase runs, but commits nothing: its writes (in the
		// phase's unit, on a Transactor) roll back.
		_, err = run.Phase(ctx, "charge", func(context.Context) ([]byte, error) {
			return []byte("stale"), nil
		})
		if !errors.Is(err, idempotency.ErrLeaseLost) {
			t.Errorf("a phase of the stale owner: %v, want ErrLeaseLost", err)
		}
		return []byte("stale output"), nil
	})
	wantResult(t, "the successor", second, secondErr, []byte("generation 2"), false)
	wantResult(t, "the stale owner, given the successor's output", first, err,
		[]byte("generation 2"), true)
	if orders != 1 || charges != 1 {
		t.Fatalf("%d orders and %d charges, want 1 each", orders, charges)
	}
	rec := mustGet(t, s, idempotency.Scope{Principal: "acct-1", Route: "réconcilier ☃",
		Key: "takeover"})
	if rec.State != idempotency.Completed || rec.Generation != 2 || rec.RecoveryPoint != "charge" ||
		bytes.Contains(rec.RecoveryData, []byte("stale")) {
		t.Fatalf("the record: state %v gen %d point %q data %q; want completed by generation 2 "+
			"at charge, nothing of the stale owner's", rec.State, rec.Generation,
			rec.RecoveryPoint, rec.RecoveryData)
	}
}

// testDoCompleter: a call whose fn failed after a committed phase is kept;
// the Completer resumes it through the function registered for its
// Operation, which gets the payload in Run.Payload and the phase's saved
// output, and stores its output for the next call to replay.
func testDoCompleter(t *testing.T, s idempotency.Store) {
	mw := doer(s)
	orders := 0
	fn := func(fail bool) func(context.Context, *idempotency.Run) ([]byte, error) {
		return func(ctx context.Context, run *idempotency.Run) ([]byte, error) {
			order, err := run.Phase(ctx, "order", func(context.Context) ([]byte, error) {
				orders++
				return []byte("ord_7"), nil
			})
			if err != nil || fail {
				return nil, errors.Join(err, errors.New("crashed after the order"))
			}
			return append(append(order, ' '), run.Payload...), nil
		}
	}
	if _, err := mw.Do(ctx(t), call("resume", oddBytes), fn(true)); err == nil {
		t.Fatal("the first call succeeded")
	}
	c := mw.Completer(nil, idempotency.Function{Operation: "réconcilier ☃", Fn: fn(false)})
	rep, err := c.RunOnce(ctx(t))
	noErr(t, "Completer.RunOnce", err)
	if rep != (idempotency.CompleterReport{Found: 1, Completed: 1}) {
		t.Fatalf("Completer: %+v, want one record found and completed", rep)
	}
	want := append([]byte("ord_7 "), oddBytes...)
	res, err := mw.Do(ctx(t), call("resume", oddBytes), fn(false))
	wantResult(t, "the call after the Completer", res, err, want, true)
	if orders != 1 {
		t.Fatalf("%d orders, want 1", orders)
	}
}

// claimLost is a store whose first claim applies and then its answer is
// lost: it fails as if the connection died after the store ran it, or,
// with repeat, the store runs it once more (as a driver that sends it
// again on a fresh connection) and answers that: the record, as existing.
type claimLost struct {
	idempotency.Store
	repeat bool
	mu     sync.Mutex
	lost   bool
}

var errClaimLost = errors.New("idempotencytest: the claim's answer was lost with its connection")

func (s *claimLost) Claim(ctx context.Context, c idempotency.Claim) (idempotency.ClaimResult,
	error) {
	res, err := s.Store.Claim(ctx, c)
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil || s.lost {
		return res, err
	}
	s.lost = true
	if s.repeat {
		return s.Store.Claim(ctx, c)
	}
	return idempotency.ClaimResult{}, errClaimLost
}

// testDoClaimAnswerLost: the store runs a call's claim, then its answer is
// lost: the store fails, or runs the claim again and answers the record it
// finds, its own. Either way the record, read back, is the call's: fn runs
// (once), its output is stored, and the next call replays it instead of
// finding a lease that nobody holds.
func testDoClaimAnswerLost(t *testing.T, s idempotency.Store) {
	for _, repeat := range []bool{false, true} {
		lost := &claimLost{Store: s, repeat: repeat}
		mw := doer(lost)
		key := fmt.Sprintf("claim-lost-%v", repeat)
		runs := 0
		res, err := mw.Do(ctx(t), call(key, nil), counted(&runs, []byte("ran")))
		wantResult(t, key+": the call whose claim's answer was lost", res, err, []byte("ran"),
			false)
		if !lost.lost {
			t.Fatalf("%s: no claim's answer was lost", key)
		}
		res, err = mw.Do(ctx(t), call(key, nil), counted(&runs, nil))
		wantResult(t, key+": the next call", res, err, []byte("ran"), true)
		if runs != 1 {
			t.Fatalf("%s: fn ran %d times, want 1", key, runs)
		}
	}
}
