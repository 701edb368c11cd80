// Command jobs runs a queue worker and a reconciliation job on an embedded
// SQLite file through the function door (idempotency.Middleware.Do): work
// that is not an HTTP request goes through the same claim, phases and
// store as one, so a message delivered twice, or a job run again after a
// crash, takes effect effectively once.
//
//	go run ./examples/jobs -db /tmp/jobs.db seed       # tables, a queue with duplicates, a statement
//	go run ./examples/jobs -db /tmp/jobs.db worker     # transfers: debit, then credit
//	go run ./examples/jobs -db /tmp/jobs.db reconcile  # statement lines: match, then post
//
// Each transfer and each statement line is a call of Do with an
// event-derived key (the message ID, the line ID) and two phases, each of
// which commits its ledger row with its recovery point in one SQLite
// transaction. A worker or job killed between the two phases resumes, when
// run again, after the first: the first phase is never run twice. Every
// phase that starts appends a line to the phase log beside the database
// (<db>.phases), which the test reads. -stop-after KEY stops between the
// two phases of KEY, after the first committed, and waits there to be
// killed (the test's crash).
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	_ "modernc.org/sqlite" // the driver "sqlite"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
	"github.com/saferetry/saferetry/keygen"
)

func main() {
	path := flag.String("db", "jobs.db", "SQLite database file, created if missing")
	lease := flag.Duration("lease", 2*time.Second, "the lease of a call in progress")
	stopAfter := flag.String("stop-after", "", "stop between the two phases of this key (crash test)")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *path, flag.Arg(0), *lease, *stopAfter); err != nil {
		log.Fatal(err)
	}
}

// The work: a queue of transfers, with duplicates as a broker with
// at-least-once delivery makes them, and a bank statement to reconcile.
var (
	transfers = []message{
		{ID: "msg-1", From: "alice", To: "bob", Amount: 100},
		{ID: "msg-2", From: "bob", To: "carol", Amount: 40},
		{ID: "msg-1", From: "alice", To: "bob", Amount: 100}, // delivered twice
		{ID: "msg-3", From: "carol", To: "alice", Amount: 25},
		{ID: "msg-4", From: "alice", To: "carol", Amount: 10},
		{ID: "msg-3", From: "carol", To: "alice", Amount: 25}, // delivered twice
	}
	statement = []line{
		{ID: "st-1", Account: "alice", Amount: -3}, {ID: "st-2", Account: "bob", Amount: 7},
		{ID: "st-3", Account: "carol", Amount: -1},
	}
)

// message is a transfer on the queue.
type message struct {
	ID       string `json:"id"`
	From, To string
	Amount   int64
}

// line is a line of the bank statement that the ledger must match.
type line struct {
	ID      string `json:"id"`
	Account string
	Amount  int64
}

