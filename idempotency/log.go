package idempotency

import (
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"

	"github.com/saferetry/saferetry/deadline"
	"github.com/saferetry/saferetry/keygen"
)

// logObserver is the Observer that writes the slog records of a Middleware,
// its Completer and its Reaper (WithLogger). A request is named by method,
// route and the digests of its key and principal, never the raw values.
type logObserver struct {
	l *slog.Logger
	// One record a second at most for each kind of refusal that a fill or
	// an outage repeats for every request, with the count of those left
	// out.
	unavailable, full, noPrincipal refusals
}

type refusals struct {
	every   rate.Sometimes
	skipped atomic.Int64
}

// do runs f with the count of the refusals skipped since the last run, at
// most once a second.
func (r *refusals) do(f func(skipped int64)) {
	ran := false
	r.every.Do(func() {
		ran = true
		f(r.skipped.Swap(0))
	})
	if !ran {
		r.skipped.Add(1)
	}
}

func newLogObserver(l *slog.Logger) Observer {
	o := &logObserver{l: l}
	o.unavailable.every.Interval = time.Second
	o.full.every.Interval = time.Second
	o.noPrincipal.every.Interval = time.Second
	return Observer{
		Claimed: o.claimed, Executed: o.executed, Replayed: o.replayed, Refused: o.refused,
		StoreCall: o.storeCall, Unfinished: o.unfinishedRecord, CompleterRun: o.completerRun,
		ReaperRun: o.reaperRun,
	}
}

func scopeAttrs(s Scope, attrs ...slog.Attr) []slog.Attr {
	return append([]slog.Attr{
		slog.String("method", s.Method), slog.String("route", s.Route),
		slog.String("key_digest", keygen.Digest(s.Key)),
		slog.String("principal_digest", keygen.Digest(s.Principal)),
	}, attrs...)
}

// withAttempt appends to attrs the attempt number that the request's caller
// sent (deadline.Attempt: 1 for a first try), when it sent one.
func withAttempt(ctx context.Context, attrs []slog.Attr) []slog.Attr {
	if n := deadline.Attempt(ctx); n > 0 {
		return append(attrs, slog.Int("attempt", n))
	}
	return attrs
}

func (o *logObserver) claimed(ctx context.Context, e Event) {
	if e.Background {
		o.l.LogAttrs(ctx, slog.LevelInfo, "idempotency completer: took over an abandoned request",
			scopeAttrs(e.Scope, slog.Int64("generation", e.Generation),
				slog.String("recovery_point", e.RecoveryPoint))...)
	}
}

// outcomeLog is how the logging observer reports an execution's outcome:
// its level and message for a client's request (live) and for the
// Completer's (background).
type outcomeLog struct {
	live, background slog.Level
	msg, bgMsg       string
}

var outcomeLogs = map[Outcome]outcomeLog{
	OutcomeCompleted: {slog.LevelDebug, slog.LevelInfo, "idempotency: the response was stored",
		"idempotency completer: completed an abandoned request"},
	OutcomeReleased: {slog.LevelDebug, slog.LevelWarn,
		"idempotency: the answer is not stored; the key was given up",
		"idempotency completer: the resumed request failed before any phase; the key was given up"},
	OutcomeKept: {slog.LevelInfo, slog.LevelWarn,
		"idempotency: the answer is not stored; the record is kept at its recovery point " +
			"for a resume",
		"idempotency completer: the resumed request failed after a committed phase; " +
			"it stays in progress"},
	OutcomeIncomplete: {slog.LevelError, slog.LevelError,
		"idempotency: the handler answered while an external call's outcome is unknown; " +
			"its answer is neither stored nor sent, and the record is kept for a resume", ""},
	OutcomePanicked: {slog.LevelWarn, slog.LevelWarn,
		"idempotency: the handler panicked; the key was given up or kept for a resume", ""},
	OutcomeLost: {slog.LevelWarn, slog.LevelWarn,
		"idempotency: the lease was lost before completion; the response is discarded", ""},
	OutcomeFailed: {slog.LevelError, slog.LevelError,
		"idempotency: the store failed at the end of the request", ""},
	OutcomeNeedsCredentials: {slog.LevelWarn, slog.LevelWarn, "",
		"idempotency completer: the resumed request was refused for want of credentials " +
			"(401 or 403), which a resume never carries; it is kept for the client's retry"},
	OutcomeUnresumable: {slog.LevelWarn, slog.LevelWarn, "",
		"idempotency completer: an abandoned request cannot be resumed; it stays until " +
			"the Reaper deletes it"},
}

