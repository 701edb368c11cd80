package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type answer struct {
	status   int
	replayed string
	code     string // the problem code of a refusal
	body     []byte
}

// TestChargeAndRetry serves the program on loopback and sends a charge, its
// retry, the same key from another account and with another body, and
// requests without a key or credentials; then checks the charges table.
func TestChargeAndRetry(t *testing.T) {
	path := filepath.Join(t.TempDir(), "payments.db")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	served := make(chan error, 1)
	go func() { served <- serve(ctx, ln, path) }()

	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	url := "http://" + ln.Addr().String() + "/charges"
	post := func(account, key, body string) answer {
		t.Helper()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		if account != "" {
			req.Header.Set("Authorization", "Bearer "+account)
		}
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := client.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		a := answer{status: resp.StatusCode, replayed: resp.Header.Get("Idempotent-Replayed"), body: b}
		if resp.Header.Get("Content-Type") == "application/problem+json" {
			var p struct{ Code string }
			require.NoError(t, json.Unmarshal(b, &p))
			a.code = p.Code
		}
		return a
	}

	first := post("acct_1", "order-42", `{"amount":4200}`)
	require.Equal(t, http.StatusCreated, first.status, "%s", first.body)
	assert.Empty(t, first.replayed)
	var charge struct {
		ID      int64
		Account string
		Amount  int64
	}
	require.NoError(t, json.Unmarshal(first.body, &charge))
	assert.Equal(t, "acct_1", charge.Account)
	assert.Equal(t, int64(4200), charge.Amount)

	retry := post("acct_1", "order-42", `{"amount":4200}`)
	assert.Equal(t, http.StatusCreated, retry.status)
	assert.Equal(t, "true", retry.replayed)
	assert.Equal(t, first.body, retry.body, "the stored answer, byte for byte")

	other := post("acct_2", "order-42", `{"amount":4200}`)
	assert.Equal(t, http.StatusCreated, other.status, "a key is scoped to its account")
	assert.Empty(t, other.replayed)

	reused := post("acct_1", "order-42", `{"amount":1}`)
	assert.Equal(t, http.StatusUnprocessableEntity, reused.status)
	assert.Equal(t, "idempotency_key_reused", reused.code)

	bad := post("acct_1", "order-43", `{"amount":0}`)
	assert.Equal(t, http.StatusBadRequest, bad.status)
	again := post("acct_1", "order-43", `{"amount":0}`)
	assert.Equal(t, http.StatusBadRequest, again.status)
	assert.Equal(t, "true", again.replayed, "a 4xx is stored and replayed")

	noKey := post("acct_1", "", `{"amount":4200}`)
	assert.Equal(t, http.StatusBadRequest, noKey.status)
	assert.Equal(t, "idempotency_key_missing", noKey.code)
	noAccount := post("", "order-44", `{"amount":4200}`)
	assert.Equal(t, http.StatusUnauthorized, noAccount.status)

	cancel()
	require.NoError(t, <-served)

	db, err := sql.Open("sqlite", sqlstore.SQLiteDSN(path))
	require.NoError(t, err)
	defer db.Close()
	rows, err := db.Query("SELECT account, amount FROM charges ORDER BY id")
	require.NoError(t, err)
	defer rows.Close()
	var got []string
	for rows.Next() {
		var account string
		var amount int64
		require.NoError(t, rows.Scan(&account, &amount))
		got = append(got, account)
		assert.Equal(t, int64(4200), amount)
	}
	require.NoError(t, rows.Err())
	assert.Equal(t, []string{"acct_1", "acct_2"}, got, "one row per account's charge, none for the retry")
}

// TestGuideQuotesTheProgram checks that the server guide's sample is this
// program, byte for byte, between its markers.
func TestGuideQuotesTheProgram(t *testing.T) {
	readme, err := os.ReadFile("../../docs/SERVER.md")
	require.NoError(t, err)
	program, err := os.ReadFile("main.go")
	require.NoError(t, err)
	const begin = "<!-- begin examples/server/main.go -->\n```go\n"
	const end = "```\n<!-- end examples/server/main.go -->\n"
	_, rest, ok := bytes.Cut(readme, []byte(begin))
	require.True(t, ok, "docs/SERVER.md has no line %q", strings.SplitN(begin, "\n", 2)[0])
	quoted, _, ok := bytes.Cut(rest, []byte(end))
	require.True(t, ok, "docs/SERVER.md has no line %q after the sample", strings.SplitN(end, "\n", 3)[1])
	assert.Equal(t, string(program), string(quoted), "docs/SERVER.md quotes examples/server/main.go")
}
