package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

const pgSkip = "SAFERETRY_PG_DSN not set: skipping PostgreSQL tests"

// unsafeFaults loses half the answers after the commit, in every episode.
const unsafeFaults = "5xx-after-commit=1@0.5,abort=1@0.5"

// shortConfig is the default configuration with a short chaos phase and a
// fixed fault schedule.
func shortConfig(t *testing.T, d time.Duration) config {
	t.Helper()
	cfg := defaultConfig()
	cfg.Duration = d
	cfg.Seed = 7
	return cfg
}

func runOK(t *testing.T, cfg config) (summary, string) {
	t.Helper()
	var out, errb bytes.Buffer
	sum, err := run(context.Background(), cfg, &out, &errb)
	require.NoError(t, err, "stderr:\n%s", errb.String())
	t.Logf("\n%s", out.String())
	return sum, out.String()
}

// requireGuarantee checks the chaos gate: real faults happened and every
// logical request had its effect effectively once.
func requireGuarantee(t *testing.T, sum summary, out string) {
	t.Helper()
	require.Positive(t, sum.Logical)
	require.Greater(t, sum.Attempts, sum.Logical, "faults made the clients retry")
	require.Positive(t, sum.Retries)
	require.Positive(t, sum.Replays, "some answers were lost after the commit and replayed")
	require.Zero(t, sum.Duplicates)
	require.Zero(t, sum.Lost)
	require.Zero(t, sum.WrongAnswers)
	require.Zero(t, sum.StrayRows)
	require.Equal(t, sum.Logical, sum.SideEffects, "one row per logical request")
	require.False(t, sum.failed())
	require.Contains(t, out, "PASS")
	require.Contains(t, out, "duplicates")
}

func TestRunWithDefaultsHoldsTheGuarantee(t *testing.T) {
	sum, out := runOK(t, shortConfig(t, 2500*time.Millisecond))
	requireGuarantee(t, sum, out)
}

func TestRunWithoutMiddlewareReportsDuplicates(t *testing.T) {
	cfg := shortConfig(t, 1500*time.Millisecond)
	cfg.Unsafe = true
	// Answers lost after the commit in every episode: retries of committed
	// writes are certain.
	mix, err := parseFaults(unsafeFaults)
	require.NoError(t, err)
	cfg.Faults = mix
	sum, out := runOK(t, cfg)
	require.Positive(t, sum.Duplicates, "retries of committed writes without de-duplication repeat them")
	require.True(t, sum.failed())
	require.Zero(t, sum.Replays, "nothing replays without the middleware")
	require.Contains(t, out, "FAIL")
}

func TestRunPostgres(t *testing.T) {
	dsn := os.Getenv("SAFERETRY_PG_DSN")
	if dsn == "" {
		t.Skip(pgSkip)
	}
	cfg := shortConfig(t, 2500*time.Millisecond)
	cfg.Store, cfg.DSN = "postgres", dsn
	sum, out := runOK(t, cfg)
	requireGuarantee(t, sum, out)
	require.Contains(t, out, "store postgres")
}

// TestRunMySQL runs the demo against the MySQL or MariaDB server of
// SAFERETRY_MYSQL_DSN, in a database of its own.
func TestRunMySQL(t *testing.T) {
	dsn := os.Getenv("SAFERETRY_MYSQL_DSN")
	if dsn == "" {
		if os.Getenv("SAFERETRY_REQUIRE_MYSQL") != "" {
			t.Fatal("SAFERETRY_MYSQL_DSN not set but SAFERETRY_REQUIRE_MYSQL is")
		}
		t.Skip("SAFERETRY_MYSQL_DSN not set: skipping MySQL tests")
	}
	cfg := shortConfig(t, 2500*time.Millisecond)
	cfg.Store, cfg.DSN = "mysql", dsn
	sum, out := runOK(t, cfg)
	requireGuarantee(t, sum, out)
	require.Contains(t, out, "store mysql")
}

func TestRunMemory(t *testing.T) {
	cfg := shortConfig(t, 2500*time.Millisecond)
	cfg.Store = "memory"
	sum, out := runOK(t, cfg)
	requireGuarantee(t, sum, out)
	require.Contains(t, out, "store memory")
}

func TestRunCanceled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := run(ctx, shortConfig(t, time.Second), &bytes.Buffer{}, &bytes.Buffer{})
	require.ErrorIs(t, err, context.Canceled)
}

func TestRunRejectsBadStore(t *testing.T) {
	cfg := shortConfig(t, time.Second)
	cfg.Store = "postgres" // no DSN
	_, err := run(context.Background(), cfg, &bytes.Buffer{}, &bytes.Buffer{})
	require.ErrorContains(t, err, "-dsn")
}

// TestBinaryExitStatus builds the command and runs it: -help exits 0, a
// bad flag 2, and a run without the middleware 1 (duplicates).
func TestBinaryExitStatus(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("go command not found")
	}
	bin := filepath.Join(t.TempDir(), "chaos")
	build := exec.Command(goBin, "build", "-o", bin, ".")
	build.Stderr = os.Stderr
	require.NoError(t, build.Run())

	status := func(args ...string) (int, string) {
		cmd := exec.Command(bin, args...)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		err := cmd.Run()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode(), out.String()
		}
		require.NoError(t, err)
		return 0, out.String()
	}
	code, out := status("-help")
	require.Equal(t, 0, code)
	require.Contains(t, out, "-faults")
	require.Contains(t, out, "-unsafe-no-idempotency\n", "the contrast mode is listed")

	code, _ = status("-faults", "bogus=1")
	require.Equal(t, 2, code)

	code, out = status("-duration", "1500ms", "-seed", "7", "-faults", unsafeFaults, "-unsafe-no-idempotency")
	require.Equal(t, 1, code, out)
	require.Contains(t, out, "FAIL")
}

