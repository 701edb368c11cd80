package idempotency_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
	"github.com/saferetry/saferetry/keygen"
)

// crashed leaves the state a server that died while serving a request
// leaves: an in-progress record with the request saved at the claim, the
// phases given committed (recovery data as Phase writes it), and a lease
// that is never renewed. The fingerprint is the middleware's, so a later
// client retry of the same request matches it.
func crashed(t *testing.T, s idempotency.Store, sc idempotency.Scope, path, body string, now time.Time,
	phases ...idempotency.CommittedPhase) idempotency.Record {
	t.Helper()
	res, err := s.Claim(t.Context(), idempotency.Claim{
		Scope: sc,
		Fingerprint: idempotency.Fingerprint(idempotency.FingerprintVersion, sc.Method, sc.Route, path, "",
			"application/json", []byte(body)),
		FingerprintVersion: idempotency.FingerprintVersion,
		Owner:              "dead-owner",
		Request:            idempotency.StoredRequest(sc.Method, path, "shop.example", "application/json", []byte(body)),
		Now:                now, LeaseFor: 30 * time.Second, ReplayWindow: 24 * time.Hour,
	})
	require.NoError(t, err)
	require.Equal(t, idempotency.ClaimCreated, res.Outcome)
	rec := res.Record
	if len(phases) > 0 {
		point := phases[len(phases)-1].Name
		require.NoError(t, s.SetRecoveryPoint(t.Context(), rec.Lease(), point, idempotency.Recovery{Phases: phases}.Encode(), now))
		rec.RecoveryPoint = point
	}
	return rec
}

// completer returns the Completer of a middleware over s that accepts
// anonymous keys, and that middleware.
func completer(s idempotency.Store, log *slog.Logger, routes map[string]http.Handler, opts ...idempotency.Option) (*idempotency.Completer, *idempotency.Middleware) {
	mw := idempotency.New(s, append([]idempotency.Option{idempotency.WithAnonymousKeys(true), idempotency.WithLogger(log)}, opts...)...)
	return mw.Completer(routes), mw
}

var shopScope = idempotency.Scope{Method: "POST", Route: "POST /payments", Key: "order-42"}

// A request abandoned after its order phase, with no client retry, is
// completed by the Completer once its lease expired (not before); the
// order is not created again, the card charged once, and a later client
// retry gets the stored response as a replay.
func TestCompleterFinishesAnAbandonedRequest(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memstore.New()
		s := newShop()
		crashed(t, mem, shopScope, "/payments", `{"amount":4200}`, time.Now(), idempotency.CommittedPhase{Name: "order", Output: []byte("ord_1")})
		c, mw := completer(mem, quiet, map[string]http.Handler{"POST /payments": s})

		rep, err := c.RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, idempotency.CompleterReport{}, rep, "the lease is still alive")

		time.Sleep(31 * time.Second)
		rep, err = c.RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, idempotency.CompleterReport{Found: 1, Completed: 1}, rep)
		require.Zero(t, s.runs.Load(), "the order phase was not run again")
		calls, lookups := s.proc.counts()
		require.Equal(t, map[string]int{idempotency.DownstreamKeyOf(shopScope, "charge"): 1}, calls)
		require.Empty(t, lookups)
		_, receipts := s.state()
		require.Equal(t, []string{"rcpt_ord_1_ch_1"}, receipts)

		rec, err := mem.Get(t.Context(), shopScope)
		require.NoError(t, err)
		require.Equal(t, idempotency.Completed, rec.State)
		require.EqualValues(t, 2, rec.Generation)
		require.Equal(t, http.StatusCreated, rec.Response.Status)
		require.Equal(t, "application/json", rec.Response.Header.Get("Content-Type"))

		// The client's retry, through the middleware, replays it.
		mux := http.NewServeMux()
		mux.Handle("POST /payments", mw.Wrap(s))
		replay := send(t, mux, "order-42", `{"amount":4200}`)
		require.Equal(t, http.StatusCreated, replay.Code)
		requireReplayed(t, replay, `{"order":"ord_1","charge":"ch_1","receipt":"rcpt_ord_1_ch_1"}`)

		rep, err = c.RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, idempotency.CompleterReport{}, rep, "nothing left")
	})
}

