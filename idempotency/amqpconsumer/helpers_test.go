package amqpconsumer_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	_ "github.com/jackc/pgx/v5/stdlib"
	amqp "github.com/rabbitmq/amqp091-go"
	_ "modernc.org/sqlite"

	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// amqpURL returns SAFERETRY_AMQP_URL, or skips the test (fails it when
// SAFERETRY_REQUIRE_BROKERS=1, as CI sets it).
func amqpURL(t testing.TB) string {
	u := os.Getenv("SAFERETRY_AMQP_URL")
	if u == "" {
		if os.Getenv("SAFERETRY_REQUIRE_BROKERS") == "1" {
			t.Fatal("SAFERETRY_AMQP_URL not set, and SAFERETRY_REQUIRE_BROKERS=1")
		}
		t.Skip("SAFERETRY_AMQP_URL not set: set it to a RabbitMQ server " +
			"(amqp://guest:guest@127.0.0.1:5672/) to run the broker tests")
	}
	return u
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// dial returns a channel on a connection to u, both closed at cleanup.
func dial(t testing.TB, u string) (*amqp.Connection, *amqp.Channel) {
	conn, err := amqp.Dial(u)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	return conn, ch
}

// testQueue is a quorum queue of its own (a random name) whose rejected
// messages go, through a fanout exchange, to a dead-letter queue; all
// deleted at cleanup, with the delay queue Consume declares.
type testQueue struct {
	name, dlx, dead string
}

func newQueue(t testing.TB, u string) testQueue {
	id := randHex(4)
	q := testQueue{name: "saferetry-" + id, dlx: "saferetry-" + id + ".dlx",
		dead: "saferetry-" + id + ".dead"}
	_, ch := dial(t, u)
	if err := ch.ExchangeDeclare(q.dlx, "fanout", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	for _, d := range []struct {
		name string
		args amqp.Table
	}{
		{q.dead, nil},
		{q.name, amqp.Table{"x-queue-type": "quorum", "x-dead-letter-exchange": q.dlx}},
	} {
		if _, err := ch.QueueDeclare(d.name, true, false, false, false, d.args); err != nil {
			t.Fatal(err)
		}
	}
	if err := ch.QueueBind(q.dead, "", q.dlx, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn, err := amqp.Dial(u)
		if err != nil {
			return
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			return
		}
		for _, name := range []string{q.name, q.dead, q.name + ".delay"} {
			_, _ = ch.QueueDelete(name, false, false, false)
		}
		_ = ch.ExchangeDelete(q.dlx, false, false)
	})
	return q
}

// ready returns how many messages wait in queue (unacknowledged ones not
// counted).
func ready(t testing.TB, ch *amqp.Channel, queue string) int {
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return q.Messages
}

// deadLetters takes every message of the dead-letter queue.
func (q testQueue) deadLetters(t testing.TB, ch *amqp.Channel) []amqp.Delivery {
	var out []amqp.Delivery
	for {
		d, ok, err := ch.Get(q.dead, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			return out
		}
		out = append(out, d)
	}
}

// testDB is a database for the store and the effects: a fresh PostgreSQL
// schema when SAFERETRY_PG_DSN is set (and pg is asked for), else a SQLite
// file in a temporary directory.
type testDB struct {
	driver, dsn string
	dialect     sqlstore.Dialect
}

func newDB(t testing.TB, postgres bool) testDB {
	if !postgres {
		return testDB{driver: "sqlite", dialect: sqlstore.SQLite,
			dsn: sqlstore.SQLiteDSN(filepath.Join(t.TempDir(), "consumer.db"))}
	}
	dsn := os.Getenv("SAFERETRY_PG_DSN")
	if dsn == "" {
		if os.Getenv("SAFERETRY_REQUIRE_PG") == "1" {
			t.Fatal("SAFERETRY_PG_DSN not set, and SAFERETRY_REQUIRE_PG=1")
		}
		t.Skip("SAFERETRY_PG_DSN not set: the PostgreSQL case needs it")
	}
	admin, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = admin.Close() })
	schema := "amqpconsumer_" + randHex(6)
	if _, err := admin.Exec("CREATE SCHEMA " + schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = admin.Exec("DROP SCHEMA " + schema + " CASCADE") })
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return testDB{driver: "pgx", dialect: sqlstore.Postgres, dsn: u.String()}
}

