package saferetry

import (
	"context"
	"net/http"
	"strconv"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/deadline"
)

// A caller's Request-Attempt or Request-Deadline-Ms set directly in the
// map under another spelling (req.Header["request-attempt"]) would go on
// the wire beside the Transport's own: the server would see two field
// lines, read neither, and the deadline would be lost. The Transport's
// value replaces every spelling; with its own header off, the caller's
// goes as it is.
func TestTheTransportsHeadersReplaceEverySpelling(t *testing.T) {
	for _, tc := range []struct {
		name          string
		opts          []Option
		method        string
		wantAttempt   []string // on attempts 1 and 2, "" for absent
		wantDeadlines bool     // the Transport's deadline, else the caller's
	}{
		{name: "GET", method: http.MethodGet, wantAttempt: []string{"1", "2"}, wantDeadlines: true},
		{name: "POST with an automatic key", method: http.MethodPost, wantAttempt: []string{"1", "2"},
			wantDeadlines: true},
		{name: "with a preparation", method: http.MethodGet,
			opts:        []Option{WithPrepare(func(*http.Request, int) error { return nil })},
			wantAttempt: []string{"1", "2"}, wantDeadlines: true},
		{name: "attempt header off", method: http.MethodGet, opts: []Option{WithAttemptHeader(false)},
			wantAttempt: []string{"9", "9"}, wantDeadlines: true},
		{name: "deadline header off", method: http.MethodGet, opts: []Option{WithDeadlineHeader(false)},
			wantAttempt: []string{"1", "2"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				srv := &script{statuses: []int{503, 200}}
				base, url := pipeServer(t, srv)
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				req, err := http.NewRequestWithContext(ctx, tc.method, url, http.NoBody)
				require.NoError(t, err)
				req.Header["request-attempt"] = []string{"9"}
				req.Header["REQUEST-DEADLINE-MS"] = []string{"123456"}
				before := req.Header.Clone()
				resp, err := newBubbleTransport(base, tc.opts...).RoundTrip(req)
				require.NoError(t, err)
				resp.Body.Close()
				hits := srv.Hits()
				require.Len(t, hits, 2)
				for i, h := range hits {
					assert.Equal(t, []string{tc.wantAttempt[i]}, h.header.Values(attemptHeader),
						"attempt %d: one field line", i+1)
					got := h.header.Values(deadline.Header)
					require.Len(t, got, 1, "attempt %d: one field line", i+1)
					if !tc.wantDeadlines {
						assert.Equal(t, "123456", got[0], "the caller's, as it is")
						continue
					}
					ms, err := strconv.Atoi(got[0])
					require.NoError(t, err)
					assert.LessOrEqual(t, ms, 10000, "attempt %d: the time left", i+1)
					assert.Greater(t, ms, 9000)
				}
				assert.Equal(t, before, req.Header, "the caller's request is never modified")
			})
		})
	}
}
