package idempotency

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Reaper deletes records past the cleanup horizon of its Middleware (see
// WithCleanupHorizon: never less than the replay window plus the lease), in
// bounded batches, over any Store. Before it deletes an unfinished record
// (in progress, its lease ended before the horizon) it reports it
// (Observer.Unfinished; the logging observer logs it at Warn), for a person
// to check its side effects. A Reaper is safe for concurrent use, and
// several may share a store. When several Middlewares with different
// policies share a store, run the Reaper of the one with the longest replay
// window only: another deletes records that one would still replay.
type Reaper struct {
	m *Middleware
}

// The bounds of one ReapOnce, and Start's pause between runs while one
// reports More: 50,000 records a run, and the next run a second later
// until the backlog is gone.
const (
	reapBatch      = 100         // records per DeleteBefore call
	reapMaxBatches = 500         // DeleteBefore calls per run
	reapPage       = 100         // unfinished records listed per page
	reapAgainAfter = time.Second // Start's pause before the next run while a run reports More
)

// Reaper returns a Reaper for m's store and policy. It starts nothing: call
// ReapOnce, or Start.
func (m *Middleware) Reaper() *Reaper {
	return &Reaper{m: m}
}

// ReaperReport is what one ReapOnce did.
type ReaperReport struct {
	// Horizon is the cut-off: records last updated before it were eligible.
	Horizon time.Time
	// Deleted counts the records deleted, in Batches DeleteBefore calls.
	Deleted int
	Batches int
	// Unfinished lists the unfinished records this run reported, the
	// longest-abandoned first: every unfinished record it deletes is here.
	Unfinished []Record
	// Skipped counts the Unfinished records still present after the run
	// (taken over, updated, or not reached).
	Skipped int
	// More is true when the run stopped before it reached every record past
	// the horizon (500 batches of 100); Start runs the next one a second later.
	More bool
}

// ReapOnce runs one bounded pass at now: it lists the unfinished records
// past the horizon, 100 at a time, and reports each before anything could
// delete it; it deletes in batches of 100, only below the lease end of the
// last unfinished record listed while more may be unlisted, for at most 500
// batches. It yields to live traffic: after a full batch it waits as long
// as the batch took before the next one, so that it keeps at most half of
// the store's time, less when the store is slow (no knob). On a store error
// it stops and returns the report so far with the error, wrapped; ctx's end
// stops it between calls. Without a store (New(nil)) every run fails.
func (r *Reaper) ReapOnce(ctx context.Context, now time.Time) (ReaperReport, error) {
	rep, err := r.reapOnce(ctx, now)
	r.m.obs.reaperRun(ctx, rep, err)
	return rep, err
}

func (r *Reaper) reapOnce(ctx context.Context, now time.Time) (ReaperReport, error) {
	rep := ReaperReport{Horizon: now.Add(-r.m.horizon)}
	if err := r.m.sweeps(); err != nil {
		return rep, fmt.Errorf("idempotency: reaper: %w", err)
	}

	logged := make(map[Scope]int64) // scope -> generation listed and logged in this run
	limit := reapPage
	lastFull := false // the last DeleteBefore batch was full
	for {
		if err := ctx.Err(); err != nil {
			return rep, err
		}
		page, err := r.m.g.abandoned(ctx, rep.Horizon, limit)
		if err != nil {
			return rep, fmt.Errorf("idempotency: reaper: listing unfinished records: %w", err)
		}
		fresh := 0
		for _, rec := range page {
			if gen, ok := logged[rec.Scope]; ok && gen == rec.Generation {
				continue
			}
			logged[rec.Scope] = rec.Generation
			rep.Unfinished = append(rep.Unfinished, rec)
			r.m.obs.unfinished(ctx, rec, now.Sub(rec.CreatedAt))
			fresh++
		}
		full := len(page) >= limit
		if full && fresh == 0 {
			// The page holds only records listed before that the deletes
			// could not remove (updated after the cut): no way on this run.
			rep.More = true
			break
		}
		cut := rep.Horizon
		if full {
			// Unlisted unfinished records may follow the page (Abandoned
			// lists by lease end): delete only below the last listed one's.
			cut = page[len(page)-1].LeaseUntil
			if !page[0].LeaseUntil.Before(cut) {
				// The whole page shares one lease end: nothing can be cut
				// between its records. List more of them.
				limit *= 2
				continue
			}
		}
		for rep.Batches < reapMaxBatches {
			if err := ctx.Err(); err != nil {
				return rep, err
			}
			start := time.Now()
			n, err := r.m.g.deleteBefore(ctx, cut, reapBatch)
			if err != nil {
				return rep, fmt.Errorf("idempotency: reaper: deleting: %w", err)
			}
			rep.Batches++
			rep.Deleted += n
			lastFull = n >= reapBatch
			if !lastFull {
				break
			}
			_ = yield(ctx, time.Since(start)) // ctx's end stops the loop at its top
		}
		if rep.Batches >= reapMaxBatches && lastFull {
			rep.More = true
			break
		}
		if !full {
			break
		}
		if rep.Batches >= reapMaxBatches {
			rep.More = true // unfinished records may be left unlisted
			break
		}
	}

	for _, rec := range rep.Unfinished {
		_, err := r.m.g.get(ctx, kindGet, rec.Scope)
		switch {
		case err == nil:
			rep.Skipped++
		case !errors.Is(err, ErrNotFound):
			return rep, fmt.Errorf("idempotency: reaper: reading an unfinished record: %w", err)
		}
	}

	return rep, nil
}

// Start runs ReapOnce in a background goroutine, at once and then interval
// after each run (default and <= 0: ten minutes), or one second after a run
// that reports More, until the backlog is gone; until ctx ends or stop is
// called. stop cancels the loop and waits for the goroutine; it is safe to
// call more than once.
func (r *Reaper) Start(ctx context.Context, interval time.Duration) (stop func()) {
	if interval <= 0 {
		interval = 10 * time.Minute
	}
	return every(ctx, func(ctx context.Context) time.Duration {
		if rep, err := r.ReapOnce(ctx, time.Now()); err == nil && rep.More {
			return reapAgainAfter
		}
		return interval
	})
}