// The Completer rebuilds the request: method, URL and query, host, content
// type and body, the ServeMux pattern and its path values; no credentials.
func TestCompleterRebuildsTheRequest(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memstore.New()
		sc := idempotency.Scope{Principal: "acct-1", Method: "PATCH", Route: "PATCH /payments/{id}", Key: "k"}
		crashed(t, mem, sc, "/payments/p-7?capture=true", `{"a":1}`, time.Now())
		var seen string
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			run, ok := idempotency.FromContext(r.Context())
			require.True(t, ok)
			b := make([]byte, 64)
			n, _ := r.Body.Read(b)
			seen = fmt.Sprintf("%s %s %s %s %s %q %s %s auth=%q %s", r.Method, r.URL.Path, r.URL.RawQuery, r.Host,
				r.Header.Get("Content-Type"), b[:n], r.Pattern, r.PathValue("id"), r.Header.Get("Authorization"), run.Scope.Principal)
			w.WriteHeader(http.StatusOK)
		})
		c, _ := completer(mem, quiet, map[string]http.Handler{sc.Route: h})
		time.Sleep(time.Minute)
		rep, err := c.RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, 1, rep.Completed)
		require.Equal(t, `PATCH /payments/p-7 capture=true shop.example application/json "{\"a\":1}" PATCH /payments/{id} p-7 auth="" acct-1`, seen)

		// A route that is not a ServeMux pattern: the handler runs directly.
		sc2 := idempotency.Scope{Principal: "acct-1", Method: "POST", Route: "payments-v2", Key: "k"}
		crashed(t, mem, sc2, "/v2/payments", `{}`, time.Now())
		var pattern atomic.Value
		c, _ = completer(mem, quiet, map[string]http.Handler{sc2.Route: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			pattern.Store(r.Pattern + " " + r.URL.Path)
			w.WriteHeader(http.StatusCreated)
		})})
		time.Sleep(time.Minute)
		rep, err = c.RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, 1, rep.Completed)
		require.Equal(t, "payments-v2 /v2/payments", pattern.Load())
	})
}

// A resumed request's URL is the one net/http's server reads from the same
// request line (a request URI: an absolute path, "//" and all, or an
// absolute URI), not a reference that url.Parse would read a host from.
func TestCompleterParsesTheRequestURIAsAServerDoes(t *testing.T) {
	for _, uri := range []string{"//a.example/payments?x=1", "/p%2Fq;r?s", "http://h.example/abs?q=1"} {
		t.Run(uri, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				live, err := http.ReadRequest(bufio.NewReader(strings.NewReader(
					"POST " + uri + " HTTP/1.1\r\nHost: shop.example\r\n\r\n")))
				require.NoError(t, err)
				mem := memstore.New()
				sc := idempotency.Scope{Principal: "acct-1", Method: "POST", Route: "pay", Key: "k"}
				crashed(t, mem, sc, uri, `{}`, time.Now())
				var resumed *url.URL
				c, _ := completer(mem, quiet, map[string]http.Handler{"pay": http.HandlerFunc(
					func(w http.ResponseWriter, r *http.Request) {
						resumed = r.URL
						w.WriteHeader(http.StatusCreated)
					})})
				time.Sleep(time.Minute)
				rep, err := c.RunOnce(t.Context())
				require.NoError(t, err)
				require.Equal(t, 1, rep.Completed)
				require.Equal(t, live.URL.String(), resumed.String())
				require.Equal(t, live.URL.Host, resumed.Host)
				require.Equal(t, live.URL.Path, resumed.Path)
			})
		})
	}
}

