package idempotency

import (
	"github.com/saferetry/saferetry/keygen"

	"context"
	"errors"
	"log/slog"
	"time"
)

// Defaults of ReaperConfig.
const (
	// DefaultCleanupHorizon is how long after its last update a record is
	// kept: 72 hours, well past the 24-hour default replay window. A Reaper
	// never uses a horizon shorter than its ReplayWindow plus its Lease
	// (ReaperConfig): with WithReplayWindow above 72 h, set
	// ReaperConfig.ReplayWindow to the same value (the horizon is then
	// raised to match, and a Warn says so).
	DefaultCleanupHorizon = 72 * time.Hour
	// DefaultReapBatch is the most records one DeleteBefore call removes.
	DefaultReapBatch = 500
	// DefaultReapMaxBatches is the most DeleteBefore calls one ReapOnce
	// makes; what is left waits for the next run.
	DefaultReapMaxBatches = 20
	// DefaultReapInterval is the time between two runs of Start's loop.
	DefaultReapInterval = 10 * time.Minute
	// DefaultReapMaxUnfinished is the page size in which ReapOnce lists
	// unfinished records (Store.Abandoned) to log them before deleting.
	DefaultReapMaxUnfinished = 100
)

// ReaperConfig configures NewReaper. Zero fields take the defaults above;
// negative ones are treated as zero.
//
// A Horizon shorter than ReplayWindow + Lease would delete completed records
// that the middleware should still replay (a retry would then run again):
// NewReaper raises it to ReplayWindow + Lease and logs that at Warn. Set
// ReplayWindow and Lease to the middleware's WithReplayWindow and WithLease.
type ReaperConfig struct {
	Horizon       time.Duration // records last updated before now-Horizon go (DefaultCleanupHorizon; at least ReplayWindow+Lease)
	ReplayWindow  time.Duration // the middleware's replay window (DefaultReplayWindow)
	Lease         time.Duration // the middleware's lease (DefaultLease)
	BatchSize     int           // records per DeleteBefore call (DefaultReapBatch)
	MaxBatches    int           // DeleteBefore calls per run (DefaultReapMaxBatches)
	Interval      time.Duration // time between runs of Start's loop (DefaultReapInterval)
	MaxUnfinished int           // unfinished records listed per page (DefaultReapMaxUnfinished)
	Logger        *slog.Logger  // nil: slog.Default()
	// Observer's Unfinished is called for each unfinished record listed,
	// with its age (its other functions are not called). Default none.
	Observer Observer
}

// Report is what one ReapOnce did.
type Report struct {
	// Horizon is the cut-off: records last updated before it were eligible.
	Horizon time.Time
	// Deleted counts the records deleted, in Batches DeleteBefore calls.
	Deleted int
	Batches int
	// Unfinished lists the in-progress records whose lease ended before the
	// horizon that this run listed, the longest-abandoned first: the requests
	// they stand for started and never completed, and no completer finished
	// them, so their side effects may be half done. Each is logged at Warn
	// for a person to act on, with the phase and downstream key digest of
	// an external call whose outcome is unknown (Run.External) when there
	// is one, before anything is deleted: every unfinished record a run
	// deletes is in this list and in the log. The log names it by method,
	// route, key_digest and principal_digest (keygen.Digest, never the raw
	// values), owner, generation, recovery point, created_at and
	// lease_until; this list holds the full records (the pending call's
	// downstream key is in DecodeRecovery(RecoveryData)), for a program to
	// act on.
	Unfinished []Record
	// Skipped counts the Unfinished records still present after the run:
	// a new owner took them over in between, the run stopped at MaxBatches
	// before reaching them, or they were updated after the horizon.
	Skipped int
	// More is true when the run stopped before it could reach every record
	// past the horizon: at MaxBatches with a full last batch, or with
	// unfinished records left that it could not list (see ReapOnce). The
	// next run goes on.
	More bool
}

// Reaper deletes records past the cleanup horizon in bounded batches, over
// any Store (it uses only Abandoned, DeleteBefore and Get). It is safe for
// concurrent use; running several reapers against one shared store is
// harmless (each deletes what the others have not).
type Reaper struct {
	store Store
	cfg   ReaperConfig

	now       func() time.Time
	newTicker func(d time.Duration) (<-chan time.Time, func())
	afterRun  func(Report, error) // test hook, called after each loop run
}

