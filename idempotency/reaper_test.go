package idempotency_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
	"github.com/saferetry/saferetry/keygen"
)

var reapT0 = time.Date(2026, 1, 10, 0, 0, 0, 0, time.UTC)

func reapScope(key string) idempotency.Scope {
	return idempotency.Scope{Principal: "p", Method: "POST", Route: "POST /orders", Key: key}
}

// seed claims key at now with a 10 s lease and, if complete, completes it
// at now. Its claim has no replay window, so that a memstore keeps the
// completed records for the reaper (it evicts those past the window of
// their claim by itself).
func seed(t *testing.T, s idempotency.Store, key string, now time.Time, complete bool) idempotency.Record {
	t.Helper()
	res, err := s.Claim(t.Context(), idempotency.Claim{
		Scope: reapScope(key), Fingerprint: "fp", FingerprintVersion: 1, Owner: "o-" + key,
		Now: now, LeaseFor: 10 * time.Second,
	})
	require.NoError(t, err)
	require.Equal(t, idempotency.ClaimCreated, res.Outcome)
	if complete {
		require.NoError(t, s.Complete(t.Context(), res.Record.Lease(), idempotency.Response{Status: 201}, now))
	}
	return res.Record
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

func exists(t *testing.T, s idempotency.Store, key string) bool {
	t.Helper()
	_, err := s.Get(t.Context(), reapScope(key))
	if errors.Is(err, idempotency.ErrNotFound) {
		return false
	}
	require.NoError(t, err)
	return true
}

// reaper returns the Reaper of a middleware over s with a one-hour cleanup
// horizon (over a 30-minute replay window).
func reaper(s idempotency.Store, log *slog.Logger) *idempotency.Reaper {
	return idempotency.New(s, idempotency.WithLogger(log), idempotency.WithReplayWindow(30*time.Minute),
		idempotency.WithCleanupHorizon(time.Hour)).Reaper()
}

// By default the horizon is 72 hours; records go in batches of 100.
func TestReapOnceDeletesOnlyPastTheHorizonInBatches(t *testing.T) {
	s := memstore.New()
	now := reapT0.Add(100 * time.Hour)
	for i := range 201 {
		seed(t, s, fmt.Sprintf("old-%d", i), reapT0, true) // 100 h old
	}
	seed(t, s, "edge", now.Add(-72*time.Hour), true) // exactly at the horizon: kept
	seed(t, s, "young", now.Add(-71*time.Hour), true)
	seed(t, s, "running", now.Add(-time.Second), false)

	log, buf := bufLogger()
	r := idempotency.New(s, idempotency.WithLogger(log)).Reaper()
	rep, err := r.ReapOnce(t.Context(), now)
	require.NoError(t, err)
	require.True(t, rep.Horizon.Equal(now.Add(-72*time.Hour)))
	require.Equal(t, 201, rep.Deleted)
	require.Equal(t, 3, rep.Batches, "100 + 100 + 1: stops at the short batch")
	require.False(t, rep.More)
	require.Empty(t, rep.Unfinished)
	require.Zero(t, rep.Skipped)
	require.Equal(t, 3, s.Len())
	for _, k := range []string{"edge", "young", "running"} {
		require.True(t, exists(t, s, k), k)
	}
	require.Contains(t, buf.String(), "level=INFO msg=\"idempotency reaper: run finished\"")
	require.Contains(t, buf.String(), "deleted=201")

	// Nothing left to do: one empty batch, logged at Debug only.
	buf.Reset()
	rep, err = r.ReapOnce(t.Context(), now)
	require.NoError(t, err)
	require.Zero(t, rep.Deleted)
	require.Equal(t, 1, rep.Batches)
	require.Contains(t, buf.String(), "level=DEBUG")
}

func TestReapOnceReportsAndLogsUnfinishedRecords(t *testing.T) {
	s := memstore.New()
	stuck := seed(t, s, "stuck", reapT0, false) // lease ended at t0+10s
	require.NoError(t, s.SetRecoveryPoint(t.Context(), stuck.Lease(), "charged", []byte("ch_1"), reapT0.Add(time.Second)))
	stuck2 := seed(t, s, "stuck-2", reapT0.Add(time.Minute), false)
	pending := []byte(`{"v":1,"phases":[{"name":"order"}],"pending":{"phase":"charge","downstream_key":"stuck-2-charge-0a1b"}}`)
	require.NoError(t, s.SetRecoveryPoint(t.Context(), stuck2.Lease(), "intent:charge", pending, reapT0.Add(time.Minute)))
	seed(t, s, "done", reapT0, true)

	var seen []string
	var ages []time.Duration
	log, buf := bufLogger()
	r := idempotency.New(s, idempotency.WithLogger(log), idempotency.WithReplayWindow(30*time.Minute),
		idempotency.WithCleanupHorizon(time.Hour), idempotency.WithObserver(idempotency.Observer{
			Unfinished: func(_ context.Context, rec idempotency.Record, age time.Duration) {
				seen = append(seen, rec.Scope.Key)
				ages = append(ages, age)
			},
		})).Reaper()
	rep, err := r.ReapOnce(t.Context(), reapT0.Add(2*time.Hour))
	require.NoError(t, err)
	require.Equal(t, 3, rep.Deleted)
	require.Len(t, rep.Unfinished, 2)
	require.Equal(t, "stuck", rep.Unfinished[0].Scope.Key, "longest-abandoned first")
	require.Equal(t, "charged", rep.Unfinished[0].RecoveryPoint)
	require.Equal(t, "stuck-2", rep.Unfinished[1].Scope.Key)
	require.Zero(t, rep.Skipped)
	require.Equal(t, []string{"stuck", "stuck-2"}, seen, "the observer sees each unfinished record")
	require.Equal(t, []time.Duration{2 * time.Hour, 2*time.Hour - time.Minute}, ages, "with its age")

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
}

// opFails fails the named operation with errBoom.
type opFails struct {
	*memstore.Store
	fail string
}

var errBoom = errors.New("boom")

func (f opFails) Abandoned(ctx context.Context, now time.Time, limit int) ([]idempotency.Record, error) {
	if f.fail == "abandoned" {
		return nil, errBoom
	}
	return f.Store.Abandoned(ctx, now, limit)
}

func (f opFails) DeleteBefore(ctx context.Context, horizon time.Time, limit int) (int, error) {
	if f.fail == "delete_before" {
		return 0, errBoom
	}
	return f.Store.DeleteBefore(ctx, horizon, limit)
}

func (f opFails) Get(ctx context.Context, s idempotency.Scope) (idempotency.Record, error) {
	if f.fail == "get" {
		return idempotency.Record{}, errBoom
	}
	return f.Store.Get(ctx, s)
}

func TestReapOnceStoreErrors(t *testing.T) {
	for op, msg := range map[string]string{
		"abandoned":     "idempotency: reaper: listing unfinished records: boom",
		"delete_before": "idempotency: reaper: deleting: boom",
		"get":           "idempotency: reaper: reading an unfinished record: boom",
	} {
		t.Run(op, func(t *testing.T) {
			s := memstore.New()
			seed(t, s, "stuck", reapT0, false)
			_, err := reaper(opFails{Store: s, fail: op}, quiet).ReapOnce(t.Context(), reapT0.Add(2*time.Hour))
			require.ErrorIs(t, err, errBoom)
			require.EqualError(t, err, msg)
		})
	}
	t.Run("canceled", func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		_, err := reaper(memstore.New(), quiet).ReapOnce(ctx, reapT0)
		require.ErrorIs(t, err, context.Canceled)
	})
}

