package sqlstore_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	mrand "math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// Soak parameters: each request moves the clock by soakStep, so that
// leases end and records pass the cleanup horizon within the run.
const (
	soakStep    = time.Millisecond
	soakLease   = 30 * time.Second  // 30,000 requests
	soakWindow  = 150 * time.Second // the replay window
	soakHorizon = 200 * time.Second // the Reaper's: about 200,000 records stay
	soakBatch   = 100               // the Reaper's and the Completer's batch
)

// soakSegments are the requests served per round, at each number of
// callers.
var soakSegments = []struct{ conc, n int }{{1, 100}, {16, 2000}, {64, 2000}}

// BenchmarkPostgresSoak serves b.N requests on PostgreSQL, in a database of
// its own, with churn: leases run out and the Completer takes their
// records over, and the Reaper deletes what passes the cleanup horizon.
// It reports the throughput and what the table and its indexes hold after.
//
// Every request has a fresh key but one in twenty, a replay of a key
// completed shortly before. Of the fresh keys, 5% heartbeat once before
// they complete, 3% are released, and 2% are abandoned: their lease runs
// out and the Completer's pass takes them over and completes them. The
// rest complete. Each request moves the clock by 1 ms. After each segment
// of requests the Completer (Abandoned, then a takeover-only claim and a
// completion per record) and the Reaper (DeleteBefore until a batch comes
// back short, horizon 200 s: about 200,000 records live) run, untimed.
// Each round serves 100 requests from 1 caller, 2,000 from 16 and 2,000
// from 64 (a pool of 64 connections).
//
// It reports requests per second at each number of callers, over the
// whole run and over its last fifth; the total size after the run; the
// Completer's Abandoned, its mean and longest time; and logs the size of each relation (heap, TOAST,
// indexes), its dead tuples, its autovacuum runs and the seconds an
// autovacuum worker was seen on it (pg_stat_progress_vacuum, sampled every
// 100 ms), pgstattuple's dead and free space and pgstatindex's leaf
// density, and the total size every tenth of the run (lines "soak: ..." on
// stdout). Run it on a server
// with autovacuum on (PostgreSQL's default):
//
//	SAFERETRY_PG_DSN=... go test -run '^$' -bench 'BenchmarkPostgresSoak$' -benchtime 1000000x -timeout 90m ./idempotency/sqlstore/
func BenchmarkPostgresSoak(b *testing.B) {
	db, _ := openPGDatabase(b, "pgstattuple")
	db.SetMaxOpenConns(64)
	db.SetMaxIdleConns(64)
	ctx := context.Background()
	s, err := sqlstore.Open(db, sqlstore.Postgres)
	require.NoError(b, err)
	require.NoError(b, s.Migrate(ctx))
	l := &soakRun{table: sqlstore.DefaultTable, s: s,
		spent: make([]time.Duration, len(soakSegments)), served: make([]int, len(soakSegments)),
		lateSpent:  make([]time.Duration, len(soakSegments)),
		lateServed: make([]int, len(soakSegments)), vacuumed: map[string]time.Duration{}}
	relations := soakRelations(b, db, []*soakRun{l})

	stop := make(chan struct{})
	var sampler sync.WaitGroup
	sampler.Go(func() { soakSampleVacuum(db, relations, stop) })

	perRound := 0
	for _, seg := range soakSegments {
		perRound += seg.n
	}
	rounds := max(1, b.N/perRound)
	b.ResetTimer()
	for round := range rounds {
		late := round >= rounds-rounds/5
		for j, seg := range soakSegments {
			start := time.Now()
			parallel(seg.n, seg.conc, func() { l.request(b) })
			d := time.Since(start)
			l.spent[j] += d
			l.served[j] += seg.n
			if late {
				l.lateSpent[j] += d
				l.lateServed[j] += seg.n
			}
			l.jobs(b)
		}
		if tenth := max(1, rounds/10); (round+1)%tenth == 0 {
			l.sizes = append(l.sizes, fmt.Sprintf("%d:%s", l.requests.Load(),
				mib(soakTotalSize(b, db, l.table))))
		}
	}
	b.StopTimer()
	close(stop)
	sampler.Wait()
	l.vacuumed = relations.busy(l.table)

	for j, seg := range soakSegments {
		b.ReportMetric(l.rate(j), fmt.Sprintf("c%d-req/s", seg.conc))
		b.ReportMetric(l.lateRate(j), fmt.Sprintf("late-c%d-req/s", seg.conc))
	}
	recs, err := l.s.Abandoned(ctx, l.now(), soakBatch)
	require.NoError(b, err)
	b.ReportMetric(float64(l.abandonedTime.Microseconds())/1000/float64(l.abandonedCalls),
		"abandoned-ms")
	b.ReportMetric(float64(l.abandonedMax.Microseconds())/1000, "abandoned-max-ms")
	b.ReportMetric(float64(soakTotalSize(b, db, l.table))/(1<<20), "MiB")
	soakLog("%d requests (%d replays, %d taken over by the Completer, %d reaped); Abandoned found %d",
		l.requests.Load(), l.replays.Load(), l.takenOver, l.reaped, len(recs))
	soakLog("total size every tenth of the run (requests:size): %s", strings.Join(l.sizes, " "))
	soakReport(b, db, l)
}