// openStore opens the database and its store, creating the store's table
// and the effects table (from one process) when migrate is set.
func (d testDB) openStore(ctx context.Context, migrate bool) (*sql.DB, *sqlstore.Store, error) {
	db, err := sql.Open(d.driver, d.dsn)
	if err != nil {
		return nil, nil, err
	}
	store, err := sqlstore.Open(db, d.dialect)
	if err == nil && migrate {
		err = store.Migrate(ctx)
	}
	if err == nil && migrate {
		ddl := `CREATE TABLE IF NOT EXISTS effects (id BIGSERIAL PRIMARY KEY,
			business_key TEXT NOT NULL, pid INTEGER NOT NULL)`
		if d.dialect == sqlstore.SQLite {
			ddl = `CREATE TABLE IF NOT EXISTS effects (id INTEGER PRIMARY KEY,
			business_key TEXT NOT NULL, pid INTEGER NOT NULL)`
		}
		_, err = db.ExecContext(ctx, ddl)
	}
	if err != nil {
		_ = db.Close()
		return nil, nil, err
	}
	return db, store, nil
}

// effect writes one effect of key in the handler's transaction.
func effect(ctx context.Context, key string) error {
	tx, ok := sqlstore.Tx(ctx)
	if !ok {
		return errors.New("no transaction")
	}
	_, err := tx.ExecContext(ctx, "INSERT INTO effects (business_key, pid) VALUES ($1, $2)",
		key, os.Getpid())
	return err
}

// effects returns how many effects each business key had.
func effects(t testing.TB, db *sql.DB) map[string]int {
	rows, err := db.Query("SELECT business_key, count(*) FROM effects GROUP BY business_key")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var k string
		var n int
		if err := rows.Scan(&k, &n); err != nil {
			t.Fatal(err)
		}
		out[k] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// startProxy starts an in-process toxiproxy from a loopback port to
// upstream (host:port), stopped at cleanup.
func startProxy(t testing.TB, upstream string) *toxiproxy.Proxy {
	p := toxiproxy.NewProxy(withDiscardLogger(toxiproxy.NewServer,
		toxiproxy.NewMetricsContainer(nil)), "amqpconsumer", "127.0.0.1:0", upstream)
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Stop)
	return p
}

// withDiscardLogger calls toxiproxy.NewServer with a zerolog.Logger that
// discards (go.mod lists zerolog only as an indirect dependency: the
// logger's type comes from NewServer's signature).
func withDiscardLogger[M any, L interface{ Output(io.Writer) L }](
	newServer func(M, L) *toxiproxy.ApiServer, m M) *toxiproxy.ApiServer {
	var zero L
	return newServer(m, zero.Output(io.Discard))
}

// viaProxy returns the amqp:// URL u with its host replaced by addr,
// and u's host:port.
func viaProxy(t testing.TB, u, addr string) (string, string) {
	p, err := url.Parse(u)
	if err != nil || p.Host == "" {
		t.Fatalf("SAFERETRY_AMQP_URL must be an amqp:// URL with a host: %q", u)
	}
	host := p.Host
	p.Host = addr
	return p.String(), host
}

// eventually polls cond every 50 ms until it holds or d passes, and then
// fails the test.
func eventually(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	if !within(d, cond) {
		t.Fatalf("after %v: not yet %s", d, what)
	}
}

// within polls cond every 50 ms until it holds (true) or d passes (false).
func within(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(50 * time.Millisecond)
	}
	return true
}

func dialectOf(driver string) sqlstore.Dialect {
	if driver == "pgx" {
		return sqlstore.Postgres
	}
	return sqlstore.SQLite
}