// Every listed record is counted once: completed, released, kept, skipped
// or failed; each is reported to the observers.
func TestCompleterOutcomes(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memstore.New()
		t0 := time.Now()
		scope := func(route, key string) idempotency.Scope {
			return idempotency.Scope{Method: "POST", Route: route, Key: key}
		}
		routes := map[string]http.Handler{
			"POST /ok": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }),
			"POST /fails": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(http.StatusServiceUnavailable)
			}),
			"POST /panics": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { panic("handler bug") }),
		}
		order := idempotency.CommittedPhase{Name: "order"}
		crashed(t, mem, scope("POST /ok", "a"), "/ok", `{}`, t0)
		crashed(t, mem, scope("POST /fails", "released"), "/fails", `{}`, t0.Add(1*time.Second))
		crashed(t, mem, scope("POST /fails", "kept"), "/fails", `{}`, t0.Add(2*time.Second), order)
		crashed(t, mem, scope("POST /panics", "p"), "/panics", `{}`, t0.Add(3*time.Second), order)
		crashed(t, mem, scope("POST /unknown", "u"), "/unknown", `{}`, t0.Add(4*time.Second))
		bad, err := mem.Claim(t.Context(), idempotency.Claim{Scope: scope("POST /ok", "bad"), Fingerprint: "fp", Owner: "x",
			Request: []byte("not json"), Now: t0.Add(5 * time.Second), LeaseFor: 30 * time.Second})
		require.NoError(t, err)
		require.Equal(t, idempotency.ClaimCreated, bad.Outcome)

		outcomes := map[string]idempotency.Outcome{}
		log, buf := bufLogger()
		c, _ := completer(mem, log, routes, idempotency.WithObserver(idempotency.Observer{
			Executed: func(_ context.Context, e idempotency.Event) {
				require.True(t, e.Background)
				outcomes[e.Scope.Key] = e.Outcome
			},
		}))
		time.Sleep(time.Minute)
		rep, err := c.RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, idempotency.CompleterReport{Found: 6, Completed: 1, Released: 1, Kept: 1, Skipped: 2, Failed: 1}, rep)
		require.Equal(t, map[string]idempotency.Outcome{"a": idempotency.OutcomeCompleted,
			"released": idempotency.OutcomeReleased, "kept": idempotency.OutcomeKept, "p": idempotency.OutcomePanicked,
			"u": idempotency.OutcomeUnresumable, "bad": idempotency.OutcomeUnresumable}, outcomes)
		require.Contains(t, buf.String(), "no handler for the record's route")
		require.Contains(t, buf.String(), "invalid character")
		require.Contains(t, buf.String(), "panicked")
		// Records are named by digests, never by the raw key or principal.
		require.Contains(t, buf.String(), "key_digest="+keygen.Digest("released")+" ")
		require.Contains(t, buf.String(), "principal_digest="+keygen.Digest("")+" ")
		require.NotContains(t, buf.String(), "key=")
		require.NotContains(t, buf.String(), "principal=")

		_, err = mem.Get(t.Context(), scope("POST /fails", "released"))
		require.ErrorIs(t, err, idempotency.ErrNotFound, "no phase committed: released")
		kept, err := mem.Get(t.Context(), scope("POST /fails", "kept"))
		require.NoError(t, err)
		require.Equal(t, idempotency.InProgress, kept.State)
		require.False(t, kept.LeaseUntil.After(time.Now()), "kept with its lease ended, to resume")
		p, err := mem.Get(t.Context(), scope("POST /panics", "p"))
		require.NoError(t, err)
		require.Equal(t, "order", p.RecoveryPoint, "a panic after a phase keeps the record")

		// The next run skips what it cannot resume, and backs off from what
		// it failed to finish; once the wait is over it retries those.
		time.Sleep(time.Millisecond) // a lease ended at now expires after now
		rep, err = c.RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, idempotency.CompleterReport{Found: 4, Skipped: 4}, rep, "two remembered, two backing off")
		time.Sleep(2 * time.Minute) // the wait after one failure
		rep, err = c.RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, idempotency.CompleterReport{Found: 4, Skipped: 2, Kept: 1, Failed: 1}, rep, "two remembered, two retried")
	})
}

// A record the Completer keeps failing to finish is tried again after
// 2^n minutes, capped at an hour, not at every run; a client retry is not
// delayed by it, and a record that completes is forgotten.
func TestCompleterBacksOffFromRecordsItFailsToFinish(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memstore.New()
		var calls atomic.Int64
		var healthy atomic.Bool
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			calls.Add(1)
			if !healthy.Load() {
				w.WriteHeader(http.StatusBadGateway) // the downstream service is down
				return
			}
			w.WriteHeader(http.StatusCreated)
		})
		crashed(t, mem, shopScope, "/payments", `{}`, time.Now(), idempotency.CommittedPhase{Name: "order"})
		time.Sleep(time.Minute)
		c, mw := completer(mem, quiet, map[string]http.Handler{"POST /payments": h})
		run := func() idempotency.CompleterReport {
			t.Helper()
			rep, err := c.RunOnce(t.Context())
			require.NoError(t, err)
			return rep
		}
		require.Equal(t, 1, run().Kept) // failure 1: wait 2 min
		tried := []int64{calls.Load()}
		// Every minute for 80 minutes: tried at +2, +6 (4 min), +14 (8),
		// +30 (16), +62 (32), then every hour.
		for range 80 {
			time.Sleep(time.Minute)
			rep := run()
			require.Equal(t, 1, rep.Found)
			tried = append(tried, calls.Load())
		}
		for i, at := range []int{2, 6, 14, 30, 62} {
			require.EqualValues(t, i+1, tried[at-1], "before +%d min", at)
			require.EqualValues(t, i+2, tried[at], "at +%d min", at)
		}
		require.EqualValues(t, 6, tried[80])

		// A client retry resumes at once, backoff or not.
		healthy.Store(true)
		mux := http.NewServeMux()
		mux.Handle("POST /payments", mw.Wrap(h))
		time.Sleep(time.Millisecond)
		require.Equal(t, http.StatusCreated, send(t, mux, "order-42", `{}`).Code)
		require.Equal(t, idempotency.CompleterReport{}, run())
		require.Zero(t, idempotency.CompleterBackoffs(c), "forgotten once no longer listed")

		// A completed record ends its backoff.
		crashed(t, mem, idempotency.Scope{Method: "POST", Route: "POST /payments", Key: "k2"}, "/payments", `{}`, time.Now(),
			idempotency.CommittedPhase{Name: "order"})
		healthy.Store(false)
		time.Sleep(time.Minute)
		require.Equal(t, 1, run().Kept)
		require.Equal(t, 1, idempotency.CompleterBackoffs(c))
		healthy.Store(true)
		time.Sleep(2 * time.Minute)
		require.Equal(t, 1, run().Completed)
		require.Zero(t, idempotency.CompleterBackoffs(c))
	})
}