// soakRun is the Store under soak, with its clock and counts.
type soakRun struct {
	table string
	s     *sqlstore.Store

	seq      atomic.Int64 // requests served: the clock
	requests atomic.Int64
	replays  atomic.Int64

	mu     sync.Mutex
	recent []idempotency.Scope // completed keys, for replays

	takenOver, reaped  int
	abandonedCalls     int
	abandonedTime      time.Duration // spent in Abandoned, and its longest call
	abandonedMax       time.Duration
	spent, lateSpent   []time.Duration
	served, lateServed []int
	sizes              []string
	vacuumed           map[string]time.Duration
}

func (l *soakRun) now() time.Time { return t0.Add(time.Duration(l.seq.Load()) * soakStep) }

func (l *soakRun) tick() time.Time { return t0.Add(time.Duration(l.seq.Add(1)) * soakStep) }

func (l *soakRun) rate(j int) float64 { return float64(l.served[j]) / l.spent[j].Seconds() }

func (l *soakRun) lateRate(j int) float64 {
	return float64(l.lateServed[j]) / l.lateSpent[j].Seconds()
}

var (
	soakRequest  = []byte(`{"amount":4200,"currency":"eur","customer":"cus_1"}`)
	soakResponse = idempotency.Response{Status: 201,
		Header: http.Header{"Content-Type": {"application/json"}},
		Body:   []byte(`{"id":"pay_1","object":"payment","amount":4200,"currency":"eur","status":"succeeded"}`)}
)

// request serves one request: a replay, or a fresh key that completes,
// heartbeats and completes, is released, or is abandoned.
func (l *soakRun) request(b *testing.B) {
	ctx := context.Background()
	l.requests.Add(1)
	now := l.tick()
	r := mrand.IntN(100)
	if r < 5 {
		l.mu.Lock()
		var sc idempotency.Scope
		if len(l.recent) > 0 {
			sc = l.recent[mrand.IntN(len(l.recent))]
		}
		l.mu.Unlock()
		if sc.Key != "" {
			l.replays.Add(1)
			res, err := l.s.Claim(ctx, soakClaim(sc, now))
			if err != nil || res.Acquired() {
				b.Errorf("replay: %v %v", res.Outcome, err)
			}
			return
		}
	}
	sc := idempotency.Scope{Principal: "acct_" + soakHex(4), Method: http.MethodPost,
		Route: "/payments", Key: soakHex(16)}
	res, err := l.s.Claim(ctx, soakClaim(sc, now))
	if err != nil || res.Outcome != idempotency.ClaimCreated {
		b.Errorf("claim: %v %v", res.Outcome, err)
		return
	}
	lease := res.Record.Lease()
	switch {
	case r < 8:
		err = l.s.Release(ctx, lease)
	case r < 10: // abandoned: the Completer's
		return
	case r < 15:
		if err = l.s.Heartbeat(ctx, lease, now.Add(soakLease)); err == nil {
			err = l.s.Complete(ctx, lease, soakResponse, now)
		}
	default:
		err = l.s.Complete(ctx, lease, soakResponse, now)
	}
	if err != nil {
		b.Error(err)
		return
	}
	if r >= 10 {
		l.mu.Lock()
		if len(l.recent) < 1024 {
			l.recent = append(l.recent, sc)
		} else {
			l.recent[mrand.IntN(len(l.recent))] = sc
		}
		l.mu.Unlock()
	}
}