// NewReaper returns a Reaper over s with cfg (zero fields take the
// defaults; a Horizon under ReplayWindow + Lease is raised to it, logged at
// Warn). It starts nothing: call ReapOnce, or Start for a background loop.
func NewReaper(s Store, cfg ReaperConfig) *Reaper {
	if cfg.Horizon <= 0 {
		cfg.Horizon = DefaultCleanupHorizon
	}
	if cfg.ReplayWindow <= 0 {
		cfg.ReplayWindow = DefaultReplayWindow
	}
	if cfg.Lease <= 0 {
		cfg.Lease = DefaultLease
	}
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = DefaultReapBatch
	}
	if cfg.MaxBatches <= 0 {
		cfg.MaxBatches = DefaultReapMaxBatches
	}
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultReapInterval
	}
	if cfg.MaxUnfinished <= 0 {
		cfg.MaxUnfinished = DefaultReapMaxUnfinished
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if least := cfg.ReplayWindow + cfg.Lease; cfg.Horizon < least {
		cfg.Logger.LogAttrs(context.Background(), slog.LevelWarn,
			"idempotency reaper: the cleanup horizon is shorter than the replay window plus the lease; raised, so that no record is deleted while it should still be replayed",
			slog.Duration("horizon", cfg.Horizon), slog.Duration("replay_window", cfg.ReplayWindow),
			slog.Duration("lease", cfg.Lease), slog.Duration("raised_to", least))
		cfg.Horizon = least
	}
	return &Reaper{
		store: s,
		cfg:   cfg,
		now:   time.Now,
		newTicker: func(d time.Duration) (<-chan time.Time, func()) {
			t := time.NewTicker(d)
			return t.C, t.Stop
		},
	}
}