// reaperRuns returns a middleware over s whose observer sends every Reaper
// run's report and error on the returned channel.
func reaperRuns(s idempotency.Store, log *slog.Logger) (*idempotency.Middleware, chan error, chan idempotency.ReaperReport) {
	errs, reps := make(chan error, 16), make(chan idempotency.ReaperReport, 16)
	mw := idempotency.New(s, idempotency.WithLogger(log), idempotency.WithObserver(idempotency.Observer{
		ReaperRun: func(_ context.Context, rep idempotency.ReaperReport, err error) { reps <- rep; errs <- err },
	}))
	return mw, errs, reps
}

// Start runs at once, then every interval on the clock (testing/synctest's),
// and not after stop.
func TestReaperStartRunsAtOnceThenEveryIntervalAndStops(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := memstore.New()
		seed(t, s, "old", time.Now().Add(-100*time.Hour), true)
		mw, errs, reps := reaperRuns(s, quiet)
		start := time.Now()
		stop := mw.Reaper().Start(t.Context(), 5*time.Minute)
		require.NoError(t, <-errs)
		require.Equal(t, 1, (<-reps).Deleted)

		seed(t, s, "old-2", time.Now().Add(-100*time.Hour), true)
		require.NoError(t, <-errs)
		require.Equal(t, 1, (<-reps).Deleted)
		require.Equal(t, 5*time.Minute, time.Since(start))
		require.Zero(t, s.Len())

		stop()
		stop() // idempotent
		time.Sleep(time.Hour)
		synctest.Wait()
		require.Empty(t, reps, "a run after stop")
	})
}