// A record that went away between the listing and the claim is not
// recreated; a record someone else took first is left alone.
func TestCompleterRaces(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memstore.New()
		ran := atomic.Int64{}
		routes := map[string]http.Handler{"POST /payments": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			ran.Add(1)
		})}
		rec := crashed(t, mem, shopScope, "/payments", `{}`, time.Now())
		time.Sleep(time.Minute)

		// Gone: released by its owner after the listing.
		gone := &listOnly{Store: mem, before: func() { require.NoError(t, mem.Release(t.Context(), rec.Lease())) }}
		c, _ := completer(gone, quiet, routes)
		rep, err := c.RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, idempotency.CompleterReport{Found: 1, Skipped: 1}, rep)
		require.Zero(t, mem.Len(), "no record was left behind")
		require.Zero(t, gone.created, "the Completer's claim never creates a record (Claim.TakeoverOnly)")
		require.Zero(t, ran.Load())

		// Taken: a client retry took it over after the listing.
		rec = crashed(t, mem, shopScope, "/payments", `{}`, time.Now())
		time.Sleep(time.Minute)
		taken := &listOnly{Store: mem, before: func() {
			res, err := mem.Claim(t.Context(), idempotency.Claim{Scope: rec.Scope, Fingerprint: rec.Fingerprint,
				FingerprintVersion: rec.FingerprintVersion, Owner: "client-retry", Now: time.Now(), LeaseFor: time.Minute})
			require.NoError(t, err)
			require.Equal(t, idempotency.ClaimTakenOver, res.Outcome)
		}}
		c, _ = completer(taken, quiet, routes)
		rep, err = c.RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, idempotency.CompleterReport{Found: 1, Skipped: 1}, rep)
		got, err := mem.Get(t.Context(), rec.Scope)
		require.NoError(t, err)
		require.Equal(t, "client-retry", got.Owner)
		require.Zero(t, ran.Load())

		// Completed long ago (out of the replay window) and listed by a
		// stale read: the Completer's claim never restarts a completed
		// record.
		require.NoError(t, mem.Complete(t.Context(), got.Lease(), idempotency.Response{Status: 201}, time.Now()))
		time.Sleep(48 * time.Hour)
		c, _ = completer(&staleList{Store: mem, rec: got}, quiet, routes)
		rep, err = c.RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, idempotency.CompleterReport{Found: 1, Skipped: 1}, rep)
		got, err = mem.Get(t.Context(), rec.Scope)
		require.NoError(t, err)
		require.Equal(t, idempotency.Completed, got.State)
		require.Zero(t, ran.Load())
	})
}

// listOnly runs before after listing, and counts the claims that created a
// record.
type listOnly struct {
	*memstore.Store
	before  func()
	created int
}

func (l *listOnly) Claim(ctx context.Context, c idempotency.Claim) (idempotency.ClaimResult, error) {
	res, err := l.Store.Claim(ctx, c)
	if res.Outcome == idempotency.ClaimCreated {
		l.created++
	}
	return res, err
}

func (l *listOnly) Abandoned(ctx context.Context, now time.Time, limit int) ([]idempotency.Record, error) {
	recs, err := l.Store.Abandoned(ctx, now, limit)
	l.before()
	return recs, err
}

