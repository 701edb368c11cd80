package idemcheck

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/saferetry/saferetry/keygen"
)

// The values of Config's zero fields.
const (
	defaultN             = 8
	defaultTimeout       = 10 * time.Second
	defaultMaxRetryAfter = 5 * time.Second
	defaultKeyHeader     = "Idempotency-Key"
)

// maxN bounds Config.N, so that a typo cannot open thousands of connections.
const maxN = 256

// Config says what to check and how. Only URL is required; a zero field
// takes the default its doc states. Run does not modify it (the headers
// are cloned).
type Config struct {
	// URL is the endpoint, for example "https://staging.example.com/v1/payments".
	URL string
	// Method is the request's method, sent as given (default POST).
	Method string
	// Body is the request body, sent as given on every request except the
	// mismatch check's.
	Body []byte
	// Header holds the caller's headers, sent on every request: its
	// credentials (Authorization) and the Content-Type of Body. It must not
	// set the key header.
	Header http.Header
	// Other holds the headers of a second principal (another
	// Authorization, say), which replace the same-named headers of Header
	// for the scope check. Nil skips the scope check.
	Other http.Header
	// IDField names the JSON member of a success answer that identifies the
	// effect it created, for example "id"; a dotted path ("data.id")
	// reaches into nested objects. Empty: effects are told apart by the
	// whole success body.
	IDField string
	// KeyHeader is the header that carries the key (default
	// "Idempotency-Key").
	KeyHeader string
	// N is the number of concurrent duplicates (default 8; at most 256).
	N int
	// Timeout bounds each request, from sending it to the end of its answer's
	// body (default 10 s). The context passed to Run bounds the whole run.
	Timeout time.Duration
	// MaxRetryAfter caps each wait on a Retry-After (default 5 s): before
	// the in_progress check retries after a conflict, where a longer
	// Retry-After is waited this long only and a retry that comes too early
	// counts as one of the three tries, and before a request that got a
	// transient 502, 503 or 504 is sent again.
	MaxRetryAfter time.Duration
	// OnCheck, when set, is called with each check's result as soon as the
	// check finishes, in the order of the report, on Run's goroutine (the
	// command prints each verdict this way). The result is final: Run
	// never changes it afterwards.
	OnCheck func(Check)
	// Transport sends the requests; a client certificate or a custom CA goes
	// here (for an httptest TLS server: srv.Client().Transport). Nil: a
	// transport of Run's own (net/http's defaults, proxies from the
	// environment), whose idle connections are closed when Run returns.
	Transport http.RoundTripper
}

// Result is the outcome of one check.
type Result string

// Results of a check.
const (
	// Pass: the target behaved as a retrying client needs.
	Pass Result = "pass"
	// Fail: the target did something that harms a retrying client, which
	// a lossy path to it cannot explain: a transient 502, 503 or 504 and a
	// lost answer are sent again with the same key, and judged allowing
	// for a replay, so a correct target behind a proxy that loses answers
	// fails nothing. The check's Detail says what the client would suffer.
	Fail Result = "fail"
	// Skip: unverified. The check could not run (no second principal,
	// say), or what it saw is no evidence either way (answers that do not
	// identify their effect); Detail says why.
	Skip Result = "skip"
	// Info: neither a pass nor a failure. The check reports what it saw
	// where the contract leaves a choice to the target (in_progress: the
	// conflict's status and Retry-After; marker: the replay marker and the
	// key forms accepted; invalid_key: a malformed key accepted but
	// de-duplicated; scope: keys shared across principals), for a person
	// to judge.
	Info Result = "info"
)

// Check is the result of one check, with the requests and answers that
// support it.
type Check struct {
	// Name is the check's name: replay, concurrent, in_progress, mismatch,
	// scope, invalid_key, marker or monitor (only for a target that
	// advertises a status monitor).
	Name string `json:"name"`
	// Result is the outcome.
	Result Result `json:"result"`
	// Detail is one line: for a failure, what a retrying client of the
	// target would suffer, then what was seen; otherwise what was seen.
	Detail string `json:"detail"`
	// Evidence holds one line per request of the check and its answer:
	// method, key, status, the headers that matter and the start of the
	// body.
	Evidence []string `json:"evidence"`
}

// Report is the result of a run: one Check per check, in the order of the
// package documentation. It encodes to JSON as
// {"target": ..., "checks": [{"name", "result", "detail", "evidence"}, ...]}.
type Report struct {
	// Target is the checked URL.
	Target string `json:"target"`
	// Checks holds the checks in the order they ran.
	Checks []Check `json:"checks"`
}

// String returns the check as text: a line "RESULT name: detail", then its
// evidence, one line each, indented.
func (c Check) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%-4s %s: %s\n", strings.ToUpper(string(c.Result)), c.Name, c.Detail)
	for _, e := range c.Evidence {
		fmt.Fprintf(&b, "       %s\n", e)
	}
	return b.String()
}

