package bench

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	awsretry "github.com/aws/aws-sdk-go-v2/aws/retry"
	"github.com/stretchr/testify/require"
)

// The AWS contender retries what the SDK's standard retryer retries (a 503,
// with the body of a retry from GetBody) and returns anything else as it
// came (a 404), as the SDK's retry middleware does.
func TestAWSStandardTransportRetriesAsTheSDK(t *testing.T) {
	var (
		hits   atomic.Int32
		mu     sync.Mutex
		bodies []string
	)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := hits.Add(1)
		buf := make([]byte, 64)
		k, _ := r.Body.Read(buf)
		mu.Lock()
		bodies = append(bodies, string(buf[:k]))
		mu.Unlock()
		switch {
		case r.URL.Path == "/missing":
			w.WriteHeader(http.StatusNotFound)
		case n == 1:
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	}))
	defer srv.Close()
	tr := &AWSStandardTransport{Base: http.DefaultTransport, Retryer: awsretry.NewStandard()}
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader("amount=1"))
	require.NoError(t, err)
	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	mu.Lock()
	require.Equal(t, []string{"amount=1", "amount=1"}, bodies, "the 503 was retried with the whole body")
	mu.Unlock()

	hits.Store(10)
	resp, err = tr.RoundTrip(mustGet(t, srv.URL+"/missing"))
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusNotFound, resp.StatusCode)
	require.Equal(t, int32(11), hits.Load(), "a 404 is not retried")
}

func mustGet(t *testing.T, url string) *http.Request {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	return req
}
