//go:build unix

// Command phaseserver is the server process of the crash-recovery tests on
// Redis (crash_test.go in package redisstore): POST /payments guarded by
// the idempotency middleware over the Redis store, with atomic phases as a
// handler writes them on a store without transactions: "order" (a phase
// whose write is made idempotent by a unique key in its own data: SET NX
// under the phase's downstream key, so that a phase run again after a
// crash before its commit finds its order), "charge" (an External phase
// that calls a card processor with the derived downstream key, and looks
// the charge up on resume) and the receipt (SET NX under the order, before
// the response is stored).
//
// Every run of the order phase's function counts itself (INCR), so the
// tests see that a resume skips a committed phase. The test-only flag
// -crash makes the process SIGKILL itself at a point of the first request:
// "after-order" (the order phase committed, the charge not started) or
// "after-charge" (the processor answered, the charge phase not committed).
// -completer runs a Completer for the route at that interval.
//
// It prints "listening on HOST:PORT" on stdout once it accepts connections,
// and runs until it is killed or receives SIGINT/SIGTERM.
package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/redisstore"
	"github.com/saferetry/saferetry/idempotency/redisstore/internal/rclient"
)

type server struct {
	rdb       redis.UniversalClient
	prefix    string
	processor string
	crash     string
	pid       int
	client    *http.Client
}

func main() {
	redisAddr := flag.String("redis", "",
		"Redis address (with -cluster: the Cluster's addresses, comma-separated)")
	cluster := flag.Bool("cluster", false, "the addresses are a Redis Cluster's")
	prefix := flag.String("prefix", "", "key prefix of the store and of the business keys")
	processor := flag.String("processor", "", "base URL of the card processor")
	lease := flag.Duration("lease", 30*time.Second, "idempotency lease")
	crash := flag.String("crash", "", "kill the process with SIGKILL at this point of the first "+
		`request: "after-order" or "after-charge"`)
	completer := flag.Duration("completer", 0, "run a completer at this interval (0: none)")
	flag.Parse()
	err := run(*redisAddr, *cluster, *prefix, *processor, *crash, *lease, *completer)
	if err != nil {
		log.Fatal(err)
	}
}

func run(redisAddr string, cluster bool, prefix, processor, crash string,
	lease, completer time.Duration) error {
	if redisAddr == "" || prefix == "" || processor == "" {
		return errors.New("-redis, -prefix and -processor are required")
	}
	rdb := rclient.Open(redisAddr, cluster)
	defer rdb.Close()
	// The tests' Redis servers keep nothing on disk: WithMemoryOnly accepts them.
	store, err := redisstore.New(rdb, redisstore.WithPrefix(prefix+"idem:"),
		redisstore.WithMemoryOnly(true))
	if err != nil {
		return err
	}
	defer store.Close()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	s := &server{rdb: rdb, prefix: prefix, processor: processor, crash: crash, pid: os.Getpid(),
		client: &http.Client{Timeout: 10 * time.Second}}
	pay := http.HandlerFunc(s.pay)
	mw := idempotency.New(store,
		idempotency.WithPrincipal(func(r *http.Request) (string, error) {
			return r.Header.Get("X-Account"), nil
		}),
		idempotency.WithLease(lease), idempotency.WithLogger(logger))
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Wrap(pay))

	if completer > 0 {
		defer mw.Completer(map[string]http.Handler{"POST /payments": pay}).Start(ctx, completer)()
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
// with no deferred function and no response.
func (s *server) die(point string) {
	if s.crash == point {
		fmt.Fprintf(os.Stderr, "phaseserver %d: crashing %s\n", s.pid, point)
		_ = syscall.Kill(s.pid, syscall.SIGKILL)
		select {} // the signal is on its way
	}
}

func (s *server) pay(w http.ResponseWriter, r *http.Request) {
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
		if err := s.rdb.Incr(ctx, s.prefix+"order-runs:"+run.Scope.Key).Err(); err != nil {
			return nil, err
		}
		// The order's unique key is the phase's downstream key: the same in
		// every execution of the request, so a run after a crash before the
		// commit finds the order the first one made.
		k := s.prefix + "order:" + run.DownstreamKey("order")
		id := "ord_" + randHex()
		mine := fmt.Sprintf("%s/%d/%d/%s", id, amount, s.pid, run.Scope.Key)
		if err := s.rdb.SetNX(ctx, k, mine, 0).Err(); err != nil {
			return nil, err
		}
		v, err := s.rdb.Get(ctx, k).Result()
		if err != nil {
			return nil, err
		}
		if err := s.rdb.SAdd(ctx, s.prefix+"orders:"+run.Scope.Key, v).Err(); err != nil {
			return nil, err
		}
		return []byte(v), nil
	})
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	s.die("after-order")

	charge, err := run.External(ctx, "charge",
		func(ctx context.Context, key string) ([]byte, error) {
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.processor+"/charges",
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
			u := s.processor + "/charges/" + url.PathEscape(key)
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

	// The receipt, unique per order: written again by a run that stored no
	// response, it stays the first one.
	receipt := fmt.Sprintf("%s/%d", charge, s.pid)
	if err := s.rdb.SetNX(ctx, s.prefix+"receipt:"+string(order), receipt, 0).Err(); err != nil {
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
