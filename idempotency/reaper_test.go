package idempotency

import (
	"github.com/saferetry/saferetry/keygen"

	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

var reapT0 = time.Date(2026, 1, 10, 0, 0, 0, 0, time.UTC)

func reapScope(key string) Scope {
	return Scope{Principal: "p", Method: "POST", Route: "POST /orders", Key: key}
}

// seed claims key at now with a 10 s lease and completes it at now when
// complete is true.
// seed claims key at now and, if complete, completes it. Its claim has no
// replay window, so that a MemoryStore keeps the completed records for the
// reaper (it evicts those past the window of their claim by itself).
func seed(t *testing.T, s Store, key string, now time.Time, complete bool) Record {
	t.Helper()
	rec, ok, err := claimed(s.Claim(t.Context(), Claim{
		Scope: reapScope(key), Fingerprint: "fp", FingerprintVersion: 1, Owner: "o-" + key,
		Now: now, LeaseFor: 10 * time.Second,
	}))
	require.NoError(t, err)
	require.True(t, ok)
	if complete {
		require.NoError(t, s.Complete(t.Context(), rec.Lease(), Response{Status: 201}, now))
	}
	return rec
}

func bufLogger() (*slog.Logger, *bytes.Buffer) {
	var buf bytes.Buffer
	noTime := func(_ []string, a slog.Attr) slog.Attr {
		if a.Key == slog.TimeKey {
			return slog.Attr{}
		}
		return a
	}
	return slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug, ReplaceAttr: noTime})), &buf
}

func exists(t *testing.T, s Store, key string) bool {
	t.Helper()
	_, err := s.Get(t.Context(), reapScope(key))
	if errors.Is(err, ErrNotFound) {
		return false
	}
	require.NoError(t, err)
	return true
}

func TestReaperDefaults(t *testing.T) {
	r := NewReaper(NewMemoryStore(), ReaperConfig{BatchSize: -1})
	require.Equal(t, DefaultCleanupHorizon, r.cfg.Horizon)
	require.Equal(t, 72*time.Hour, r.cfg.Horizon)
	require.Equal(t, DefaultReapBatch, r.cfg.BatchSize)
	require.Equal(t, DefaultReapMaxBatches, r.cfg.MaxBatches)
	require.Equal(t, DefaultReapInterval, r.cfg.Interval)
	require.Equal(t, DefaultReapMaxUnfinished, r.cfg.MaxUnfinished)
	require.NotNil(t, r.cfg.Logger)
}

func TestReapOnceDeletesOnlyPastTheHorizonInBatches(t *testing.T) {
	s := NewMemoryStore()
	now := reapT0.Add(100 * time.Hour)
	for _, k := range []string{"old-1", "old-2", "old-3", "old-4", "old-5"} {
		seed(t, s, k, reapT0, true) // 100 h old
	}
	seed(t, s, "edge", now.Add(-72*time.Hour), true) // exactly at the horizon: kept
	seed(t, s, "young", now.Add(-71*time.Hour), true)
	seed(t, s, "running", now.Add(-time.Second), false)

	log, buf := bufLogger()
	r := NewReaper(s, ReaperConfig{BatchSize: 2, Logger: log})
	rep, err := r.ReapOnce(t.Context(), now)
	require.NoError(t, err)
	require.True(t, rep.Horizon.Equal(now.Add(-72*time.Hour)))
	require.Equal(t, 5, rep.Deleted)
	require.Equal(t, 3, rep.Batches, "2 + 2 + 1: stops at the short batch")
	require.False(t, rep.More)
	require.Empty(t, rep.Unfinished)
	require.Zero(t, rep.Skipped)
	require.Equal(t, 3, s.Len())
	for _, k := range []string{"edge", "young", "running"} {
		require.True(t, exists(t, s, k), k)
	}
	require.Contains(t, buf.String(), "level=INFO msg=\"idempotency reaper: run finished\"")
	require.Contains(t, buf.String(), "deleted=5")

	// Nothing left to do: one empty batch, logged at Debug only.
	buf.Reset()
	rep, err = r.ReapOnce(t.Context(), now)
	require.NoError(t, err)
	require.Zero(t, rep.Deleted)
	require.Equal(t, 1, rep.Batches)
	require.Contains(t, buf.String(), "level=DEBUG")
}