// staleList lists rec whatever the store holds.
type staleList struct {
	*memstore.Store
	rec idempotency.Record
}

func (s *staleList) Abandoned(context.Context, time.Time, int) ([]idempotency.Record, error) {
	return []idempotency.Record{s.rec}, nil
}

type claimFails struct{ *memstore.Store }

func (claimFails) Claim(context.Context, idempotency.Claim) (idempotency.ClaimResult, error) {
	return idempotency.ClaimResult{}, errBoom
}

func TestCompleterStoreErrors(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		routes := map[string]http.Handler{"POST /payments": http.NotFoundHandler()}
		var reported []error
		obs := idempotency.WithObserver(idempotency.Observer{
			CompleterRun: func(_ context.Context, _ idempotency.CompleterReport, err error) { reported = append(reported, err) },
		})
		c, _ := completer(opFails{Store: memstore.New(), fail: "abandoned"}, quiet, routes, obs)
		_, err := c.RunOnce(t.Context())
		require.ErrorIs(t, err, errBoom)
		require.EqualError(t, err, "idempotency: completer: listing abandoned records: boom")

		mem := memstore.New()
		crashed(t, mem, shopScope, "/payments", `{}`, time.Now())
		time.Sleep(time.Minute)
		c, _ = completer(claimFails{mem}, quiet, routes, obs)
		rep, err := c.RunOnce(t.Context())
		require.ErrorIs(t, err, errBoom)
		require.EqualError(t, err, "idempotency: completer: claim: boom")
		require.Equal(t, 1, rep.Found)
		require.Len(t, reported, 2)
		require.ErrorIs(t, reported[1], errBoom, "the observers see the run's error")

		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		c, _ = completer(mem, quiet, routes)
		_, err = c.RunOnce(ctx)
		require.ErrorIs(t, err, context.Canceled)
	})
}

// The Completer stores responses as its middleware does: the middleware's
// options (here WithStore5xx) and lease apply to it.
func TestCompleterSharesTheMiddlewarePolicy(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memstore.New()
		crashed(t, mem, shopScope, "/payments", `{}`, time.Now())
		time.Sleep(time.Minute)
		var leaseLeft time.Duration
		c, _ := completer(mem, quiet, map[string]http.Handler{"POST /payments": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			run, _ := idempotency.FromContext(r.Context())
			rec, err := mem.Get(r.Context(), run.Scope)
			require.NoError(t, err)
			leaseLeft = time.Until(rec.LeaseUntil)
			w.WriteHeader(http.StatusBadGateway)
		})}, idempotency.WithStore5xx(true), idempotency.WithLease(time.Hour))
		rep, err := c.RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, 1, rep.Completed, "a 502 is stored under WithStore5xx")
		require.Equal(t, time.Hour, leaseLeft)
	})
}

// Start runs at once, then every interval, and stops cleanly; a handler
// running when stop is called sees its context canceled.
func TestCompleterStart(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memstore.New()
		var ran atomic.Int64
		routes := map[string]http.Handler{"POST /payments": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			ran.Add(1)
			w.WriteHeader(http.StatusCreated)
		})}
		crashed(t, mem, shopScope, "/payments", `{}`, time.Now())
		time.Sleep(time.Minute)
		runs := make(chan idempotency.CompleterReport, 4)
		c, _ := completer(mem, quiet, routes, idempotency.WithObserver(idempotency.Observer{
			CompleterRun: func(_ context.Context, rep idempotency.CompleterReport, err error) {
				require.NoError(t, err)
				runs <- rep
			},
		}))
		start := time.Now()
		stop := c.Start(t.Context(), 5*time.Second)
		require.Equal(t, 1, (<-runs).Completed)

		crashed(t, mem, idempotency.Scope{Method: "POST", Route: "POST /payments", Key: "second"}, "/payments", `{}`,
			time.Now().Add(-time.Minute))
		require.Equal(t, 1, (<-runs).Completed)
		require.Equal(t, 5*time.Second, time.Since(start))
		require.EqualValues(t, 2, ran.Load())
		stop()
		stop()
		time.Sleep(time.Minute)
		synctest.Wait()
		require.Empty(t, runs, "a run after stop")

		crashed(t, mem, idempotency.Scope{Method: "POST", Route: "POST /slow", Key: "slow"}, "/slow", `{}`, time.Now())
		time.Sleep(time.Minute)
		started := make(chan struct{})
		c, _ = completer(mem, quiet, map[string]http.Handler{"POST /slow": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			close(started)
			<-r.Context().Done()
			w.WriteHeader(http.StatusServiceUnavailable)
		})})
		stop = c.Start(t.Context(), 0)
		<-started
		stop()
		_, err := mem.Get(t.Context(), idempotency.Scope{Method: "POST", Route: "POST /slow", Key: "slow"})
		require.ErrorIs(t, err, idempotency.ErrNotFound, "the canceled run released its key")
	})
}