func TestParseFlags(t *testing.T) {
	cfg, err := parseFlags(nil, &bytes.Buffer{})
	require.NoError(t, err)
	require.Equal(t, defaultConfig(), cfg)

	t.Setenv("SAFERETRY_PG_DSN", "postgres://example/db")
	cfg, err = parseFlags([]string{"-duration", "3s", "-clients", "4", "-faults", "reset=1", "-store", "postgres", "-unsafe-no-idempotency"}, &bytes.Buffer{})
	require.NoError(t, err)
	require.Equal(t, 3*time.Second, cfg.Duration)
	require.Equal(t, 4, cfg.Clients)
	require.Equal(t, "reset=1", cfg.Faults.String())
	require.Equal(t, "postgres://example/db", cfg.DSN)
	require.True(t, cfg.Unsafe)
	require.False(t, cfg.Keep)

	cfg, err = parseFlags([]string{"-keep"}, &bytes.Buffer{})
	require.NoError(t, err)
	require.True(t, cfg.Keep)

	var help bytes.Buffer
	_, err = parseFlags([]string{"-help"}, &help)
	require.ErrorIs(t, err, flag.ErrHelp)
	require.Contains(t, help.String(), "reset-req")
	require.Contains(t, help.String(), "  -unsafe-no-idempotency\n")
	for i, line := range strings.Split(help.String(), "\n") {
		require.Equal(t, strings.TrimRight(line, " \t"), line, "line %d of -help", i+1)
	}
	require.Contains(t, help.String(), "  -keep\n", "a boolean flag's line has its name alone")

	for _, args := range [][]string{
		{"-store", "oracle"}, {"-duration", "0s"}, {"-clients", "0"}, {"-attempt-timeout", "-1s"},
		{"-attempts", "0"}, {"-faults", "nope=1"}, {"extra"},
	} {
		_, err := parseFlags(args, &bytes.Buffer{})
		require.Error(t, err, "%q", args)
	}
	require.Equal(t, 2, realMain([]string{"-clients", "0"}, &bytes.Buffer{}, &bytes.Buffer{}))
	require.Equal(t, 0, realMain([]string{"-h"}, &bytes.Buffer{}, &bytes.Buffer{}))
}

func TestVerify(t *testing.T) {
	mk := func(key string, ok bool, id int64) *logical {
		return &logical{key: key, ok: ok, paymentID: id}
	}
	ls := []*logical{
		mk("a", true, 1),  // fine
		mk("b", true, 9),  // told 9, row is 2: wrong answer
		mk("c", false, 0), // duplicated: 3 rows
		mk("d", true, 5),  // told success, no row: phantom, lost
		mk("e", false, 0), // never took effect: lost
	}
	ls[4].reconciled = true
	rows := map[string][]int64{"a": {1}, "b": {2}, "c": {3, 4, 6}, "zz": {7}}
	var s summary
	verify(ls, rows, &s)
	require.Equal(t, int64(2), s.Duplicates)
	require.Equal(t, int64(2), s.Lost)
	require.Equal(t, int64(1), s.PhantomSuccess)
	require.Equal(t, int64(1), s.WrongAnswers)
	require.Equal(t, int64(1), s.StrayRows)
	require.Equal(t, int64(6), s.SideEffects)
	require.True(t, s.failed())

	var clean summary
	verify(ls[:1], map[string][]int64{"a": {1}}, &clean)
	require.False(t, clean.failed())
}

// The temporary SQLite file is deleted when the run ends, and the report
// says so; with -keep it stays, and the report says that instead.
func TestSQLiteTempFileKeep(t *testing.T) {
	for _, keep := range []bool{false, true} {
		be, err := openBackend(context.Background(), "sqlite", "", keep)
		require.NoError(t, err)
		path, _, _ := strings.Cut(be.where, ",")
		require.FileExists(t, path)
		be.close()
		if keep {
			require.Contains(t, be.where, "kept by -keep")
			require.FileExists(t, path)
			require.NoError(t, os.RemoveAll(filepath.Dir(path)))
		} else {
			require.Contains(t, be.where, "deleted at exit; -keep keeps it")
			require.NoFileExists(t, path)
		}
	}
}

// TestRunExportsMetrics checks -metrics: the file holds the fleet's client
// metrics and the middleware's server metrics, in the stdout exporter's
// JSON, and the executions the server counted match the run's own count.
func TestRunExportsMetrics(t *testing.T) {
	cfg := shortConfig(t, 1500*time.Millisecond)
	cfg.Metrics = filepath.Join(t.TempDir(), "metrics.json")
	sum, out := runOK(t, cfg)
	requireGuarantee(t, sum, out)

	raw, err := os.ReadFile(cfg.Metrics)
	require.NoError(t, err)
	var doc struct {
		ScopeMetrics []struct {
			Metrics []struct {
				Name string
				Data struct {
					DataPoints []struct{ Value float64 }
				}
			}
		}
	}
	require.NoError(t, json.Unmarshal(raw, &doc), "%s", raw)
	sums := map[string]float64{}
	for _, sm := range doc.ScopeMetrics {
		for _, m := range sm.Metrics {
			sums[m.Name] += 0
			for _, dp := range m.Data.DataPoints {
				sums[m.Name] += dp.Value
			}
		}
	}
	for _, name := range []string{"saferetry.client.attempts", "saferetry.client.retries",
		"saferetry.server.executions", "saferetry.server.replays", "saferetry.server.store.duration"} {
		require.Contains(t, sums, name)
	}
	require.EqualValues(t, sum.Attempts, sums["saferetry.client.attempts"], "one attempt counted per Transport attempt of the chaos phase")
	require.Positive(t, sums["saferetry.server.replays"])
}