// Summary returns the report's last line: how many checks failed, and how
// many of each result.
func (r Report) Summary() string {
	counts := map[Result]int{}
	for _, c := range r.Checks {
		counts[c.Result]++
	}
	var parts []string
	for _, res := range []Result{Pass, Fail, Skip, Info} {
		if n := counts[res]; n > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", n, res))
		}
	}
	seen := strings.Join(parts, ", ")
	if counts[Fail] == 0 {
		return fmt.Sprintf("no check failed (%d checks: %s)", len(r.Checks), cmp.Or(seen, "none"))
	}
	return fmt.Sprintf("%d of %d checks failed (%s)", counts[Fail], len(r.Checks), seen)
}

// Failed reports whether a check failed.
func (r Report) Failed() bool {
	for _, c := range r.Checks {
		if c.Result == Fail {
			return true
		}
	}
	return false
}

// String returns the report as text: a heading, each check (Check.String)
// and the Summary line.
func (r Report) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "idemcheck %s\n", r.Target)
	for _, c := range r.Checks {
		b.WriteString(c.String())
	}
	b.WriteString(r.Summary() + "\n")
	return b.String()
}

// Run checks the endpoint cfg describes and returns the report. Its error
// is non-nil only when the target could not be checked: a Config that
// cannot be used, a target that does not answer, or a first answer that is
// not a success (2xx), such as a 404, or is a 202 Accepted that points to a
// status monitor (the checker does not follow it); the report is then
// empty. A check
// whose own request fails (a timeout, say) fails; it does not end the run.
// ctx bounds the whole run; cancelling it ends every request in flight.
// Run is safe for concurrent use (each call has its own keys).
func Run(ctx context.Context, cfg Config) (Report, error) {
	c, err := newChecker(cfg)
	if err != nil {
		return Report{}, err
	}
	defer c.close()
	return c.run(ctx)
}

func newChecker(cfg Config) (*checker, error) {
	u, err := url.Parse(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("idemcheck: bad URL: %w", err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("idemcheck: bad URL %q: want http:// or https:// and a host",
			cfg.URL)
	}
	c := &checker{
		cfg:           cfg,
		method:        cmp.Or(cfg.Method, http.MethodPost),
		keyHeader:     http.CanonicalHeaderKey(cmp.Or(cfg.KeyHeader, defaultKeyHeader)),
		n:             cfg.N,
		timeout:       cfg.Timeout,
		maxRetryAfter: cfg.MaxRetryAfter,
		header:        cfg.Header.Clone(),
	}
	if c.header == nil {
		c.header = http.Header{}
	}
	if c.n <= 0 {
		c.n = defaultN
	}
	if c.n > maxN {
		return nil, fmt.Errorf("idemcheck: N %d is above %d", cfg.N, maxN)
	}
	if c.timeout <= 0 {
		c.timeout = defaultTimeout
	}
	if c.maxRetryAfter <= 0 {
		c.maxRetryAfter = defaultMaxRetryAfter
	}
	if !validToken(c.method) {
		return nil, fmt.Errorf("idemcheck: bad method %q", c.method)
	}
	if !validToken(c.keyHeader) {
		return nil, fmt.Errorf("idemcheck: bad key header name %q", c.keyHeader)
	}
	for _, h := range []http.Header{cfg.Header, cfg.Other} {
		if err := validHeader(h); err != nil {
			return nil, err
		}
	}
	if c.header.Get(c.keyHeader) != "" || (cfg.Other != nil && cfg.Other.Get(c.keyHeader) != "") {
		return nil, errors.New("idemcheck: the headers set " + c.keyHeader +
			": the checker sets the key itself")
	}
	if cfg.Other != nil {
		c.other = c.header.Clone()
		for k, v := range cfg.Other {
			c.other[http.CanonicalHeaderKey(k)] = append([]string(nil), v...)
		}
	}
	transport := cfg.Transport
	if transport == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.MaxIdleConnsPerHost = c.n
		c.owned = t
		transport = t
	}
	c.client = &http.Client{
		Transport: transport,
		CheckRedirect: func(*http.Request, []*http.Request) error {
			return http.ErrUseLastResponse
		},
	}
	c.target = u.String()
	c.route = c.method + " " + cmp.Or(u.EscapedPath(), "/")
	return c, nil
}

// validToken reports whether s is an RFC 9110 token (a method or a header
// field name).
func validToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0:
		default:
			return false
		}
	}
	return true
}

// validHeader checks that h can be sent: token names, and values without
// control characters other than tab.
func validHeader(h http.Header) error {
	for name, vals := range h {
		if !validToken(name) {
			return fmt.Errorf("idemcheck: bad header name %q", name)
		}
		for _, v := range vals {
			bad := func(r rune) bool { return (r < 0x20 && r != '\t') || r == 0x7f }
			if strings.ContainsFunc(v, bad) {
				return fmt.Errorf("idemcheck: header %s has a control character", name)
			}
		}
	}
	return nil
}

// newKey returns a fresh key that names the check sending it.
func newKey(check string) string {
	return "idemcheck-" + check + "-" + keygen.Random()
}
