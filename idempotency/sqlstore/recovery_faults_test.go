package sqlstore_test

import (
	"bufio"
	"context"
	"database/sql"
	"database/sql/driver"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"modernc.org/sqlite"
)

// pgCutter is a TCP proxy in front of PostgreSQL that, once armed, cuts the
// first connection that sends a message matching its trigger (a COMMIT,
// say): the message reaches the server, which runs it to its end (the
// proxy reads the server's answers up to its next ReadyForQuery), and then
// both sides of the connection are closed, so the client never gets the
// answer. The commit happened; the driver reports a broken connection.
type pgCutter struct {
	ln      net.Listener
	target  string
	trigger func(typ byte, body []byte) bool
	armed   atomic.Bool
	cuts    atomic.Int32

	mu    sync.Mutex
	conns []net.Conn
	wg    sync.WaitGroup
}

// newPGCutter starts a proxy to the server of dsn and returns it with dsn
// pointed at it.
func newPGCutter(t *testing.T, dsn string, trigger func(typ byte, body []byte) bool) (*pgCutter, string) {
	t.Helper()
	u, err := url.Parse(dsn)
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &pgCutter{ln: ln, target: u.Host, trigger: trigger}
	p.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.wg.Go(func() { p.serve(c) })
		}
	})
	t.Cleanup(func() {
		_ = ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			_ = c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	u.Host = ln.Addr().String()
	return p, u.String()
}

func (p *pgCutter) track(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.conns = append(p.conns, c)
}

// readMessage reads one protocol message: a type byte (none for the
// startup message) and a length that counts itself.
func readMessage(r *bufio.Reader, typed bool) (typ byte, msg []byte, err error) {
	if typed {
		if typ, err = r.ReadByte(); err != nil {
			return 0, nil, err
		}
	}
	var n [4]byte
	if _, err = io.ReadFull(r, n[:]); err != nil {
		return 0, nil, err
	}
	size := binary.BigEndian.Uint32(n[:])
	if size < 4 || size > 1<<30 {
		return 0, nil, errors.New("bad message length")
	}
	msg = make([]byte, 4+int(size)-4)
	copy(msg, n[:])
	if _, err = io.ReadFull(r, msg[4:]); err != nil {
		return 0, nil, err
	}
	if typed {
		msg = append([]byte{typ}, msg...)
	}
	return typ, msg, nil
}

func (p *pgCutter) serve(client net.Conn) {
	p.track(client)
	server, err := net.Dial("tcp", p.target)
	if err != nil {
		_ = client.Close()
		return
	}
	p.track(server)
	cut := make(chan struct{}) // closed before the trigger goes to the server
	var done sync.WaitGroup
	done.Go(func() { // client to server
		r := bufio.NewReader(client)
		for typed := false; ; typed = true {
			typ, msg, err := readMessage(r, typed)
			if err != nil {
				_ = server.Close()
				return
			}
			if typed && p.trigger(typ, msg[5:]) && p.armed.CompareAndSwap(true, false) {
				close(cut)
			}
			if _, err := server.Write(msg); err != nil {
				_ = client.Close()
				return
			}
		}
	})
	done.Go(func() { // server to client
		r := bufio.NewReader(server)
		for {
			typ, msg, err := readMessage(r, true)
			if err != nil {
				_ = client.Close()
				return
			}
			select {
			case <-cut:
				if typ == 'Z' { // the server is done with the trigger: cut
					p.cuts.Add(1)
					_ = client.Close()
					_ = server.Close()
					return
				}
				continue
			default:
			}
			if _, err := client.Write(msg); err != nil {
				_ = server.Close()
				return
			}
		}
	})
	done.Wait()
}

// commitFaults is a database/sql connector over modernc.org/sqlite whose
// next transaction Commit, once armed, commits for real and then returns an
// error, as a driver does when it loses the answer to a COMMIT that the
// database applied. No real fault of an embedded SQLite file does that on
// demand (its COMMIT is a local write that succeeds or fails as a whole), so
// the driver is wrapped.
type commitFaults struct {
	dsn   string
	armed atomic.Bool
	hits  atomic.Int32
}

var errLostCommitAnswer = errors.New("sqlite: the connection failed after COMMIT (injected)")

func (c *commitFaults) Connect(context.Context) (driver.Conn, error) {
	conn, err := (&sqlite.Driver{}).Open(c.dsn)
	if err != nil {
		return nil, err
	}
	return &faultConn{Conn: conn, c: c}, nil
}

func (c *commitFaults) Driver() driver.Driver { return &sqlite.Driver{} }

// openSQLiteCommitFaults opens a SQLite database file in the test's temp
// dir, with SQLiteDSN's settings, through commitFaults.
func openSQLiteCommitFaults(t *testing.T, dsn string) (*sql.DB, *commitFaults) {
	t.Helper()
	c := &commitFaults{dsn: dsn}
	db := sql.OpenDB(c)
	db.SetMaxOpenConns(8)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, db.Ping())
	return db, c
}

// faultConn passes every call to the SQLite connection, whose interfaces
// database/sql uses, and wraps its transactions.
type faultConn struct {
	driver.Conn
	c *commitFaults
}

func (f *faultConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	tx, err := f.Conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return &faultTx{Tx: tx, c: f.c}, nil
}

func (f *faultConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	return f.Conn.(driver.ConnPrepareContext).PrepareContext(ctx, query)
}

func (f *faultConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	return f.Conn.(driver.ExecerContext).ExecContext(ctx, query, args)
}

func (f *faultConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	return f.Conn.(driver.QueryerContext).QueryContext(ctx, query, args)
}

func (f *faultConn) Ping(ctx context.Context) error { return f.Conn.(driver.Pinger).Ping(ctx) }

func (f *faultConn) ResetSession(ctx context.Context) error {
	return f.Conn.(driver.SessionResetter).ResetSession(ctx)
}

func (f *faultConn) IsValid() bool { return f.Conn.(driver.Validator).IsValid() }

type faultTx struct {
	driver.Tx
	c *commitFaults
}

func (t *faultTx) Commit() error {
	if err := t.Tx.Commit(); err != nil {
		return err
	}
	if t.c.armed.CompareAndSwap(true, false) {
		t.c.hits.Add(1)
		return errLostCommitAnswer
	}
	return nil
}