func soakClaim(sc idempotency.Scope, now time.Time) idempotency.Claim {
	return idempotency.Claim{Scope: sc, Fingerprint: strings.Repeat("f0", 32), FingerprintVersion: 1,
		Owner: soakHex(16), Request: soakRequest, Now: now, LeaseFor: soakLease,
		ReplayWindow: soakWindow}
}

// jobs runs the Completer and Reaper once, as the idempotency
// package's do: the Completer takes over the records whose lease ended and
// completes them, the Reaper deletes the records past the horizon.
func (l *soakRun) jobs(b *testing.B) {
	ctx := context.Background()
	now := l.now()
	for {
		start := time.Now()
		recs, err := l.s.Abandoned(ctx, now, soakBatch)
		require.NoError(b, err)
		d := time.Since(start)
		l.abandonedCalls++
		l.abandonedTime += d
		l.abandonedMax = max(l.abandonedMax, d)
		for _, rec := range recs {
			c := soakClaim(rec.Scope, now)
			c.Fingerprint, c.TakeoverOnly = rec.Fingerprint, true
			res, err := l.s.Claim(ctx, c)
			require.NoError(b, err)
			if res.Outcome == idempotency.ClaimTakenOver {
				l.takenOver++
				require.NoError(b, l.s.Complete(ctx, res.Record.Lease(), soakResponse, now))
			}
		}
		if len(recs) < soakBatch {
			break
		}
	}
	for {
		n, err := l.s.DeleteBefore(ctx, now.Add(-soakHorizon), soakBatch)
		require.NoError(b, err)
		l.reaped += n
		if n < soakBatch {
			return
		}
	}
}

func soakHex(n int) string {
	p := make([]byte, n)
	_, _ = rand.Read(p)
	return hex.EncodeToString(p)
}

// soakRels maps the oids of the soaked relations (heaps, TOAST tables) to
// their table and name, and counts the time autovacuum was seen working on
// each.
type soakRels struct {
	mu    sync.Mutex
	table map[int64]string // oid: the Store's table
	name  map[int64]string // oid: the relation's name
	seen  map[int64]time.Duration
}

func (r *soakRels) busy(table string) map[string]time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]time.Duration{}
	for oid, d := range r.seen {
		if r.table[oid] == table {
			out[r.name[oid]] += d
		}
	}
	return out
}

// soakRelations lists the heaps and TOAST tables of the runs' tables.
func soakRelations(b *testing.B, db *sql.DB, layouts []*soakRun) *soakRels {
	r := &soakRels{table: map[int64]string{}, name: map[int64]string{}, seen: map[int64]time.Duration{}}
	for _, l := range layouts {
		rows, err := db.Query(`SELECT c.oid, c.relname FROM pg_class c
WHERE c.relname = $1
UNION ALL
SELECT t.oid, c.relname || ' (toast)' FROM pg_class c JOIN pg_class t ON t.oid = c.reltoastrelid
WHERE c.relname = $1`, l.table)
		require.NoError(b, err)
		for rows.Next() {
			var (
				oid  int64
				name string
			)
			require.NoError(b, rows.Scan(&oid, &name))
			r.table[oid], r.name[oid] = l.table, name
		}
		require.NoError(b, rows.Err())
		require.NoError(b, rows.Close())
	}
	return r
}

