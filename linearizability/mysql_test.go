package linearizability

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log"
	"os"
	"testing"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/go-sql-driver/mysql"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// The driver logs each connection the faults break ("unexpected EOF") on
// stderr; the calls' errors are what the check reads.
func init() { _ = mysql.SetLogger(log.New(io.Discard, "", 0)) }

const mysqlSkip = "SAFERETRY_MYSQL_DSN not set: skipping the MySQL check"

// mysqlDSN returns SAFERETRY_MYSQL_DSN (a go-sql-driver/mysql DSN such as
// root@tcp(127.0.0.1:3306)/test) or skips t; with SAFERETRY_REQUIRE_MYSQL
// set (CI), a missing DSN fails t instead.
func mysqlDSN(t *testing.T) string {
	dsn := os.Getenv("SAFERETRY_MYSQL_DSN")
	if dsn == "" {
		if os.Getenv("SAFERETRY_REQUIRE_MYSQL") != "" {
			t.Fatal("SAFERETRY_MYSQL_DSN not set but SAFERETRY_REQUIRE_MYSQL is")
		}
		t.Skip(mysqlSkip)
	}
	return dsn
}

// openMySQL makes a fresh database, dropped at cleanup, and two pools on
// it: one direct, one through toxiproxy. killConn ends, with KILL, a
// connection of either pool (found by the database they use) that is
// running a statement.
func openMySQL(t *testing.T) *backend {
	cfg, err := mysql.ParseDSN(mysqlDSN(t))
	if err != nil || cfg.Net != "tcp" {
		t.Fatalf("SAFERETRY_MYSQL_DSN must be a go-sql-driver DSN over tcp: %v", err)
	}
	admin, err := sql.Open("mysql", cfg.FormatDSN())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = admin.Close() })
	name := "lin_" + randHex(6)
	if _, err := admin.ExecContext(t.Context(), "CREATE DATABASE "+name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = admin.Exec("DROP DATABASE " + name) })

	cfg.DBName = name
	shared := cfg.FormatDSN()
	s, closeDirect, err := reopenMySQL(shared)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(closeDirect)
	if err := s.(*sqlstore.Store).Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}

	proxy := startProxy(t, cfg.Addr)
	cfg.Addr = proxy.Listen
	faulty, closeFaulty, err := openSQL("mysql", cfg.FormatDSN(), sqlstore.MySQL, 16)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(closeFaulty)

	kill := func(ctx context.Context) (bool, error) {
		var id int64
		err := admin.QueryRowContext(ctx, `SELECT id FROM information_schema.PROCESSLIST
	WHERE db = ? AND command = 'Query' AND id <> CONNECTION_ID()
	ORDER BY RAND() LIMIT 1`, name).Scan(&id)
		if err == sql.ErrNoRows {
			return false, nil
		}
		if err != nil {
			return false, err
		}
		if _, err := admin.ExecContext(ctx, fmt.Sprintf("KILL %d", id)); err != nil {
			var me *mysql.MySQLError
			if errors.As(err, &me) && me.Number == 1094 { // ER_NO_SUCH_THREAD: closed meanwhile
				return false, nil
			}
			return false, err
		}
		return true, nil
	}
	return &backend{store: s, faulty: faulty, proxies: []*toxiproxy.Proxy{proxy}, killConn: kill,
		shared: shared}
}

func reopenMySQL(dsn string) (idempotency.Store, func(), error) {
	return openSQL("mysql", dsn, sqlstore.MySQL, 16)
}
