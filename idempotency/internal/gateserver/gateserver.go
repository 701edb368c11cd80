// Package gateserver is the server process of the stores' cross-process
// concurrency gates (gate_test.go in packages sqlstore and redisstore),
// whose commands (internal/gateserver in each store's module) pass it
// their store: POST /charges guarded by the idempotency middleware, with a
// handler that records one execution outside any unit of work (an external
// side effect that nothing rolls back), then one charge (in the request's
// unit where the store has one), and takes a while before it answers.
// Several processes share one store; the gate counts both.
package gateserver

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/internal/wait"
)

// Charges is a store's side of the handler. Both methods are called with
// the request's context and the request's key; pid is the process's.
type Charges interface {
	// Execution records one execution of the handler, outside any unit.
	Execution(ctx context.Context, key string, pid int) error
	// Charge records one charge and returns its number.
	Charge(ctx context.Context, key string, pid int) (int64, error)
}

// Run serves POST /charges on addr over store, the handler taking work
// after its charge, until SIGINT or SIGTERM. It prints "listening on
// HOST:PORT" on stdout once it accepts connections.
func Run(addr string, store idempotency.Store, charges Charges, work time.Duration) error {
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	mw := idempotency.New(store,
		idempotency.WithPrincipal(func(*http.Request) (string, error) { return "gate", nil }),
		idempotency.WithLogger(logger))

	pid := os.Getpid()
	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		run, _ := idempotency.FromContext(ctx)
		// An external side effect (like a call to a payment processor): it
		// cannot be rolled back, so the gate counts these to prove the
		// handler ran once.
		if err := charges.Execution(ctx, run.Scope.Key, pid); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		id, err := charges.Charge(ctx, run.Scope.Key, pid)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		// The side effect takes a while: others arrive meanwhile.
		if wait.Sleep(ctx, work) != nil {
			http.Error(w, "canceled", http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, `{"charge":%d,"pid":%d}`, id, pid)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /charges", mw.Wrap(charge))

	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	fmt.Printf("listening on %s\n", ln.Addr())

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
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