// soakSampleVacuum adds 100 ms to a relation each time it finds a vacuum
// working on it, until stop.
func soakSampleVacuum(db *sql.DB, r *soakRels, stop <-chan struct{}) {
	const every = 100 * time.Millisecond
	for {
		select {
		case <-stop:
			return
		case <-time.After(every):
		}
		rows, err := db.Query(`SELECT relid FROM pg_stat_progress_vacuum WHERE datname = current_database()`)
		if err != nil {
			continue
		}
		for rows.Next() {
			var oid int64
			if rows.Scan(&oid) == nil {
				r.mu.Lock()
				if _, ok := r.table[oid]; ok {
					r.seen[oid] += every
				}
				r.mu.Unlock()
			}
		}
		_ = rows.Close()
	}
}

// soakTotalSize is the size of table with its TOAST table and indexes.
func soakTotalSize(b *testing.B, db *sql.DB, table string) int64 {
	var n int64
	require.NoError(b, db.QueryRow(`SELECT coalesce(sum(pg_total_relation_size(oid)), 0) FROM pg_class
WHERE relname = $1 AND relkind = 'r'`, table).Scan(&n))
	return n
}

// soakLog prints a line of the report on stdout, whole: a benchmark's log
// keeps its first lines only.
func soakLog(format string, args ...any) { fmt.Printf("soak: "+format+"\n", args...) }

func mib(n int64) string { return fmt.Sprintf("%.1fMiB", float64(n)/(1<<20)) }

// soakReport logs the run's relations: sizes, tuples, vacuums, and
// pgstattuple's and pgstatindex's view of their space.
func soakReport(b *testing.B, db *sql.DB, l *soakRun) {
	rows, err := db.Query(`SELECT s.relname, n_live_tup, n_dead_tup, n_tup_ins, n_tup_upd,
	n_tup_hot_upd, n_tup_del, autovacuum_count, autoanalyze_count, pg_relation_size(relid),
	coalesce(pg_total_relation_size(nullif(reltoastrelid, 0)), 0), pg_indexes_size(relid)
FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
WHERE s.relname = $1 ORDER BY s.relname`, l.table)
	require.NoError(b, err)
	var tables []string
	for rows.Next() {
		var (
			name                                           string
			live, dead, ins, upd, hot, del, avac, aanalyze int64
			heap, toast, idx                               int64
		)
		require.NoError(b, rows.Scan(&name, &live, &dead, &ins, &upd, &hot, &del, &avac, &aanalyze,
			&heap, &toast, &idx))
		tables = append(tables, name)
		soakLog("%s: heap %s, toast %s, indexes %s; live %d, dead %d; ins %d, upd %d (hot %d), del %d; autovacuum %d (seen %v), autoanalyze %d",
			name, mib(heap), mib(toast), mib(idx), live, dead, ins, upd, hot, del, avac,
			l.vacuumed[name].Round(100*time.Millisecond), aanalyze)
	}
	require.NoError(b, rows.Err())
	require.NoError(b, rows.Close())
	for _, name := range tables {
		var dead, free float64
		require.NoError(b, db.QueryRow(`SELECT dead_tuple_percent, free_percent FROM pgstattuple($1::regclass)`,
			name).Scan(&dead, &free))
		soakLog("%s pgstattuple: dead %.1f%%, free %.1f%%", name, dead, free)
		idx, err := db.Query(`SELECT indexrelid::regclass::text, pg_relation_size(indexrelid)
FROM pg_index WHERE indrelid = $1::regclass ORDER BY 1`, name)
		require.NoError(b, err)
		var names []string
		var sizes []int64
		for idx.Next() {
			var (
				n    string
				size int64
			)
			require.NoError(b, idx.Scan(&n, &size))
			names, sizes = append(names, n), append(sizes, size)
		}
		require.NoError(b, idx.Close())
		for i, n := range names {
			var density, frag float64
			require.NoError(b, db.QueryRow(`SELECT avg_leaf_density, leaf_fragmentation FROM pgstatindex($1)`,
				n).Scan(&density, &frag))
			soakLog("index %s %s, leaf density %.1f%%, fragmentation %.1f%%", n, mib(sizes[i]),
				density, frag)
		}
	}
	var keys []string
	for k := range l.vacuumed {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		soakLog("autovacuum seen on %s for %v", k, l.vacuumed[k].Round(100*time.Millisecond))
	}
}