func TestReaperStartStopsWhenContextEnds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mw, errs, _ := reaperRuns(memstore.New(), quiet)
		ctx, cancel := context.WithCancel(t.Context())
		stop := mw.Reaper().Start(ctx, 0)
		require.NoError(t, <-errs)
		cancel()
		stop() // returns once the goroutine is gone
		time.Sleep(time.Hour)
		synctest.Wait()
		require.Empty(t, errs, "a run after the context ended")
	})
}

func TestReaperStartLogsFailedRunsAndGoesOn(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		log, buf := bufLogger()
		mw, errs, _ := reaperRuns(opFails{Store: memstore.New(), fail: "delete_before"}, log)
		start := time.Now()
		stop := mw.Reaper().Start(t.Context(), 0)
		require.ErrorIs(t, <-errs, errBoom)
		require.ErrorIs(t, <-errs, errBoom)
		require.Equal(t, 10*time.Minute, time.Since(start), "the default interval")
		stop()
		require.Contains(t, buf.String(), "level=ERROR msg=\"idempotency reaper: run failed\"")
		require.Contains(t, buf.String(), "boom")
	})
}

// The horizon never undercuts the replay window plus the lease: with a
// 7-day window the default 72-hour horizon keeps a record completed 4 days
// ago (a retry within the window must still get its replay), and a horizon
// set below them is raised to them.
func TestReaperHorizonCoversTheReplayWindow(t *testing.T) {
	now := reapT0.Add(30 * 24 * time.Hour)
	week := 7 * 24 * time.Hour
	for name, tc := range map[string]struct {
		opts []idempotency.Option
		want time.Duration
	}{
		"7-day window":            {[]idempotency.Option{idempotency.WithReplayWindow(week)}, week + 30*time.Second},
		"1-hour horizon":          {[]idempotency.Option{idempotency.WithCleanupHorizon(time.Hour), idempotency.WithLease(time.Minute)}, 24*time.Hour + time.Minute},
		"no horizon":              {[]idempotency.Option{idempotency.WithCleanupHorizon(0)}, 24*time.Hour + 30*time.Second},
		"25-hour horizon is kept": {[]idempotency.Option{idempotency.WithCleanupHorizon(25 * time.Hour)}, 25 * time.Hour},
		"default: 72 hours":       {nil, 72 * time.Hour},
	} {
		t.Run(name, func(t *testing.T) {
			s := memstore.New()
			rep, err := idempotency.New(s, append(tc.opts, idempotency.WithLogger(nil))...).Reaper().ReapOnce(t.Context(), now)
			require.NoError(t, err)
			require.Equal(t, now.Add(-tc.want), rep.Horizon)
		})
	}
	s := memstore.New()
	seed(t, s, "4-days", now.Add(-4*24*time.Hour), true)
	seed(t, s, "8-days", now.Add(-8*24*time.Hour), true)
	rep, err := idempotency.New(s, idempotency.WithReplayWindow(week), idempotency.WithLogger(nil)).Reaper().ReapOnce(t.Context(), now)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Deleted)
	require.True(t, exists(t, s, "4-days"), "still inside the replay window")
	require.False(t, exists(t, s, "8-days"))
}

