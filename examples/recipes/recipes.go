// Package recipes holds the README's three recipes (a client, a guarded
// handler and a guarded job) and the client guide's observers. The README
// and docs/CLIENT.md quote the lines between each "begin recipe" and "end
// recipe" comment byte for byte, one tab less (TestDocsQuoteTheRecipes),
// and TestRecipes and TestObservers run them.
package recipes

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
	"github.com/saferetry/saferetry/keygen"
)

// Charge sends one charge for orderID to url and returns its answer: the
// client recipe.
func Charge(ctx context.Context, url, orderID string, body []byte) (*http.Response, error) {
	// begin recipe: client
	client := &http.Client{Transport: saferetry.NewTransport(http.DefaultTransport)}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer acct_1")
	// One key per operation, the same on every retry and after a restart;
	// without it the Transport attaches a random one, kept across retries.
	req.Header.Set("Idempotency-Key", keygen.Event("order-charge", orderID))
	resp, err := client.Do(req)
	if err == nil && !saferetry.Definitive(resp, err) {
		// A final 429, 502, 503 or 504, the in-progress 409, a 202:
		// the outcome is unknown. Re-send later with the same key.
		resp.Body.Close()
		return nil, fmt.Errorf("charge %s: outcome unknown (%s)", orderID, resp.Status)
	}
	return resp, err // an error: unknown too (retry.ExhaustedError.Key)
	// end recipe: client
}

// Serve guards POST /charges with the middleware over db, an SQLite
// database, and runs its Completer and Reaper until ctx ends: the handler
// recipe. stop stops them.
func Serve(ctx context.Context, db *sql.DB) (handler http.Handler, stop func(), err error) {
	// begin recipe: handler
	store, err := sqlstore.Open(db, sqlstore.SQLite) // or sqlstore.Postgres, sqlstore.MySQL
	if err != nil {
		return nil, nil, err
	}
	if err := store.Migrate(ctx); err != nil { // creates the records' table
		return nil, nil, err
	}
	mw := idempotency.New(store, idempotency.WithPrincipal(account))
	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, ok := sqlstore.Tx(r.Context()) // commits with the stored answer
		if !ok {
			http.Error(w, "no transaction", http.StatusServiceUnavailable)
			return
		}
		if _, err := tx.ExecContext(r.Context(), "INSERT INTO charges (amount) VALUES (4200)"); err != nil {
			http.Error(w, "storage failed", http.StatusServiceUnavailable) // 5xx: key given up
			return
		}
		w.WriteHeader(http.StatusCreated) // 2xx and 4xx: stored, replayed to every retry
	})
	mux := http.NewServeMux()
	mux.Handle("POST /charges", mw.Wrap(charge))
	// The Completer finishes what a crash left unfinished; the Reaper
	// deletes records past the cleanup horizon.
	stopCompleter := mw.Completer(map[string]http.Handler{"POST /charges": charge}).Start(ctx, 0)
	stopReaper := mw.Reaper().Start(ctx, 0)
	// end recipe: handler
	return mux, func() { stopCompleter(); stopReaper() }, nil
}

// account stands in for authentication: the bearer token names the account
// that scopes each key.
func account(r *http.Request) (string, error) {
	acct, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || acct == "" {
		return "", idempotency.ErrPrincipalRefused
	}
	return acct, nil
}

// Transfer runs the transfer that message msgID asks for through mw's
// function door: the job recipe. It reports whether the transfer ran now
// (false: a redelivery, answered from the store).
func Transfer(ctx context.Context, mw *idempotency.Middleware, msgID string, body []byte,
	transfer func(ctx context.Context, run *idempotency.Run) ([]byte, error)) (ran bool, err error) {
	// begin recipe: job
	res, err := mw.Do(ctx, idempotency.Call{
		Principal: "ledger", Operation: "transfer",
		Key:     keygen.Event("transfer", msgID), // a redelivery computes the same key
		Payload: body,                            // what the fingerprint covers
	}, transfer) // transfer(ctx, run): Phase, External, Unit, DownstreamKey, as in a handler
	if errors.Is(err, idempotency.ErrInProgress) {
		return false, err // another worker has it: redeliver later
	}
	// res.Replayed: the stored output, byte for byte; transfer did not run again.
	// end recipe: job
	return err == nil && !res.Replayed, err
}

// Observers returns a client option and a server option that log, at
// Debug, what each observer function sees: the observers' signatures.
func Observers(log *slog.Logger) (saferetry.Option, idempotency.Option) {
	// begin recipe: observers
	client := saferetry.WithObserver(saferetry.Observer{
		AttemptStart: func(ctx context.Context, info saferetry.AttemptStartInfo) context.Context {
			return ctx // or a context with a span: the attempt's parent
		},
		AttemptDone: func(ctx context.Context, info saferetry.AttemptDoneInfo) {
			log.DebugContext(ctx, "attempt", "n", info.Attempt, "class", info.Decision.Class,
				"outcome", info.Outcome, "stop", info.Stop, "wait", info.Wait)
		},
		CallDone: func(ctx context.Context, info saferetry.CallDoneInfo) {},
		Poll:     func(ctx context.Context, info saferetry.PollInfo) {}, // WithFollowAccepted
	})
	event := func(ctx context.Context, e idempotency.Event) {
		log.DebugContext(ctx, "idempotency", "outcome", e.Outcome, "code", e.Code, "op", e.Op)
	}
	server := idempotency.WithObserver(idempotency.Observer{
		Claimed: event, Executed: event, Replayed: event, Refused: event, StoreCall: event,
		Unfinished: func(ctx context.Context, rec idempotency.Record, age time.Duration) {
			log.WarnContext(ctx, "unfinished record", "age", age) // rec.Scope holds the raw key
		},
		CompleterRun: func(ctx context.Context, rep idempotency.CompleterReport, err error) {},
		ReaperRun:    func(ctx context.Context, rep idempotency.ReaperReport, err error) {},
	})
	// end recipe: observers
	return client, server
}
