package redisstore_test

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
)

// redisArgs are the test servers' flags for b's Redis and the prefix.
func redisArgs(t *testing.T, b backend, prefix string) []string {
	t.Helper()
	if b.name == "cluster" {
		return []string{"-redis", strings.Join(clusterAddrs(t), ","), "-cluster", "-prefix", prefix}
	}
	return []string{"-redis", redisAddr(t), "-prefix", prefix}
}

// TestGateCrossProcessOneKey is the cross-process concurrency gate on
// Redis and on a Redis Cluster: 4 server processes (internal/gateserver,
// built here) share one store; 400 concurrent requests with one key are
// spread over them. The handler's side effect (a counter in Redis, outside
// the store) ran once, one charge exists, and every answer is the
// in-progress conflict or a replay identical to the one success.
func TestGateCrossProcessOneKey(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs 4 server processes")
	}
	bin := buildServer(t, "gateserver")
	forEach(t, func(t *testing.T, b backend) {
		const (
			processes = 4
			requests  = 400
		)
		rdb := b.client(t)
		prefix := freshPrefix(t, rdb)
		var urls []string
		for range processes {
			urls = append(urls, startServer(t, bin, append(redisArgs(t, b, prefix), "-work", "1500ms")...).url)
		}
		type result struct {
			status   int
			body     string
			code     string
			replayed bool
			err      error
		}
		results := make([]result, requests)
		client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: requests}}
		defer client.CloseIdleConnections()
		post := func(u string) (result, error) {
			req, err := http.NewRequest(http.MethodPost, u+"/charges", strings.NewReader(`{"amount":4200,"currency":"eur"}`))
			if err != nil {
				return result{}, err
			}
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Idempotency-Key", "gate-key-1")
			resp, err := client.Do(req)
			if err != nil {
				return result{}, err
			}
			defer resp.Body.Close()
			body, err := io.ReadAll(resp.Body)
			r := result{status: resp.StatusCode, body: string(body), err: err,
				replayed: resp.Header.Get(idempotency.ReplayedHeader) == "true"}
			if resp.StatusCode == http.StatusConflict {
				r.code = problemCode(r.body)
			}
			return r, nil
		}
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range requests {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				r, err := post(urls[i%processes])
				if err != nil {
					r.err = err
				}
				results[i] = r
			}()
		}
		close(start)
		wg.Wait()

		var originals, replays, conflicts int
		success := ""
		for i, r := range results {
			require.NoError(t, r.err, "request %d", i)
			switch {
			case r.status == http.StatusCreated && !r.replayed:
				originals++
				success = r.body
			case r.status == http.StatusCreated && r.replayed:
				replays++
			case r.status == http.StatusConflict && r.code == string(idempotency.CodeInProgress):
				conflicts++
			default:
				t.Fatalf("request %d: unexpected answer %d %q", i, r.status, r.body)
			}
		}
		require.Equal(t, 1, originals, "exactly one request ran the handler")
		for i, r := range results {
			if r.replayed {
				require.Equal(t, success, r.body, "replay %d differs from the success", i)
			}
		}
		ctx := t.Context()
		require.Equal(t, "1", rdb.Get(ctx, prefix+"executions").Val(), "the handler's side effect ran once")
		require.EqualValues(t, 1, rdb.LLen(ctx, prefix+"charges").Val(), "one charge")
		t.Logf("%d requests over %d processes: 1 original, %d replays, %d in-progress conflicts",
			requests, processes, replays, conflicts)

		// A later retry on any process replays the same response.
		for _, u := range urls {
			r, err := post(u)
			require.NoError(t, err)
			require.Equal(t, http.StatusCreated, r.status)
			require.True(t, r.replayed)
			require.Equal(t, success, r.body)
		}
		require.Equal(t, "1", rdb.Get(ctx, prefix+"executions").Val())
	})
}

// problemCode extracts the "code" member of a problem+json body.
func problemCode(body string) string {
	const k = `"code":"`
	i := strings.Index(body, k)
	if i < 0 {
		return ""
	}
	rest := body[i+len(k):]
	if j := strings.IndexByte(rest, '"'); j >= 0 {
		return rest[:j]
	}
	return ""
}

// buildServer builds internal/<name> into the test's temp dir.
func buildServer(t *testing.T, name string) string {
	t.Helper()
	goBin, err := exec.LookPath("go")
	require.NoError(t, err)
	bin := filepath.Join(t.TempDir(), name)
	out, err := exec.CommandContext(t.Context(), goBin, "build", "-o", bin, "./internal/"+name).CombinedOutput()
	require.NoError(t, err, "go build: %s", out)
	return bin
}

type proc struct {
	url  string
	cmd  *exec.Cmd
	done chan struct{} // closed when the process exited
}

// startServer starts one process, waits for its "listening on" line and
// registers its kill at cleanup.
func startServer(t *testing.T, bin string, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(bin, args...)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	p := &proc{cmd: cmd, done: make(chan struct{})}
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		if sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
		_, _ = io.Copy(io.Discard, stdout)
		_ = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-p.done
	})
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	select {
	case line, ok := <-lines:
		require.True(t, ok, "%s exited before listening", bin)
		addr, found := strings.CutPrefix(line, "listening on ")
		require.True(t, found, "unexpected first line %q", line)
		p.url = "http://" + addr
	case <-ctx.Done():
		t.Fatalf("%s did not start: %v", bin, ctx.Err())
	}
	return p
}
