package natsconsumer_test

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
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	_ "modernc.org/sqlite"

	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// natsURL returns SAFERETRY_NATS_URL, or skips the test (fails it when
// SAFERETRY_REQUIRE_BROKERS=1, as CI sets it).
func natsURL(t testing.TB) string {
	u := os.Getenv("SAFERETRY_NATS_URL")
	if u == "" {
		if os.Getenv("SAFERETRY_REQUIRE_BROKERS") == "1" {
			t.Fatal("SAFERETRY_NATS_URL not set, and SAFERETRY_REQUIRE_BROKERS=1")
		}
		t.Skip("SAFERETRY_NATS_URL not set: set it to a NATS server with JetStream " +
			"(nats://127.0.0.1:4222) to run the broker tests")
	}
	return u
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// connect returns a JetStream context on a connection to u, closed at
// cleanup.
func connect(t testing.TB, u string) (*nats.Conn, jetstream.JetStream) {
	nc, err := nats.Connect(u, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}

// testStream creates a stream of its own (a random name and subject
// prefix), and a dead-letter stream beside it, both deleted at cleanup.
type testStream struct {
	name, subject     string // the stream, and the subject it captures
	dlName, dlSubject string
}

func newStream(t testing.TB, js jetstream.JetStream, dup time.Duration) testStream {
	id := randHex(4)
	s := testStream{name: "SR_" + id, subject: "saferetry." + id + ".orders",
		dlName: "SR_" + id + "_DEAD", dlSubject: "saferetry." + id + ".dead"}
	ctx := context.Background()
	for _, c := range []jetstream.StreamConfig{
		{Name: s.name, Subjects: []string{s.subject}, Duplicates: dup},
		{Name: s.dlName, Subjects: []string{s.dlSubject}},
	} {
		if _, err := js.CreateStream(ctx, c); err != nil {
			t.Fatal(err)
		}
		name := c.Name
		t.Cleanup(func() { _ = js.DeleteStream(context.Background(), name) })
	}
	return s
}

func (s testStream) consumer(t testing.TB, js jetstream.JetStream, ackWait time.Duration) {
	_, err := js.CreateOrUpdateConsumer(context.Background(), s.name, jetstream.ConsumerConfig{
		Durable: "workers", AckPolicy: jetstream.AckExplicitPolicy, AckWait: ackWait,
		MaxDeliver: -1, MaxAckPending: 1000,
	})
	if err != nil {
		t.Fatal(err)
	}
}

// deadLetters returns every message of the dead-letter stream.
func (s testStream) deadLetters(t testing.TB, js jetstream.JetStream) []jetstream.Msg {
	ctx := context.Background()
	st, err := js.Stream(ctx, s.dlName)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []jetstream.Msg
	if info.State.Msgs == 0 {
		return nil
	}
	c, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	for uint64(len(out)) < info.State.Msgs {
		m, err := c.Next(jetstream.FetchMaxWait(5 * time.Second))
		if err != nil {
			t.Fatalf("reading the dead letters (%d of %d): %v", len(out), info.State.Msgs, err)
		}
		out = append(out, m)
	}
	return out
}

// pending returns the consumer's messages not yet delivered and those
// delivered but not acknowledged.
func (s testStream) pending(t testing.TB, js jetstream.JetStream) (uint64, int) {
	c, err := js.Consumer(context.Background(), s.name, "workers")
	if err != nil {
		t.Fatal(err)
	}
	info, err := c.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return info.NumPending, info.NumAckPending
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
	schema := "natsconsumer_" + randHex(6)
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
		toxiproxy.NewMetricsContainer(nil)), "natsconsumer", "127.0.0.1:0", upstream)
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

// hostPort returns the host:port of a nats:// URL.
func hostPort(t testing.TB, u string) string {
	p, err := url.Parse(u)
	if err != nil || p.Host == "" {
		t.Fatalf("SAFERETRY_NATS_URL must be a nats:// URL with a host: %q", u)
	}
	return p.Host
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
