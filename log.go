package saferetry

import (
	"context"
	"log/slog"
	"net/http"
	"time"

	"github.com/saferetry/saferetry/keygen"
	"github.com/saferetry/saferetry/retry"
)

// attemptRecord is what one log record says about one attempt.
type attemptRecord struct {
	n            int
	dec          retry.Decision
	resp         *http.Response
	err          error
	elapsed      time.Duration
	total        time.Duration
	wait         time.Duration
	level        slog.Level
	budgetDenied bool
	budgetLeft   int
}

// log writes the one record of an attempt. outcome is "final", "retry" or
// the reason the loop stopped. The raw key never appears: only its digest.
func (c *call) log(ctx context.Context, a attemptRecord, outcome string) {
	l := c.t.logger()
	if !l.Enabled(ctx, a.level) {
		return
	}
	attrs := make([]slog.Attr, 0, 14)
	attrs = append(attrs,
		slog.Int("attempt", a.n),
		slog.String("method", c.req.Method),
		slog.String("host", c.req.URL.Host),
		slog.String("path", c.req.URL.Path),
		slog.String("class", a.dec.Class),
	)
	if a.resp != nil {
		attrs = append(attrs, slog.Int("status", a.resp.StatusCode))
	}
	if a.err != nil {
		attrs = append(attrs, slog.String("error", a.err.Error()))
	}
	attrs = append(attrs,
		slog.Duration("elapsed", a.elapsed),
		slog.Duration("total", a.total),
		slog.String("outcome", outcome),
	)
	if outcome == "retry" {
		attrs = append(attrs, slog.Duration("wait", a.wait))
	}
	if a.dec.HasRetryAfter {
		attrs = append(attrs, slog.Duration("retry_after", a.dec.RetryAfter))
	}
	if a.budgetDenied {
		attrs = append(attrs, slog.Int("budget_left", a.budgetLeft))
	}
	if c.key != "" {
		attrs = append(attrs, slog.String("key_digest", keygen.Digest(c.key)))
	}
	msg := "saferetry: attempt"
	switch {
	case outcome == "retry":
		msg = "saferetry: attempt failed, retrying"
	case a.level == slog.LevelWarn:
		msg = "saferetry: giving up"
	}
	l.LogAttrs(ctx, a.level, msg, attrs...)
}