func TestReapOnceStopsAtMaxBatches(t *testing.T) {
	s := NewMemoryStore()
	for i := range 7 {
		seed(t, s, string(rune('a'+i)), reapT0, true)
	}
	log, _ := bufLogger()
	r := NewReaper(s, ReaperConfig{Horizon: time.Hour, ReplayWindow: 30 * time.Minute, BatchSize: 3, MaxBatches: 2, Logger: log})
	now := reapT0.Add(2 * time.Hour)
	rep, err := r.ReapOnce(t.Context(), now)
	require.NoError(t, err)
	require.Equal(t, 6, rep.Deleted)
	require.Equal(t, 2, rep.Batches)
	require.True(t, rep.More)
	require.Equal(t, 1, s.Len())

	rep, err = r.ReapOnce(t.Context(), now)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Deleted)
	require.False(t, rep.More)
	require.Zero(t, s.Len())
}

func TestReapOnceReportsAndLogsUnfinishedRecords(t *testing.T) {
	s := NewMemoryStore()
	stuck := seed(t, s, "stuck", reapT0, false) // lease ended at t0+10s
	require.NoError(t, s.SetRecoveryPoint(t.Context(), stuck.Lease(), "charged", []byte("ch_1"), reapT0.Add(time.Second)))
	stuck2 := seed(t, s, "stuck-2", reapT0.Add(time.Minute), false)
	pending := Recovery{Phases: []CommittedPhase{{Name: "order"}}, Pending: &PendingCall{Phase: "charge", DownstreamKey: "stuck-2-charge-0a1b"}}
	require.NoError(t, s.SetRecoveryPoint(t.Context(), stuck2.Lease(), "intent:charge", pending.Encode(), reapT0.Add(time.Minute)))
	seed(t, s, "done", reapT0, true)

	log, buf := bufLogger()
	r := NewReaper(s, ReaperConfig{Horizon: time.Hour, ReplayWindow: 30 * time.Minute, Logger: log})
	rep, err := r.ReapOnce(t.Context(), reapT0.Add(2*time.Hour))
	require.NoError(t, err)
	require.Equal(t, 3, rep.Deleted)
	require.Len(t, rep.Unfinished, 2)
	require.Equal(t, "stuck", rep.Unfinished[0].Scope.Key, "longest-abandoned first")
	require.Equal(t, "charged", rep.Unfinished[0].RecoveryPoint)
	require.Equal(t, "stuck-2", rep.Unfinished[1].Scope.Key)
	require.Zero(t, rep.Skipped)

	out := buf.String()
	warns := 0
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, "level=WARN") {
			warns++
			require.Contains(t, line, "check its side effects")
		}
	}
	require.Equal(t, 2, warns)
	require.Contains(t, out, "key_digest="+keygen.Digest("stuck")+" ")
	require.Contains(t, out, "principal_digest="+keygen.Digest("p")+" ")
	require.Contains(t, out, "recovery_point=charged")
	require.Contains(t, out, "unfinished=2")
	require.Contains(t, out, "key_digest="+keygen.Digest("stuck-2")+" ")
	require.Contains(t, out, "recovery_point=intent:charge")
	require.Contains(t, out, "pending_phase=charge downstream_key_digest="+keygen.Digest("stuck-2-charge-0a1b"))
	// Never the raw key, principal or downstream key.
	require.NotContains(t, out, "stuck-2-charge")
	require.NotContains(t, out, "=stuck")
	require.NotContains(t, out, "principal=")
	require.Equal(t, "ca978112ca1b", keygen.Digest("a"), "first 6 bytes of SHA-256, hex")
}

func TestReapOnceCountsUnfinishedItLeftAsSkipped(t *testing.T) {
	s := NewMemoryStore()
	seed(t, s, "done-1", reapT0, true)
	seed(t, s, "done-2", reapT0.Add(time.Second), true)
	seed(t, s, "stuck", reapT0.Add(2*time.Second), false) // newest UpdatedAt: deleted last
	log, _ := bufLogger()
	r := NewReaper(s, ReaperConfig{Horizon: time.Hour, ReplayWindow: 30 * time.Minute, BatchSize: 1, MaxBatches: 2, Logger: log})
	rep, err := r.ReapOnce(t.Context(), reapT0.Add(2*time.Hour))
	require.NoError(t, err)
	require.Equal(t, 2, rep.Deleted)
	require.True(t, rep.More)
	require.Len(t, rep.Unfinished, 1)
	require.Equal(t, 1, rep.Skipped, "the batch bound left the unfinished record for the next run")
	require.True(t, exists(t, s, "stuck"))
}

// failingStore fails the named operation with errBoom.
type failingStore struct {
	Store
	fail string
}

var errBoom = errors.New("boom")

func (f failingStore) Abandoned(ctx context.Context, now time.Time, limit int) ([]Record, error) {
	if f.fail == "abandoned" {
		return nil, errBoom
	}
	return f.Store.Abandoned(ctx, now, limit)
}

