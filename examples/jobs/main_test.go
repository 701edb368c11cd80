//go:build unix

package main

import (
	"bufio"
	"database/sql"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency/sqlstore"
)

// The worker and the reconciliation job are each killed with SIGKILL
// between the two phases of one call, after the first committed, then run
// again to their end, then once more. The ledger holds exactly the two rows
// of every unique key (each message delivered twice moved its money once),
// the phase log shows every phase of every key started once (the killed
// call resumed after its first phase), and every message is acknowledged.
func TestKilledBetweenPhasesRunsNoPhaseTwice(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "jobs")
	out, err := exec.CommandContext(t.Context(), "go", "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "%s", out)
	db := filepath.Join(t.TempDir(), "jobs.db")
	jobs := func(args ...string) *exec.Cmd {
		return exec.Command(bin, append([]string{"-db", db, "-lease", "500ms"}, args...)...)
	}
	runs := func(args ...string) {
		t.Helper()
		out, err := jobs(args...).CombinedOutput()
		require.NoError(t, err, "jobs %v: %s", args, out)
	}
	runs("seed")
	for _, tc := range []struct{ job, key string }{{"worker", "msg-3"}, {"reconcile", "st-2"}} {
		killBetweenPhases(t, jobs("-stop-after", tc.key, tc.job), tc.key)
		runs(tc.job) // takes the killed call over once its lease ends, and resumes it
		runs(tc.job) // everything again: replays only
	}

	conn, err := sql.Open("sqlite", sqlstore.SQLiteDSN(db))
	require.NoError(t, err)
	defer conn.Close()
	keys := map[string][2]string{
		"msg-1": {"debit", "credit"}, "msg-2": {"debit", "credit"}, "msg-3": {"debit", "credit"},
		"msg-4": {"debit", "credit"}, "st-1": {"match", "post"}, "st-2": {"match", "post"},
		"st-3": {"match", "post"},
	}
	var want []string
	for key, phases := range keys {
		want = append(want, key+"/"+phases[0], key+"/"+phases[1])
	}
	slices.Sort(want)
	rows, err := conn.Query(`SELECT ref FROM ledger ORDER BY ref`)
	require.NoError(t, err)
	var effects []string
	for rows.Next() {
		var ref string
		require.NoError(t, rows.Scan(&ref))
		effects = append(effects, ref)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, want, effects, "one ledger row per phase of each unique key")

	log, err := os.ReadFile(db + ".phases")
	require.NoError(t, err)
	started := strings.Fields(strings.ReplaceAll(strings.TrimSpace(string(log)), " ", "/"))
	slices.Sort(started)
	require.Equal(t, want, started, "every phase started once")

	var unacked int
	require.NoError(t, conn.QueryRow(`SELECT COUNT(*) FROM queue WHERE acked = 0`).Scan(&unacked))
	require.Zero(t, unacked)
}

// killBetweenPhases starts cmd, waits until it says it stopped between the
// phases of key, and kills it with SIGKILL.
func killBetweenPhases(t *testing.T, cmd *exec.Cmd, key string) {
	t.Helper()
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	stopped := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if sc.Text() == "stopped between the phases of "+key {
				stopped <- true
				return
			}
		}
		stopped <- false
	}()
	select {
	case ok := <-stopped:
		require.True(t, ok, "%v ended before it stopped between the phases of %s", cmd.Args, key)
	case <-time.After(time.Minute):
		t.Fatalf("%v did not stop between the phases of %s", cmd.Args, key)
	}
	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	err = cmd.Wait()
	ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus)
	require.True(t, ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL, "exit: %v", err)
}