// notReplayableMsg is the message of a completion whose response was too
// large to be stored for replay.
const notReplayableMsg = "idempotency: the response (or output) is too large to be stored " +
	"for replay (WithMaxStoredBody); it completed, and its retries get 409 " +
	string(CodeResponseNotReplayable) + " (Do: ErrOutputTooLarge)"

func (o *logObserver) executed(ctx context.Context, e Event) {
	ol := outcomeLogs[e.Outcome]
	level, msg := ol.live, ol.msg
	if e.Background && ol.bgMsg != "" {
		level, msg = ol.background, ol.bgMsg
	}
	if e.Code == CodeResponseNotReplayable {
		level, msg = slog.LevelWarn, notReplayableMsg
	}
	if e.Err != nil {
		level = max(level, slog.LevelWarn)
	}
	if !o.l.Enabled(ctx, level) {
		return
	}
	attrs := withAttempt(ctx, scopeAttrs(e.Scope, slog.String("outcome", string(e.Outcome)),
		slog.Int("status", e.Status), slog.Int64("generation", e.Generation),
		slog.String("recovery_point", e.RecoveryPoint), slog.Duration("duration", e.Duration)))
	if e.Err != nil {
		attrs = append(attrs, slog.String("error", e.Err.Error()))
	}
	o.l.LogAttrs(ctx, level, msg, attrs...)
}

// replayed logs a replay at Debug: the contract working as it should.
func (o *logObserver) replayed(ctx context.Context, e Event) {
	if o.l.Enabled(ctx, slog.LevelDebug) {
		o.l.LogAttrs(ctx, slog.LevelDebug, "idempotency: replayed the stored response",
			withAttempt(ctx, scopeAttrs(e.Scope, slog.Int("status", e.Status)))...)
	}
}

// refused logs the middleware's own answers: at Error or Warn, at most once
// a second, those of a server that cannot serve (the store down or full,
// the principal function failing); at Warn a key reused for another
// request (a client bug); at Debug the others (in progress, a replay that
// is not replayable, a request's own error).
func (o *logObserver) refused(ctx context.Context, e Event) {
	level, msg := slog.LevelError, "idempotency: store unavailable; guarded requests are refused"
	r := &o.unavailable
	switch e.Code {
	case CodeStoreUnavailable:
	case CodeStoreFull:
		level, msg, r = slog.LevelWarn,
			"idempotency: store full; new keys are refused until records expire", &o.full
	case CodePrincipalUnavailable:
		level, msg, r = slog.LevelError,
			"idempotency: the principal function failed; guarded requests are refused with 503",
			&o.noPrincipal
	case CodeKeyReused:
		o.l.LogAttrs(ctx, slog.LevelWarn, "idempotency: a key was reused for a different request "+
			"(a client bug: a new request needs a new key); refused",
			withAttempt(ctx, scopeAttrs(e.Scope, slog.Int("status", e.Status),
				slog.String("code", string(e.Code))))...)
		return
	default:
		if o.l.Enabled(ctx, slog.LevelDebug) {
			o.l.LogAttrs(ctx, slog.LevelDebug, "idempotency: refused",
				withAttempt(ctx, scopeAttrs(e.Scope, slog.Int("status", e.Status),
					slog.String("code", string(e.Code))))...)
		}
		return
	}
	r.do(func(skipped int64) {
		attrs := withAttempt(ctx, scopeAttrs(e.Scope,
			slog.Int64("refused_since_last_record", skipped)))
		if e.Err != nil {
			attrs = append(attrs, slog.String("error", e.Err.Error()))
		}
		o.l.LogAttrs(ctx, level, msg, attrs...)
	})
}