func (f failingStore) DeleteBefore(ctx context.Context, horizon time.Time, limit int) (int, error) {
	if f.fail == "delete_before" {
		return 0, errBoom
	}
	return f.Store.DeleteBefore(ctx, horizon, limit)
}

func (f failingStore) Get(ctx context.Context, s Scope) (Record, error) {
	if f.fail == "get" {
		return Record{}, errBoom
	}
	return f.Store.Get(ctx, s)
}

func TestReapOnceStoreErrors(t *testing.T) {
	for _, op := range []string{"abandoned", "delete_before", "get"} {
		t.Run(op, func(t *testing.T) {
			s := NewMemoryStore()
			seed(t, s, "stuck", reapT0, false)
			log, _ := bufLogger()
			r := NewReaper(failingStore{Store: s, fail: op}, ReaperConfig{Horizon: time.Hour, ReplayWindow: 30 * time.Minute, Logger: log})
			_, err := r.ReapOnce(t.Context(), reapT0.Add(2*time.Hour))
			require.ErrorIs(t, err, ErrReap)
			require.ErrorIs(t, err, errBoom)
			var re *ReapError
			require.ErrorAs(t, err, &re)
			require.Equal(t, op, re.Op)
			require.Equal(t, "idempotency: reaper: "+op+": boom", err.Error())
		})
	}
	t.Run("canceled", func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		r := NewReaper(failingStore{Store: NewMemoryStore()}, ReaperConfig{})
		// The memory store honours ctx in Abandoned already.
		_, err := r.ReapOnce(ctx, reapT0)
		require.ErrorIs(t, err, context.Canceled)
	})
}

// fakeTicker is a ticker channel the test drives.
type fakeTicker struct {
	c       chan time.Time
	stopped atomic.Bool
	period  time.Duration
}

func startFake(t *testing.T, s Store, cfg ReaperConfig) (*Reaper, *fakeTicker, chan Report) {
	t.Helper()
	ft := &fakeTicker{c: make(chan time.Time)}
	runs := make(chan Report, 16)
	r := NewReaper(s, cfg)
	clock := reapT0.Add(100 * time.Hour)
	r.now = func() time.Time { return clock }
	r.newTicker = func(d time.Duration) (<-chan time.Time, func()) {
		ft.period = d
		return ft.c, func() { ft.stopped.Store(true) }
	}
	r.afterRun = func(rep Report, err error) {
		if err == nil {
			runs <- rep
		}
	}
	return r, ft, runs
}

func TestStartRunsAtOnceThenOnEveryTickAndStops(t *testing.T) {
	s := NewMemoryStore()
	seed(t, s, "old", reapT0, true)
	log, _ := bufLogger()
	r, ft, runs := startFake(t, s, ReaperConfig{Interval: 5 * time.Minute, Logger: log})
	stop := r.Start(t.Context())

	rep := <-runs
	require.Equal(t, 1, rep.Deleted)
	require.Equal(t, 5*time.Minute, ft.period)

	seed(t, s, "old-2", reapT0, true)
	ft.c <- reapT0
	rep = <-runs
	require.Equal(t, 1, rep.Deleted)
	require.Zero(t, s.Len())

	stop()
	stop() // idempotent
	require.True(t, ft.stopped.Load())
	select {
	case ft.c <- reapT0:
		t.Fatal("the loop still receives ticks after stop")
	default:
	}
}

func TestStartStopsWhenContextEnds(t *testing.T) {
	log, _ := bufLogger()
	r, ft, runs := startFake(t, NewMemoryStore(), ReaperConfig{Logger: log})
	ctx, cancel := context.WithCancel(t.Context())
	stop := r.Start(ctx)
	<-runs
	cancel()
	stop() // returns once the goroutine is gone
	require.True(t, ft.stopped.Load())
}

func TestStartLogsFailedRunsAndGoesOn(t *testing.T) {
	log, buf := bufLogger()
	s := failingStore{Store: NewMemoryStore(), fail: "delete_before"}
	r, ft, _ := startFake(t, s, ReaperConfig{Logger: log})
	errs := make(chan error, 4)
	r.afterRun = func(_ Report, err error) { errs <- err }
	stop := r.Start(t.Context())
	require.ErrorIs(t, <-errs, errBoom)
	ft.c <- reapT0
	require.ErrorIs(t, <-errs, errBoom)
	stop()
	require.Contains(t, buf.String(), "level=ERROR msg=\"idempotency reaper: run failed\"")
	require.Contains(t, buf.String(), "boom")
}