func run(ctx context.Context, path, cmd string, lease time.Duration, stopAfter string) error {
	db, err := sql.Open("sqlite", sqlstore.SQLiteDSN(path))
	if err != nil {
		return err
	}
	defer db.Close()
	store, err := sqlstore.Open(db, sqlstore.SQLite)
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	phases, err := os.OpenFile(path+".phases", os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer phases.Close()
	j := &jobs{db: db, phases: phases, stopAfter: stopAfter,
		// The principal names who does the work: here the job itself.
		// Waiting a little longer than a lease lets a run that finds the
		// record of a killed one in progress take it over and resume.
		mw: idempotency.New(store, idempotency.WithLease(lease),
			idempotency.WithMaxInProgressWait(2*lease),
			idempotency.WithLogger(slog.New(slog.NewTextHandler(os.Stderr,
				&slog.HandlerOptions{Level: slog.LevelWarn}))))}
	switch cmd {
	case "seed":
		return j.seed(ctx)
	case "worker":
		return j.work(ctx)
	case "reconcile":
		return j.reconcile(ctx)
	}
	return fmt.Errorf("usage: jobs [-db file] seed|worker|reconcile (got %q)", cmd)
}

// jobs holds what the worker and the reconciliation job share.
type jobs struct {
	db        *sql.DB
	mw        *idempotency.Middleware
	stopAfter string

	mu     sync.Mutex
	phases *os.File
}

// seed creates the business tables and puts the transfers on the queue.
func (j *jobs) seed(ctx context.Context) error {
	for _, stmt := range []string{
		`CREATE TABLE IF NOT EXISTS queue (seq INTEGER PRIMARY KEY, body TEXT NOT NULL,
			acked INTEGER NOT NULL DEFAULT 0)`,
		`CREATE TABLE IF NOT EXISTS ledger (id INTEGER PRIMARY KEY, ref TEXT NOT NULL,
			account TEXT NOT NULL, amount INTEGER NOT NULL)`,
	} {
		if _, err := j.db.ExecContext(ctx, stmt); err != nil {
			return err
		}
	}
	for _, m := range transfers {
		body, _ := json.Marshal(m)
		if _, err := j.db.ExecContext(ctx, `INSERT INTO queue (body) VALUES (?)`,
			string(body)); err != nil {
			return err
		}
	}
	return nil
}

// work delivers the queue's messages until none is left unacknowledged,
// as a broker with at-least-once delivery does: a message is acknowledged
// only after its call completed, so one whose worker died is delivered
// again.
func (j *jobs) work(ctx context.Context) error {
	for {
		var seq int64
		var body string
		err := j.db.QueryRowContext(ctx,
			`SELECT seq, body FROM queue WHERE acked = 0 ORDER BY seq LIMIT 1`).Scan(&seq, &body)
		if errors.Is(err, sql.ErrNoRows) {
			return nil
		}
		if err != nil {
			return err
		}
		var m message
		if err := json.Unmarshal([]byte(body), &m); err != nil {
			return err
		}
		res, err := j.mw.Do(ctx, idempotency.Call{
			Principal: "ledger-worker",
			Operation: "transfer",
			Key:       keygen.Event("transfer", m.ID), // a redelivery has the same key
			Payload:   []byte(body),
		}, j.transfer)
		if err != nil {
			return fmt.Errorf("message %s: %w", m.ID, err) // not acknowledged: redelivered
		}
		if _, err := j.db.ExecContext(ctx, `UPDATE queue SET acked = 1 WHERE seq = ?`,
			seq); err != nil {
			return err
		}
		log.Printf("message %s: %s (replayed %v)", m.ID, res.Output, res.Replayed)
	}
}

// transfer moves money: the debit, then the credit, each a phase that
// commits its ledger row with the call's recovery point.
func (j *jobs) transfer(ctx context.Context, run *idempotency.Run) ([]byte, error) {
	var m message
	if err := json.Unmarshal(run.Payload, &m); err != nil {
		return nil, fmt.Errorf("a malformed message: %w", idempotency.ErrDefinitive)
	}
	if _, err := j.phase(ctx, run, "debit", m.ID, m.From, -m.Amount); err != nil {
		return nil, err
	}
	j.maybeStop(m.ID)
	if _, err := j.phase(ctx, run, "credit", m.ID, m.To, m.Amount); err != nil {
		return nil, err
	}
	return fmt.Appendf(nil, "%d from %s to %s", m.Amount, m.From, m.To), nil
}

// reconcile matches every line of the statement against the ledger: each
// line is a call of Do, run again in full whenever the job runs, of which
// a completed one is replayed.
func (j *jobs) reconcile(ctx context.Context) error {
	for _, l := range statement {
		payload, _ := json.Marshal(l)
		res, err := j.mw.Do(ctx, idempotency.Call{
			Principal: "reconciler",
			Operation: "reconcile",
			Key:       keygen.Event("reconcile", l.ID),
			Payload:   payload,
		}, j.reconcileLine)
		if err != nil {
			return fmt.Errorf("statement line %s: %w", l.ID, err)
		}
		log.Printf("line %s: %s (replayed %v)", l.ID, res.Output, res.Replayed)
	}
	return nil
}

// reconcileLine records that a statement line was matched, then posts the
// adjustment it calls for: two phases.
func (j *jobs) reconcileLine(ctx context.Context, run *idempotency.Run) ([]byte, error) {
	var l line
	if err := json.Unmarshal(run.Payload, &l); err != nil {
		return nil, fmt.Errorf("a malformed line: %w", idempotency.ErrDefinitive)
	}
	if _, err := j.phase(ctx, run, "match", l.ID, "suspense", 0); err != nil {
		return nil, err
	}
	j.maybeStop(l.ID)
	if _, err := j.phase(ctx, run, "post", l.ID, l.Account, l.Amount); err != nil {
		return nil, err
	}
	return fmt.Appendf(nil, "adjusted %s by %d", l.Account, l.Amount), nil
}

// phase runs the phase name of ref: it logs its start, and writes one
// ledger row in the phase's transaction (sqlstore.Tx), which commits with
// the recovery point.
func (j *jobs) phase(ctx context.Context, run *idempotency.Run, name, ref, account string,
	amount int64) ([]byte, error) {
	return run.Phase(ctx, name, func(ctx context.Context) ([]byte, error) {
		if err := j.logPhase(ref, name); err != nil {
			return nil, err
		}
		tx, ok := sqlstore.Tx(ctx)
		if !ok {
			return nil, errors.New("no transaction")
		}
		_, err := tx.ExecContext(ctx,
			`INSERT INTO ledger (ref, account, amount) VALUES (?, ?, ?)`, ref+"/"+name, account,
			amount)
		return nil, err
	})
}

// logPhase appends "<ref> <phase>" to the phase log.
func (j *jobs) logPhase(ref, phase string) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	_, err := fmt.Fprintf(j.phases, "%s %s\n", ref, phase)
	return err
}

// maybeStop stops between the two phases of ref when -stop-after names it:
// it says so on stdout and waits to be killed.
func (j *jobs) maybeStop(ref string) {
	if ref != j.stopAfter {
		return
	}
	fmt.Printf("stopped between the phases of %s\n", ref)
	time.Sleep(time.Hour)
}