func (o *logObserver) storeCall(ctx context.Context, e Event) {
	if e.Err == nil {
		return
	}
	// A lost lease is an answer: the execution's outcome reports it.
	lost := errors.Is(e.Err, ErrLeaseLost)
	switch {
	case e.Op == OpHeartbeat && !lost:
		o.l.LogAttrs(ctx, slog.LevelWarn, "idempotency: heartbeat failed",
			scopeAttrs(e.Scope, slog.String("error", e.Err.Error()))...)
	case (e.Op == OpRelease || e.Op == OpEndLease) && !lost:
		o.l.LogAttrs(ctx, slog.LevelError,
			"idempotency: giving the key up failed; it stays claimed until its lease expires",
			scopeAttrs(e.Scope, slog.String("op", string(e.Op)),
				slog.String("error", e.Err.Error()))...)
	}
}

// unfinishedRecord logs a record the Reaper is about to delete, for a
// person to act on: with the phase and downstream key digest of an External
// call whose outcome is unknown, the side effect to check first.
func (o *logObserver) unfinishedRecord(ctx context.Context, rec Record, age time.Duration) {
	attrs := scopeAttrs(rec.Scope,
		slog.String("owner", rec.Owner), slog.Int64("generation", rec.Generation),
		slog.String("recovery_point", rec.RecoveryPoint),
		slog.Int("recovery_data_bytes", len(rec.RecoveryData)),
		slog.Time("created_at", rec.CreatedAt), slog.Time("lease_until", rec.LeaseUntil),
		slog.Duration("age", age))
	if data, err := decodeRecovery(rec.RecoveryData); err == nil && data.Pending != nil {
		attrs = append(attrs, slog.String("pending_phase", data.Pending.Phase),
			slog.String("downstream_key_digest", keygen.Digest(data.Pending.DownstreamKey)))
	}
	o.l.LogAttrs(ctx, slog.LevelWarn,
		"idempotency reaper: deleting an unfinished request past the cleanup horizon; "+
			"check its side effects", attrs...)
}

func (o *logObserver) completerRun(ctx context.Context, rep CompleterReport, err error) {
	if err != nil {
		o.l.LogAttrs(ctx, slog.LevelError, "idempotency completer: run failed",
			slog.String("error", err.Error()), slog.Int("completed", rep.Completed))
		return
	}
	level := slog.LevelInfo
	if rep.Found == 0 {
		level = slog.LevelDebug
	}
	o.l.LogAttrs(ctx, level, "idempotency completer: run finished",
		slog.Int("found", rep.Found), slog.Int("completed", rep.Completed),
		slog.Int("released", rep.Released),
		slog.Int("kept", rep.Kept), slog.Int("need_credentials", rep.NeedCredentials),
		slog.Int("skipped", rep.Skipped), slog.Int("failed", rep.Failed))
}

func (o *logObserver) reaperRun(ctx context.Context, rep ReaperReport, err error) {
	if err != nil {
		o.l.LogAttrs(ctx, slog.LevelError, "idempotency reaper: run failed",
			slog.String("error", err.Error()), slog.Int("deleted", rep.Deleted))
		return
	}
	level := slog.LevelInfo
	if rep.Deleted == 0 && len(rep.Unfinished) == 0 {
		level = slog.LevelDebug
	}
	o.l.LogAttrs(ctx, level, "idempotency reaper: run finished",
		slog.Time("horizon", rep.Horizon), slog.Int("deleted", rep.Deleted),
		slog.Int("batches", rep.Batches),
		slog.Int("unfinished", len(rep.Unfinished)), slog.Int("skipped", rep.Skipped))
}
