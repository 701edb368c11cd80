//go:build unix

// Package phaseserver is the server process of the stores' crash-recovery
// tests (crash_test.go in packages sqlstore and redisstore), whose
// commands (internal/phaseserver in each store's module) pass it their
// store and their writes: POST /payments guarded by the idempotency
// middleware, with the worked example of atomic phases: "order" (a phase
// that writes the order), "charge" (an External phase that calls a card
// processor with the derived downstream key, and looks the charge up on
// resume) and the receipt (written before the response is stored).
//
// The test-only setting Crash makes the process SIGKILL itself at a point
// of the first request: "after-order" (the order phase committed, the
// charge not started) or "after-charge" (the processor answered, the
// charge phase not committed). Completer runs a Completer for the route at
// that interval. Auth makes the handler refuse, with 401, a request
// without the X-Account header, as a handler that checks credentials
// itself does (a request the Completer resumes carries none).
package phaseserver

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"syscall"
	"time"

	"github.com/saferetry/saferetry/idempotency"
)

// Writes is a store's side of the handler: its business writes, each with
// the context of the phase or of the request, and the process's pid.
type Writes interface {
	// Order writes the order id of amount for run in the order phase and
	// returns the order the phase commits: id, or the one an earlier run
	// of the phase wrote where the store's writes cannot roll back.
	Order(ctx context.Context, run *idempotency.Run, id string, amount int64, pid int) ([]byte,
		error)
	// Receipt writes the receipt of order and charge, before the response
	// is stored.
	Receipt(ctx context.Context, run *idempotency.Run, order, charge []byte, pid int) error
}

// Config is what the flags that every store's command shares set.
type Config struct {
	Processor string        // base URL of the card processor
	Lease     time.Duration // idempotency lease
	Crash     string        // "after-order", "after-charge" or ""
	Completer time.Duration // a Completer's interval (0: none)
	Auth      bool          // 401 to a request without X-Account
}

// Flags registers the shared flags on the command line's flag set; the
// Config is set once flag.Parse ran.
func Flags() *Config {
	c := &Config{}
	flag.StringVar(&c.Processor, "processor", "", "base URL of the card processor")
	flag.DurationVar(&c.Lease, "lease", 30*time.Second, "idempotency lease")
	flag.StringVar(&c.Crash, "crash", "", "kill the process with SIGKILL at this point of the "+
		`first request: "after-order" or "after-charge"`)
	flag.DurationVar(&c.Completer, "completer", 0, "run a completer at this interval (0: none)")
	flag.BoolVar(&c.Auth, "auth", false, "the handler answers 401 to a request without X-Account")
	return c
}

type server struct {
	Config
	writes Writes
	pid    int
	client *http.Client
}

// Serve serves POST /payments on a loopback port over store until ctx
// ends. It prints "listening on HOST:PORT" on stdout once it accepts
// connections.
func Serve(ctx context.Context, store idempotency.Store, writes Writes, c Config) error {
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	s := &server{Config: c, writes: writes, pid: os.Getpid(),
		client: &http.Client{Timeout: 10 * time.Second}}
	pay := http.HandlerFunc(s.pay)
	mw := idempotency.New(store,
		idempotency.WithPrincipal(func(r *http.Request) (string, error) {
			return r.Header.Get("X-Account"), nil
		}),
		idempotency.WithLease(c.Lease), idempotency.WithLogger(logger))
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Wrap(pay))

	if c.Completer > 0 {
		defer mw.Completer(map[string]http.Handler{"POST /payments": pay}).Start(ctx, c.Completer)()
	}

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	fmt.Printf("listening on %s\n", ln.Addr())
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return srv.Shutdown(sctx)
	}
}

// die is the test-only trigger: the process kills itself, as a crash would,
// with no deferred function, no rollback and no response.
func (s *server) die(point string) {
	if s.Crash == point {
		fmt.Fprintf(os.Stderr, "phaseserver %d: crashing %s\n", s.pid, point)
		_ = syscall.Kill(s.pid, syscall.SIGKILL)
		select {} // the signal is on its way
	}
}

func (s *server) pay(w http.ResponseWriter, r *http.Request) {
	if s.Auth && r.Header.Get("X-Account") == "" {
		http.Error(w, "no credentials", http.StatusUnauthorized)
		return
	}
	ctx := r.Context()
	run, ok := idempotency.FromContext(ctx)
	if !ok {
		http.Error(w, "not a guarded request", http.StatusBadRequest)
		return
	}
	body, _ := io.ReadAll(r.Body)
	var amount int64
	if _, err := fmt.Sscanf(string(body), `{"amount":%d}`, &amount); err != nil {
		http.Error(w, "body must be {\"amount\":N}", http.StatusBadRequest)
		return
	}

	order, err := run.Phase(ctx, "order", func(ctx context.Context) ([]byte, error) {
		return s.writes.Order(ctx, run, "ord_"+randHex(), amount, s.pid)
	})
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	s.die("after-order")

	charge, err := run.External(ctx, "charge",
		func(ctx context.Context, key string) ([]byte, error) {
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.Processor+"/charges",
				bytes.NewReader(fmt.Appendf(nil, `{"order":%q,"amount":%d}`, order, amount)))
			if err != nil {
				return nil, err
			}
			req.Header.Set("Idempotency-Key", key)
			out, status, err := s.do(req)
			if err != nil {
				return nil, err
			}
			if status != http.StatusOK && status != http.StatusCreated {
				return nil, fmt.Errorf("processor answered %d", status)
			}
			s.die("after-charge")
			return out, nil
		},
		func(ctx context.Context, key string) ([]byte, bool, error) {
			u := s.Processor + "/charges/" + url.PathEscape(key)
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
			if err != nil {
				return nil, false, err
			}
			out, status, err := s.do(req)
			switch {
			case err != nil:
				return nil, false, err
			case status == http.StatusNotFound:
				return nil, false, nil
			case status == http.StatusOK:
				return out, true, nil
			}
			return nil, false, fmt.Errorf("processor lookup answered %d", status)
		})
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}

	if err := s.writes.Receipt(ctx, run, order, charge, s.pid); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"order":%q,"charge":%q,"receipt_pid":%d}`, order, charge, s.pid)
}

func (s *server) do(req *http.Request) ([]byte, int, error) {
	resp, err := s.client.Do(req)
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return b, resp.StatusCode, err
}

func randHex() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