// ReapOnce runs one bounded pass at now. It lists the unfinished
// in-progress records past the horizon (now - Horizon), MaxUnfinished at a
// time, and logs each at Warn before anything that could delete it: when a
// page comes back full (more may be unlisted), it deletes only below the
// lease end of the last record listed (every unfinished record there was
// listed), calling DeleteBefore(cut, BatchSize) until a batch comes back
// short, then lists the next page; once a page is short it deletes up to
// the horizon itself. It stops after MaxBatches DeleteBefore calls, or
// when a full page brings nothing new (records it cannot delete yet fill
// it; Report.More), and finally counts which unfinished records are still
// there. While unfinished records are paged, completed records between the
// cut and the horizon wait for a later step or run. On a store error it
// stops and returns the report so far with the error (wrapped, matching
// errors.Is against the store's error); ctx cancellation stops it between
// calls with ctx's error.
func (r *Reaper) ReapOnce(ctx context.Context, now time.Time) (Report, error) {
	rep := Report{Horizon: now.Add(-r.cfg.Horizon)}
	log := r.cfg.Logger

	logged := make(map[Scope]int64) // scope -> generation listed and logged in this run
	limit := r.cfg.MaxUnfinished
	lastFull := false // the last DeleteBefore batch was full
	for {
		if err := ctx.Err(); err != nil {
			return rep, err
		}
		page, err := r.store.Abandoned(ctx, rep.Horizon, limit)
		if err != nil {
			return rep, &ReapError{Op: "abandoned", Err: err}
		}
		fresh := 0
		for _, rec := range page {
			if gen, ok := logged[rec.Scope]; ok && gen == rec.Generation {
				continue
			}
			logged[rec.Scope] = rec.Generation
			rep.Unfinished = append(rep.Unfinished, rec)
			r.logUnfinished(ctx, rec)
			observe(r.cfg.Observer.Unfinished, ctx, Event{Scope: rec.Scope, Generation: rec.Generation, Duration: now.Sub(rec.CreatedAt)})
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
		for rep.Batches < r.cfg.MaxBatches {
			if err := ctx.Err(); err != nil {
				return rep, err
			}
			n, err := r.store.DeleteBefore(ctx, cut, r.cfg.BatchSize)
			if err != nil {
				return rep, &ReapError{Op: "delete_before", Err: err}
			}
			rep.Batches++
			rep.Deleted += n
			lastFull = n >= r.cfg.BatchSize
			if !lastFull {
				break
			}
		}
		if rep.Batches >= r.cfg.MaxBatches && lastFull {
			rep.More = true
			break
		}
		if !full {
			break
		}
		if rep.Batches >= r.cfg.MaxBatches {
			rep.More = true // unfinished records may be left unlisted
			break
		}
	}

	for _, rec := range rep.Unfinished {
		_, err := r.store.Get(ctx, rec.Scope)
		switch {
		case err == nil:
			rep.Skipped++
		case !errors.Is(err, ErrNotFound):
			return rep, &ReapError{Op: "get", Err: err}
		}
	}

	level := slog.LevelInfo
	if rep.Deleted == 0 && len(rep.Unfinished) == 0 {
		level = slog.LevelDebug
	}
	log.LogAttrs(ctx, level, "idempotency reaper: run finished",
		slog.Time("horizon", rep.Horizon),
		slog.Int("deleted", rep.Deleted),
		slog.Int("batches", rep.Batches),
		slog.Int("unfinished", len(rep.Unfinished)),
		slog.Int("skipped", rep.Skipped),
		slog.Bool("more", rep.More),
	)
	return rep, nil
}

// logUnfinished logs an unfinished record at Warn, for a person to act on.
func (r *Reaper) logUnfinished(ctx context.Context, rec Record) {
	attrs := []slog.Attr{
		slog.String("method", rec.Scope.Method),
		slog.String("route", rec.Scope.Route),
		slog.String("key_digest", keygen.Digest(rec.Scope.Key)),
		slog.String("principal_digest", keygen.Digest(rec.Scope.Principal)),
		slog.String("owner", rec.Owner),
		slog.Int64("generation", rec.Generation),
		slog.String("recovery_point", rec.RecoveryPoint),
		slog.Int("recovery_data_bytes", len(rec.RecoveryData)),
		slog.Time("created_at", rec.CreatedAt),
		slog.Time("lease_until", rec.LeaseUntil),
	}
	// An External phase whose outcome was never recorded is the side
	// effect to check first: name its downstream key.
	if data, err := DecodeRecovery(rec.RecoveryData); err == nil && data.Pending != nil {
		attrs = append(attrs, slog.String("pending_phase", data.Pending.Phase),
			slog.String("downstream_key_digest", keygen.Digest(data.Pending.DownstreamKey)))
	}
	r.cfg.Logger.LogAttrs(ctx, slog.LevelWarn,
		"idempotency reaper: unfinished request past the cleanup horizon is being deleted; check its side effects",
		attrs...)
}

// Start runs ReapOnce in a background goroutine: once immediately, then every
// Interval, until ctx is done or stop is called. Errors are logged at Error
// and the loop goes on. stop cancels the loop and waits for the goroutine to
// return (a run in progress sees its context cancelled); it is safe to call
// more than once and from several goroutines.
func (r *Reaper) Start(ctx context.Context) (stop func()) {
	return runEvery(ctx, r.newTicker, r.cfg.Interval, func(ctx context.Context) {
		rep, err := r.ReapOnce(ctx, r.now())
		if err != nil && ctx.Err() == nil {
			r.cfg.Logger.LogAttrs(ctx, slog.LevelError, "idempotency reaper: run failed",
				slog.String("error", err.Error()), slog.Int("deleted", rep.Deleted))
		}
		if r.afterRun != nil {
			r.afterRun(rep, err)
		}
	})
}

// ErrReap is matched (errors.Is) by every *ReapError.
var ErrReap = errors.New("idempotency: reaper failed")

// ReapError reports the store call that failed during ReapOnce ("abandoned",
// "delete_before" or "get"). It matches ErrReap and, through Unwrap, the
// store's own error.
type ReapError struct {
	Op  string
	Err error
}

// Error returns "idempotency: reaper: <op>: <cause>".
func (e *ReapError) Error() string { return "idempotency: reaper: " + e.Op + ": " + e.Err.Error() }

// Unwrap returns ErrReap and the store's error.
func (e *ReapError) Unwrap() []error { return []error{ErrReap, e.Err} }