// Every unfinished record the reaper deletes is logged first, however many
// there are: more than a page, with distinct lease ends or all with one.
func TestReapOnceLogsEveryUnfinishedRecordItDeletes(t *testing.T) {
	for _, tie := range []bool{false, true} {
		t.Run(map[bool]string{false: "staggered", true: "one lease end"}[tie], func(t *testing.T) {
			s := memstore.New()
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
			rep, err := reaper(s, log).ReapOnce(t.Context(), reapT0.Add(100*time.Hour))
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
	s := memstore.New()
	now := reapT0.Add(100 * time.Hour)
	const page = 100 // unfinished records listed per page
	for i := range page {
		rec := seed(t, s, fmt.Sprintf("late-%d", i), reapT0.Add(time.Duration(i)*time.Second), false)
		// A late phase commit by an owner whose lease had ended: updated
		// after the horizon, so not deletable yet.
		require.NoError(t, s.SetRecoveryPoint(t.Context(), rec.Lease(), "order", nil, now.Add(-time.Minute)))
	}
	seed(t, s, "unlisted", reapT0.Add(time.Hour), false)
	log, buf := bufLogger()
	rep, err := reaper(s, log).ReapOnce(t.Context(), now)
	require.NoError(t, err)
	require.True(t, rep.More)
	require.True(t, exists(t, s, "unlisted"), "deleted without being logged")
	require.NotContains(t, buf.String(), keygen.Digest("unlisted"))
	require.Equal(t, page, rep.Skipped)
}

// A Middleware without a store answers 503; its Completer's and Reaper's
// runs fail with an error instead of panicking, also under Start, which
// logs them and goes on.
func TestJobsWithoutAStoreFail(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		log, buf := bufLogger()
		mw := idempotency.New(nil, idempotency.WithLogger(log))
		_, err := mw.Reaper().ReapOnce(t.Context(), time.Now())
		require.ErrorContains(t, err, "idempotency: reaper: idempotency: no store (nil)")
		_, err = mw.Completer(nil).RunOnce(t.Context())
		require.ErrorContains(t, err, "idempotency: completer: idempotency: no store (nil)")

		stopReaper := mw.Reaper().Start(t.Context(), 0)
		stopCompleter := mw.Completer(nil).Start(t.Context(), 0)
		synctest.Wait()
		stopReaper()
		stopCompleter()
		require.Contains(t, buf.String(), `level=ERROR msg="idempotency reaper: run failed"`)
		require.Contains(t, buf.String(), `level=ERROR msg="idempotency completer: run failed"`)
	})
}

// A backlog larger than one run (50,000 records: 500 batches of 100) is
// worked off by runs back to back, a second apart, not one run per
// interval: the Reaper keeps up with any sustained rate of new keys. A run
// cut short by its bound leaves the unfinished records it listed but did
// not reach, and counts them as Skipped; the next run deletes them.
func TestReaperStartWorksOffABacklogAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := memstore.New()
		old := time.Now().Add(-100 * time.Hour)
		const backlog = 50_000
		for i := range backlog {
			seed(t, s, fmt.Sprintf("done-%05d", i), old, true)
		}
		seed(t, s, "stuck", old.Add(time.Second), false) // the newest update: deleted last
		mw, errs, reps := reaperRuns(s, quiet)
		start := time.Now()
		stop := mw.Reaper().Start(t.Context(), 0)
		defer stop()

		require.NoError(t, <-errs)
		rep := <-reps
		require.Equal(t, backlog, rep.Deleted)
		require.Equal(t, 500, rep.Batches)
		require.True(t, rep.More)
		require.Len(t, rep.Unfinished, 1)
		require.Equal(t, 1, rep.Skipped, "the batch bound left the unfinished record for the next run")
		require.True(t, exists(t, s, "stuck"))

		require.NoError(t, <-errs)
		rep = <-reps
		require.Equal(t, time.Second, time.Since(start), "the next run comes at once, not after the interval")
		require.Equal(t, 1, rep.Deleted)
		require.False(t, rep.More)
		require.Len(t, rep.Unfinished, 1)
		require.Zero(t, rep.Skipped)
		require.Zero(t, s.Len())

		require.NoError(t, <-errs)
		<-reps
		require.Equal(t, time.Second+10*time.Minute, time.Since(start), "then the interval again")
	})
}
