package sqlstore

import (
	"errors"
	"fmt"
	"testing"

	"github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"
)

// The MySQL error numbers are read from the driver's *MySQLError wherever
// it sits in the chain: a deadlock (1213) and a lock wait timeout (1205)
// are retryable serialization errors, a duplicate key (1062) and every
// other error are not.
func TestMySQLErrorNumbers(t *testing.T) {
	for n, want := range map[uint16]bool{1213: true, 1205: true, 1062: false, 1146: false} {
		me := &mysql.MySQLError{Number: n, Message: "test"}
		for _, err := range []error{me, fmt.Errorf("driver: %w", me),
			errors.Join(errors.New("other"), me), opErr("claim", me)} {
			require.Equal(t, n, mysqlErrorNumber(err), "%v", err)
			require.Equal(t, want, isSerialization(err), "%v", err)
			require.Equal(t, want, errors.Is(opErr("complete", err), ErrSerialization), "%v", err)
		}
	}
	for _, err := range []error{nil, errors.New("Error 1213: not a MySQL error"),
		mysql.ErrInvalidConn} {
		require.Zero(t, mysqlErrorNumber(err), "%v", err)
		require.False(t, isSerialization(err), "%v", err)
	}

	calls := 0
	_, err := retried(func() (int, error) {
		calls++
		return 0, &mysql.MySQLError{Number: 1213}
	})
	require.Equal(t, statementTries, calls, "a deadlock is run again up to the bound")
	require.Equal(t, uint16(1213), mysqlErrorNumber(err))
}

// Every statement the MySQL dialect runs names its $N placeholders in the
// order of its text, each once, since MySQL's ? binds by position: the
// statements every dialect shares and MySQL's own (reset_wait takes none;
// insert_wait is PostgreSQL's alone).
func TestMySQLPlaceholdersAreInTextOrder(t *testing.T) {
	q := mysqlStatements(DefaultTable)
	require.Empty(t, q.insertWait)
	require.NotContains(t, q.resetWait, "$")
	for name, p := range q.all() {
		if name == "insert_wait" || name == "reset_wait" {
			continue
		}
		got := placeholder.FindAllString(*p, -1)
		require.NotEmpty(t, got, name)
		for i, ph := range got {
			require.Equal(t, fmt.Sprintf("$%d", i+1), ph, "%s: placeholder %d of %q", name, i+1, *p)
		}
	}
	bound := mysqlDialect{}.queries(DefaultTable)
	for name, p := range bound.all() {
		require.NotContains(t, *p, "$", name)
	}
}