// The horizon never undercuts the replay window: a 7-day window with the
// default 72-hour horizon keeps a record completed 4 days ago (a retry
// within the window must still get its replay) and says so at Warn.
func TestReaperHorizonCoversTheReplayWindow(t *testing.T) {
	s := NewMemoryStore()
	now := reapT0.Add(30 * 24 * time.Hour)
	seed(t, s, "4-days", now.Add(-4*24*time.Hour), true)
	seed(t, s, "8-days", now.Add(-8*24*time.Hour), true)
	log, buf := bufLogger()
	week := 7 * 24 * time.Hour
	r := NewReaper(s, ReaperConfig{ReplayWindow: week, Logger: log})
	require.Equal(t, week+DefaultLease, r.cfg.Horizon)
	require.Contains(t, buf.String(), "level=WARN")
	require.Contains(t, buf.String(), "raised_to=168h0m30s")
	rep, err := r.ReapOnce(t.Context(), now)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Deleted)
	require.True(t, exists(t, s, "4-days"), "still inside the replay window")
	require.False(t, exists(t, s, "8-days"))

	// Below the default window too, and with the middleware's lease.
	buf.Reset()
	r = NewReaper(s, ReaperConfig{Horizon: time.Hour, Lease: time.Minute, Logger: log})
	require.Equal(t, DefaultReplayWindow+time.Minute, r.cfg.Horizon)
	require.Contains(t, buf.String(), "level=WARN")
	// A horizon that covers them is kept, silently.
	buf.Reset()
	r = NewReaper(s, ReaperConfig{Horizon: 25 * time.Hour, Logger: log})
	require.Equal(t, 25*time.Hour, r.cfg.Horizon)
	require.Empty(t, buf.String())
}

// Every unfinished record the reaper deletes is logged first, however many
// there are: more than MaxUnfinished, with distinct lease ends or all with
// one.
func TestReapOnceLogsEveryUnfinishedRecordItDeletes(t *testing.T) {
	for _, tie := range []bool{false, true} {
		t.Run(map[bool]string{false: "staggered", true: "one lease end"}[tie], func(t *testing.T) {
			s := NewMemoryStore()
			const n = 250
			for i := range n {
				at := reapT0.Add(time.Duration(i) * time.Second)
				if tie {
					at = reapT0
				}
				seed(t, s, fmt.Sprintf("stuck-%03d", i), at, false)
			}
			for i := range 30 {
				seed(t, s, fmt.Sprintf("done-%02d", i), reapT0.Add(time.Duration(i)*time.Minute), true)
			}
			seed(t, s, "young", reapT0.Add(99*time.Hour), false)
			log, buf := bufLogger()
			r := NewReaper(s, ReaperConfig{Horizon: time.Hour, ReplayWindow: 30 * time.Minute, MaxUnfinished: 100, BatchSize: 40, Logger: log})
			rep, err := r.ReapOnce(t.Context(), reapT0.Add(100*time.Hour))
			require.NoError(t, err)
			require.Equal(t, n+30, rep.Deleted)
			require.False(t, rep.More)
			require.Len(t, rep.Unfinished, n)
			require.Zero(t, rep.Skipped)
			require.Equal(t, 1, s.Len())
			for i := range n {
				require.Contains(t, buf.String(), "key_digest="+keygen.Digest(fmt.Sprintf("stuck-%03d", i))+" ")
			}
			require.Equal(t, n, strings.Count(buf.String(), "level=WARN"), "each logged once")
		})
	}
}

// A full page of unfinished records that cannot be deleted yet (updated
// after the horizon) stops the run without deleting records it did not
// list; it says so in More.
func TestReapOnceNeverDeletesAnUnlistedUnfinishedRecord(t *testing.T) {
	s := NewMemoryStore()
	now := reapT0.Add(100 * time.Hour)
	for i := range 2 {
		rec := seed(t, s, fmt.Sprintf("late-%d", i), reapT0.Add(time.Duration(i)*time.Second), false)
		// A late phase commit by an owner whose lease had ended: updated
		// after the horizon, so not deletable yet.
		require.NoError(t, s.SetRecoveryPoint(t.Context(), rec.Lease(), "order", nil, now.Add(-time.Minute)))
	}
	seed(t, s, "unlisted", reapT0.Add(time.Minute), false)
	log, buf := bufLogger()
	r := NewReaper(s, ReaperConfig{Horizon: time.Hour, ReplayWindow: 30 * time.Minute, MaxUnfinished: 2, Logger: log})
	rep, err := r.ReapOnce(t.Context(), now)
	require.NoError(t, err)
	require.True(t, rep.More)
	require.True(t, exists(t, s, "unlisted"), "deleted without being logged")
	require.NotContains(t, buf.String(), keygen.Digest("unlisted"))
	require.Equal(t, 2, rep.Skipped)
}
