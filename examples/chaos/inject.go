package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"

	"github.com/saferetry/saferetry/idempotency"
)

// faultLayer is the outermost HTTP handler of the service. During an
// episode of an HTTP-level fault it answers 503/429 before the handler runs,
// or lets the handler run and commit and then loses its answer; it also
// counts what the server sent.
type faultLayer struct {
	next    http.Handler
	episode atomic.Pointer[mixEntry] // the current episode; nil or calm: pass through
	stall   time.Duration            // how long a "slow" request stalls

	inflight atomic.Int64
	requests atomic.Int64 // requests that reached the server
	executed atomic.Int64 // fresh (not replayed) 201 answers from the handler
	replays  atomic.Int64 // answers with Idempotent-Replayed: true
	conflict atomic.Int64 // 409 idempotency_request_in_progress answers

	mu       sync.Mutex
	injected map[faultKind]int64 // faults actually applied to a request
}

func newFaultLayer(stall time.Duration) *faultLayer {
	return &faultLayer{stall: stall, injected: map[faultKind]int64{}}
}

func (f *faultLayer) setEpisode(e *mixEntry) { f.episode.Store(e) }

func (f *faultLayer) count(k faultKind) {
	f.mu.Lock()
	f.injected[k]++
	f.mu.Unlock()
}

func (f *faultLayer) injectedCounts() map[faultKind]int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make(map[faultKind]int64, len(f.injected))
	for k, v := range f.injected {
		out[k] = v
	}
	return out
}

func (f *faultLayer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.inflight.Add(1)
	defer f.inflight.Add(-1)
	f.requests.Add(1)

	var kind faultKind
	if e := f.episode.Load(); e != nil && rand.Float64() < e.share {
		kind = e.kind
	}
	switch kind {
	case fault503:
		f.count(kind)
		if rand.IntN(2) == 0 {
			w.Header().Set("Retry-After", "1")
		}
		http.Error(w, "service unavailable (injected)", http.StatusServiceUnavailable)
		return
	case fault429:
		f.count(kind)
		w.Header().Set("Retry-After", "1")
		http.Error(w, "too many requests (injected)", http.StatusTooManyRequests)
		return
	case faultSlow:
		f.count(kind)
		r = r.WithContext(context.WithValue(r.Context(), stallKey{}, f.stall))
	}

	rec := &recorder{header: http.Header{}}
	f.next.ServeHTTP(rec, r)
	f.observe(rec)

	switch kind {
	case fault5xxAfterCommit:
		f.count(kind)
		// The work is done and committed; a 5xx replaces its answer.
		status := []int{http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout}[rand.IntN(3)]
		http.Error(w, "answer replaced by a 5xx after the commit (injected)", status)
		return
	case faultAbort:
		f.count(kind)
		panic(http.ErrAbortHandler) // net/http closes the connection, no response
	}
	rec.copyTo(w)
}

// observe counts the middleware's answers.
func (f *faultLayer) observe(rec *recorder) {
	switch {
	case rec.header.Get(idempotency.ReplayedHeader) == "true":
		f.replays.Add(1)
	case rec.status == http.StatusCreated:
		f.executed.Add(1)
	case rec.status == http.StatusConflict && strings.Contains(rec.body.String(), string(idempotency.CodeInProgress)):
		f.conflict.Add(1)
	}
}

// recorder buffers a response so the fault layer can drop or forward it.
type recorder struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func (r *recorder) Header() http.Header { return r.header }

func (r *recorder) WriteHeader(code int) {
	if r.status == 0 {
		r.status = code
	}
}

func (r *recorder) Write(p []byte) (int, error) {
	if r.status == 0 {
		r.status = http.StatusOK
	}
	return r.body.Write(p)
}

func (r *recorder) copyTo(w http.ResponseWriter) {
	for k, v := range r.header {
		w.Header()[k] = v
	}
	if r.status == 0 {
		r.status = http.StatusOK
	}
	w.WriteHeader(r.status)
	_, _ = w.Write(r.body.Bytes())
}

// toxics drives the in-process toxiproxy proxy: one toxic at a time, named
// "chaos", added at the start of an episode and removed at its end. Adding a
// toxic draws, for every open and later connection, whether it is hit
// (toxiproxy's "toxicity"), so an episode hits about share of the
// connections that carry traffic while it lasts.
type toxics struct {
	proxy          *toxiproxy.Proxy
	attemptTimeout time.Duration
	active         bool
}

func (t *toxics) apply(e mixEntry) error {
	var typ, stream, attrs string
	switch e.kind {
	case faultLatency:
		lat := t.attemptTimeout * 4 / 3
		typ, stream = "latency", "downstream"
		attrs = fmt.Sprintf(`{"latency":%d,"jitter":%d}`, lat.Milliseconds(), (lat / 2).Milliseconds())
	case faultReset:
		typ, stream, attrs = "reset_peer", "downstream", `{"timeout":0}`
	case faultResetReq:
		typ, stream, attrs = "reset_peer", "upstream", `{"timeout":0}`
	case faultTimeout:
		typ, stream, attrs = "timeout", "downstream", `{"timeout":2000}`
	default:
		return nil // not a network fault
	}
	js := fmt.Sprintf(`{"name":"chaos","type":%q,"stream":%q,"toxicity":%g,"attributes":%s}`, typ, stream, e.share, attrs)
	if _, err := t.proxy.Toxics.AddToxicJson(strings.NewReader(js)); err != nil {
		return fmt.Errorf("toxiproxy: adding %s: %w", e.kind, err)
	}
	t.active = true
	return nil
}

func (t *toxics) clear() error {
	if !t.active {
		return nil
	}
	t.active = false
	if err := t.proxy.Toxics.RemoveToxic(context.Background(), "chaos"); err != nil {
		return fmt.Errorf("toxiproxy: removing the toxic: %w", err)
	}
	return nil
}

// runSchedule applies episodes from sched until ctx is done, then clears
// every fault. now is the episode being applied, for the progress line.
func runSchedule(ctx context.Context, sched *schedule, mean time.Duration, rnd *rand.Rand,
	tx *toxics, layer *faultLayer, now *atomic.Pointer[mixEntry]) error {
	defer func() {
		layer.setEpisode(nil)
		now.Store(nil)
	}()
	for {
		e := sched.next()
		if err := tx.apply(e); err != nil {
			return err
		}
		layer.setEpisode(&e)
		now.Store(&e)
		d := time.Duration(float64(mean) * (0.5 + rnd.Float64()))
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return tx.clear()
		case <-t.C:
		}
		layer.setEpisode(nil)
		if err := tx.clear(); err != nil {
			return err
		}
	}
}

// newToxiproxyServer returns the toxiproxy API server that owns the proxy,
// logging nowhere. toxiproxy.NewServer takes a zerolog.Logger; go.mod lists
// zerolog only as an indirect dependency, so instead of importing it this
// derives the logger type from NewServer's signature and asks a zero
// Logger for one that writes to io.Discard.
func newToxiproxyServer() *toxiproxy.ApiServer {
	return withDiscardLogger(toxiproxy.NewServer, toxiproxy.NewMetricsContainer(nil))
}

func withDiscardLogger[M any, L interface{ Output(io.Writer) L }](newServer func(M, L) *toxiproxy.ApiServer, m M) *toxiproxy.ApiServer {
	var zero L
	return newServer(m, zero.Output(io.Discard))
}
