package saferetry

import (
	"context"
	"log/slog"

	"github.com/saferetry/saferetry/keygen"
	"github.com/saferetry/saferetry/retry"
)

// logObserver is the Observer that writes the Transport's slog records:
// WithLogger's logger, or slog.Default() at the time of each record when
// none was set. The raw key never appears: only its digest.
type logObserver struct {
	logger  *slog.Logger // nil: slog.Default()
	maxBody int64        // WithMaxBufferedBody
}

func (l logObserver) observer() Observer {
	return Observer{AttemptStart: l.attemptStart, AttemptDone: l.attemptDone, Poll: l.poll}
}

func (l logObserver) get() *slog.Logger {
	if l.logger != nil {
		return l.logger
	}
	return slog.Default()
}

// attemptStart writes, before the first attempt, the record of a body too
// large to buffer, which is sent once without retries.
func (l logObserver) attemptStart(ctx context.Context, a AttemptStartInfo) context.Context {
	if a.Attempt == 1 && a.NotRetrying == retry.ReasonBodyNotRewindable {
		l.get().LogAttrs(ctx, slog.LevelInfo,
			"saferetry: request body too large to buffer; sent once without retries",
			slog.String("method", a.Request.Method), slog.String("host", a.Request.URL.Host),
			slog.String("path", a.Request.URL.Path), slog.Int64("max_buffered_body", l.maxBody))
	}
	return ctx
}

// attemptDone writes the one record of an attempt. Debug: a first-try
// answer below 500, an attempt that lost to a hedge; Info: an attempt that
// will be retried, one discarded while another is in flight, or an answer
// after retries or a 5xx; Warn: an error, or a stopped loop.
func (l logObserver) attemptDone(ctx context.Context, a AttemptDoneInfo) {
	level := slog.LevelWarn
	switch {
	case a.Outcome == OutcomeLost:
		level = slog.LevelDebug
	case a.Outcome == OutcomeRetry || a.Outcome == OutcomeDiscarded:
		level = slog.LevelInfo
	case a.Outcome == OutcomeFinal && a.Response != nil:
		level = slog.LevelDebug
		if a.Attempt > 1 || a.Response.StatusCode >= 500 {
			level = slog.LevelInfo // after retries, or a server error: visible
		}
	}
	lg := l.get()
	if !lg.Enabled(ctx, level) {
		return
	}
	attrs := make([]slog.Attr, 0, 15)
	attrs = append(attrs,
		slog.Int("attempt", a.Attempt),
		slog.String("method", a.Request.Method),
		slog.String("host", a.Request.URL.Host),
		slog.String("path", a.Request.URL.Path),
		slog.String("class", string(a.Decision.Class)),
	)
	if a.Hedge {
		attrs = append(attrs, slog.Bool("hedge", true))
	}
	if a.Response != nil {
		attrs = append(attrs, slog.Int("status", a.Response.StatusCode))
	}
	if a.Err != nil {
		attrs = append(attrs, slog.String("error", a.Err.Error()))
	}
	attrs = append(attrs,
		slog.Duration("elapsed", a.Elapsed),
		slog.Duration("total", a.Total),
		slog.String("outcome", string(a.Outcome)),
	)
	switch a.Outcome {
	case OutcomeRetry:
		attrs = append(attrs, slog.Duration("wait", a.Wait))
	case OutcomeStopped:
		attrs = append(attrs, slog.String("stop", string(a.Stop)))
	}
	if a.Decision.HasRetryAfter {
		attrs = append(attrs, slog.Duration("retry_after", a.Decision.RetryAfter))
	}
	if a.Stop == retry.ReasonBudget {
		attrs = append(attrs, slog.Int("budget_left", a.BudgetLeft))
	}
	if a.Key != "" {
		attrs = append(attrs, slog.String("key_digest", keygen.Digest(a.Key)))
	}
	msg := "saferetry: attempt"
	switch {
	case a.Outcome == OutcomeRetry:
		msg = "saferetry: attempt failed, retrying"
	case a.Outcome == OutcomeLost:
		msg = "saferetry: attempt lost to another, canceled"
	case a.Outcome == OutcomeDiscarded:
		msg = "saferetry: attempt discarded, another in flight"
	case level == slog.LevelWarn:
		msg = "saferetry: giving up"
	}
	lg.LogAttrs(ctx, level, msg, attrs...)
}