// The Completer and a stalled original owner: the owner wakes up after the
// Completer took its record over, and none of its phases commit.
func TestCompleterFencesTheStalledOwner(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := &partitioned{Store: memstore.New()}
		s := newShop()
		stalled, resume := make(chan struct{}), make(chan struct{})
		var zombieErr error
		first := true
		zombie := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			run, _ := idempotency.FromContext(r.Context())
			if first {
				first = false
				_, _ = run.Phase(r.Context(), "order", func(context.Context) ([]byte, error) { return []byte("ord_z"), nil })
				mem.cut.Store(true) // its heartbeats no longer get through
				close(stalled)
				<-resume
				_, zombieErr = run.External(r.Context(), "charge", s.proc.charge, s.proc.find)
				w.WriteHeader(http.StatusBadGateway)
				return
			}
			s.ServeHTTP(w, r)
		})
		c, mw := completer(mem, quiet, map[string]http.Handler{"POST /payments": zombie})
		mux := http.NewServeMux()
		mux.Handle("POST /payments", mw.Wrap(zombie))
		done := make(chan *httptest.ResponseRecorder)
		go func() { done <- send(t, mux, "order-42", `{}`) }()
		<-stalled
		time.Sleep(time.Minute)
		mem.cut.Store(false)
		rep, err := c.RunOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, 1, rep.Completed)
		close(resume)
		<-done
		require.ErrorIs(t, zombieErr, idempotency.ErrLeaseLost)
		calls, _ := s.proc.counts()
		require.Len(t, calls, 1, "only the Completer charged")
		for _, n := range calls {
			require.Equal(t, 1, n)
		}
		rec, err := mem.Get(t.Context(), shopScope)
		require.NoError(t, err)
		require.Equal(t, idempotency.Completed, rec.State)
		require.Contains(t, string(rec.Response.Body), `"order":"ord_z"`, "the Completer resumed after the zombie's order")
		require.True(t, errors.Is(zombieErr, idempotency.ErrLeaseLost))
	})
}

// A run takes over at most 100 records; the records it skips (remembered
// as unresumable, or backing off) do not take the batch's places, and the
// records over the batch wait for the next run.
func TestCompleterBatch(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memstore.New()
		failed := map[string]bool{} // keys whose first execution failed
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			run, _ := idempotency.FromContext(r.Context())
			if !failed[run.Scope.Key] {
				failed[run.Scope.Key] = true
				w.WriteHeader(http.StatusBadGateway) // kept at its phase, backing off
				return
			}
			w.WriteHeader(http.StatusCreated)
		})
		t0 := time.Now()
		for i := range 2 {
			crashed(t, mem, idempotency.Scope{Method: "POST", Route: "POST /unknown", Key: fmt.Sprint("u", i)},
				"/unknown", `{}`, t0)
		}
		for i := range 101 {
			crashed(t, mem, idempotency.Scope{Method: "POST", Route: "POST /payments", Key: fmt.Sprintf("k%03d", i)},
				"/payments", `{}`, t0.Add(time.Second), idempotency.CommittedPhase{Name: "order"})
		}
		c, _ := completer(mem, quiet, map[string]http.Handler{"POST /payments": h})
		time.Sleep(time.Minute)
		run := func() idempotency.CompleterReport {
			t.Helper()
			rep, err := c.RunOnce(t.Context())
			require.NoError(t, err)
			return rep
		}
		require.Equal(t, idempotency.CompleterReport{Found: 100, Skipped: 2, Kept: 98}, run(),
			"100 listed, the oldest first: 2 unresumable, 98 taken")
		require.Equal(t, idempotency.CompleterReport{Found: 5, Skipped: 2, Kept: 3}, run(),
			"2 remembered, the 3 left taken (the 98 kept end their lease now: listed from the next instant)")
		time.Sleep(2 * time.Minute)
		require.Equal(t, idempotency.CompleterReport{Found: 103, Skipped: 3, Completed: 100}, run(),
			"2 remembered; 100 taken, the batch; 1 waits for the next run")
		require.Equal(t, idempotency.CompleterReport{Found: 3, Skipped: 2, Completed: 1}, run())
	})
}
