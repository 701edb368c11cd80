package saferetry

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/saferetry/saferetry/deadline"
	"github.com/saferetry/saferetry/internal/decide"
	"github.com/saferetry/saferetry/internal/hop"
	"github.com/saferetry/saferetry/internal/monitor"
	"github.com/saferetry/saferetry/internal/wait"
	"github.com/saferetry/saferetry/keygen"
)

// OperationState is what a server's status monitor says of an operation
// (a request sent with an idempotency key): in LookupResult, FollowError
// and PollInfo, and a snake_case label for logs and metrics.
type OperationState string

// The states of an operation.
const (
	// OperationAbsent: the server has no record of it in the caller's
	// scope (never received, given up after a failure, or past the replay
	// window): sending the request again with the same key is safe, and
	// runs it.
	OperationAbsent OperationState = "absent"
	// OperationInProgress: it runs (or waits for a resume after a crash):
	// ask again after a while; do not send it again meanwhile.
	OperationInProgress OperationState = "in_progress"
	// OperationCompleted: its response is stored: the answer is that
	// response, as a replay of the request gives it.
	OperationCompleted OperationState = "completed"
)

// WithFollowAccepted turns on following a 202 Accepted (default off): when
// the loop ends with a 202 that points to a status monitor on the request's
// own origin (Operation-Location, else Location; the idempotency
// middleware's WithAcceptAfter sends both), the Transport polls the monitor
// with GET, under the same overall deadline, with the request's headers
// (its credentials and its idempotency key; not its body, its Content-*
// fields, nor the attempt and deadline headers; WithPrepare does not run
// for a poll, so a signature per request does not reach it), and returns
// what the operation ends with: the stored response (the monitor's answer
// that carries Idempotent-Replayed: true, or any other 2xx but a 202), or
// a *FollowError. The wait before each poll is the monitor's Retry-After (1 s
// without one), at least 50 ms and at most WithMaxRetryAfter; no poll
// starts that would end after the overall deadline (with none, 30 s after
// the 202). A poll is not an attempt: it takes nothing from the retry
// budget, carries no Request-Attempt, and is seen by observers as a poll
// (Observer.Poll) and logged as one. An answer of the monitor that is
// unknown (Definitive: a 5xx, a 429, no answer) is polled again. Each poll
// is bounded by WithAttemptTimeout and the deadline, and its reads of a
// body it discards by 64 KiB and 1 s. A 202 without a monitor, or with one
// on another origin (the request's credentials go to no other), is
// returned as it is.
func WithFollowAccepted(on bool) Option {
	return func(c *config) { c.followAccepted = on }
}

// FollowError is the error of a request whose 202 Accepted the Transport
// followed (WithFollowAccepted) without getting the operation's response.
// State is what the monitor said last: OperationInProgress when the
// overall deadline or the caller's context ended the following, or the
// monitor answered what no monitor answers (Err says which), while the
// operation may still run: ask Monitor (or look the key up) later;
// OperationAbsent when the monitor said the operation is gone, as when its
// work failed and gave its key up: nothing of it was stored, and sending
// the request again with the same key is safe. Error never prints Key.
type FollowError struct {
	Monitor string         // the monitor URL, absolute
	State   OperationState // OperationInProgress or OperationAbsent
	Polls   int            // polls sent
	Key     string         // the idempotency key of the request
	Err     error          // why the following stopped; nil for OperationAbsent
}

// Error returns, for example, "saferetry: the operation is still in
// progress after 3 polls of https://api.example.com/operations/AbC: the
// overall deadline comes before the next poll".
func (e *FollowError) Error() string {
	var msg string
	switch e.State {
	case OperationAbsent:
		msg = fmt.Sprintf("saferetry: the operation ended without a stored response "+
			"(absent, after %d polls of %s): send the request again with the same key",
			e.Polls, e.Monitor)
	default:
		msg = fmt.Sprintf("saferetry: the operation is still in progress after %d polls of %s",
			e.Polls, e.Monitor)
	}
	if e.Err != nil {
		msg += ": " + e.Err.Error()
	}
	return msg
}

// Unwrap returns Err.
func (e *FollowError) Unwrap() error { return e.Err }

// PollInfo describes one poll of a 202's monitor (WithFollowAccepted): a
// read of the operation's state, which is not an attempt.
type PollInfo struct {
	Request *http.Request // the caller's request (read-only)
	Key     string        // the idempotency key, "" for none
	Monitor string        // the URL polled
	Poll    int           // 1 for the first
	// Response is the monitor's answer (status and headers only: never read
	// its body), nil when Err is set; Err's text never holds the key.
	Response *http.Response
	Err      error
	// State is what the answer says of the operation, "" when it says
	// nothing (a 503, no answer, an answer no monitor gives).
	State OperationState
	// Elapsed is the poll's duration, Total the time since the call's
	// first attempt started.
	Elapsed, Total time.Duration
	// Wait is the pause before the next poll, 0 when this poll is the last.
	Wait time.Duration
}

// The waits between polls.
const (
	defaultPollWait = time.Second           // without a valid Retry-After
	minPollWait     = 50 * time.Millisecond // a monitor asking for less does not make polls spin
)

var errFollowDeadline = errors.New("the overall deadline comes before the next poll")

// follow follows the monitor of the 202 a call ended with, when
// WithFollowAccepted is on and the 202 names one on the request's origin,
// and returns what the operation ends with (see WithFollowAccepted);
// otherwise it returns resp and err as they are.
func (c *call) follow(resp *http.Response, err error) (*http.Response, error) {
	if err != nil || !c.t.cfg.followAccepted || resp == nil ||
		resp.StatusCode != http.StatusAccepted || c.req.Header.Get(monitor.LookupHeader) != "" {
		return resp, err // a lookup's answer (Lookup) is never followed: it says in progress
	}
	mon, ok := monitor.Location(c.req.URL, resp.Header)
	if !ok {
		return resp, nil
	}
	ctx := c.req.Context()
	end := c.overall
	if end.IsZero() {
		end = time.Now().Add(decide.DefaultMaxElapsed)
	}
	pause := c.pollWait(resp.Header)
	resp.Body.Close()
	p := poller{c: c, mon: mon, header: pollHeader(c.header, ""), end: end}
	for n := 1; ; n++ {
		if !time.Now().Add(pause).Before(end) {
			return c.followed(nil, &FollowError{Monitor: mon.String(),
				State: OperationInProgress, Polls: n - 1, Key: c.key, Err: errFollowDeadline})
		}
		if err := wait.Sleep(ctx, pause); err != nil {
			return c.followed(nil, &FollowError{Monitor: mon.String(),
				State: OperationInProgress, Polls: n - 1, Key: c.key, Err: err})
		}
		r := p.poll(ctx)
		pause = 0
		var out *http.Response
		var stop error
		switch {
		case r.state == OperationCompleted:
			out = r.resp
		case r.state == OperationAbsent:
			stop = &FollowError{Monitor: mon.String(), State: OperationAbsent, Polls: n,
				Key: c.key}
		case r.state == OperationInProgress || !Definitive(r.resp, r.err):
			pause = c.pollWait(responseHeader(r.resp))
		default:
			stop = &FollowError{Monitor: mon.String(), State: OperationInProgress, Polls: n,
				Key: c.key, Err: fmt.Errorf("the monitor answered %d", r.resp.StatusCode)}
		}
		c.observePoll(ctx, r, n, pause)
		if out != nil {
			return c.followed(out, nil)
		}
		r.discard()
		if stop != nil {
			return c.followed(nil, stop)
		}
	}
}

// followed ends the following with resp or err (a *FollowError, whose
// text holds no key).
func (c *call) followed(resp *http.Response, err error) (*http.Response, error) {
	c.ended = time.Now()
	return resp, err
}

// pollWait is the wait before a poll that follows an answer with header h:
// what it asks for (askedWait), kept between minPollWait and
// WithMaxRetryAfter.
func (c *call) pollWait(h http.Header) time.Duration {
	return max(min(askedWait(h), c.t.cfg.maxRetryAfter), minPollWait)
}

// askedWait is the wait an answer of a monitor with header h asks for: its
// Retry-After (delta-seconds or an HTTP-date; 0 for a date past), else
// defaultPollWait.
func askedWait(h http.Header) time.Duration {
	v := strings.TrimSpace(h.Get("Retry-After"))
	if secs, err := strconv.ParseUint(v, 10, 32); err == nil {
		return time.Duration(secs) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil {
		return max(time.Until(t), 0)
	}
	return defaultPollWait
}

// responseHeader is resp's header, nil for no response.
func responseHeader(resp *http.Response) http.Header {
	if resp == nil {
		return nil
	}
	return resp.Header
}

// observePoll tells the Poll observers about poll n.
func (c *call) observePoll(ctx context.Context, r polled, n int, pause time.Duration) {
	if !c.t.obs.poll {
		return
	}
	now := time.Now()
	c.t.obs.donePoll(ctx, PollInfo{Request: c.req, Key: c.key, Monitor: r.url, Poll: n,
		Response: r.resp, Err: r.err, State: r.state, Elapsed: now.Sub(r.start),
		Total: now.Sub(c.start()), Wait: pause})
}

// pollHeader returns the header of a request to a monitor made for a
// request with header h: h's fields but its body's (Content-*) and the
// Transport's per-attempt ones, and, when keyName is set, but every
// spelling of the key field.
func pollHeader(h http.Header, keyName string) http.Header {
	out := make(http.Header, len(h)+2)
	for k, v := range h {
		ck := http.CanonicalHeaderKey(k)
		switch {
		case strings.HasPrefix(ck, "Content-"), ck == hop.AttemptHeader,
			ck == http.CanonicalHeaderKey(deadline.Header),
			keyName != "" && ck == keyName:
			continue
		}
		out[k] = v
	}
	return out
}

// poller sends the polls of one follow.
type poller struct {
	c      *call
	mon    *url.URL
	header http.Header
	end    time.Time // the overall deadline
}

// polled is one poll's outcome.
type polled struct {
	url    string
	resp   *http.Response
	err    error
	state  OperationState // "" for none
	start  time.Time
	cancel context.CancelCauseFunc
}

// discard drains (at most maxDrain bytes, for at most maxPeekTime) and
// closes the body of a poll's answer that is not handed over, and ends the
// poll's context.
func (r polled) discard() {
	if r.resp != nil {
		stop := time.AfterFunc(maxPeekTime, func() { r.cancel(nil) })
		_, _ = io.Copy(io.Discard, io.LimitReader(r.resp.Body, maxDrain))
		stop.Stop()
		r.resp.Body.Close()
	}
	r.cancel(nil)
}

// poll sends one GET to the monitor, bounded by WithAttemptTimeout and the
// overall deadline until its answer's headers (and the read of a problem
// code), and reads what the answer says. A completed answer's body is the
// caller's: its context ends when the body is closed.
func (p *poller) poll(ctx context.Context) polled {
	c := p.c
	r := polled{url: p.mon.String(), start: time.Now()}
	pctx, cancel := context.WithCancelCause(ctx)
	r.cancel = cancel
	until := p.end
	if d := c.t.cfg.attemptTimeout; d > 0 && r.start.Add(d).Before(until) {
		until = r.start.Add(d)
	}
	timer := time.AfterFunc(time.Until(until), func() { cancel(ErrAttemptTimeout) })
	req, err := http.NewRequestWithContext(pctx, http.MethodGet, r.url, nil)
	if err != nil {
		timer.Stop()
		r.err = err
		return r
	}
	req.Header, req.Host = p.header, c.req.Host
	r.resp, r.err = c.t.base.RoundTrip(req)
	if r.err != nil {
		if r.resp != nil {
			r.resp.Body.Close()
		}
		r.resp = nil
		timer.Stop()
		r.err = c.redact(r.err)
		return r
	}
	code := ""
	if s := r.resp.StatusCode; s == http.StatusNotFound || s == http.StatusConflict {
		peek := time.AfterFunc(maxPeekTime, func() { cancel(ErrAttemptTimeout) })
		code = peekProblemCode(r.resp)
		peek.Stop()
	}
	if !timer.Stop() || context.Cause(pctx) == ErrAttemptTimeout {
		r.discard()
		r.resp, r.err = nil, attemptTimedOut(until.Sub(r.start), nil)
		return r
	}
	switch monitor.Read(r.resp, code) {
	case monitor.Completed:
		r.state = OperationCompleted
	case monitor.InProgress:
		r.state = OperationInProgress
	case monitor.Absent:
		r.state = OperationAbsent
	default:
		if s := r.resp.StatusCode; s >= 200 && s <= 299 {
			r.state = OperationCompleted // another server's monitor: any 2xx but a 202 is done
		}
	}
	if r.state == OperationCompleted {
		r.resp.Body = &pollBody{ReadCloser: r.resp.Body, cancel: cancel}
	}
	return r
}

// pollBody is the body of a poll's answer handed to the caller: closing it
// ends the poll's context.
type pollBody struct {
	io.ReadCloser
	cancel context.CancelCauseFunc
}

func (b *pollBody) Close() error {
	err := b.ReadCloser.Close()
	b.cancel(nil)
	return err
}

// poll writes the record of a poll: Debug while the operation runs, Info
// when it completed or the monitor's answer is unknown and polled again,
// Warn when the following stops without the operation's response.
func (l logObserver) poll(ctx context.Context, p PollInfo) {
	level := slog.LevelWarn
	switch {
	case p.State == OperationInProgress && p.Wait > 0:
		level = slog.LevelDebug
	case p.State == OperationCompleted || p.Wait > 0:
		level = slog.LevelInfo
	}
	lg := l.get()
	if !lg.Enabled(ctx, level) {
		return
	}
	attrs := make([]slog.Attr, 0, 12)
	attrs = append(attrs, slog.Int("poll", p.Poll),
		slog.String("method", p.Request.Method), slog.String("host", p.Request.URL.Host),
		slog.String("path", p.Request.URL.Path), slog.String("monitor", p.Monitor),
		slog.String("state", string(p.State)))
	if p.Response != nil {
		attrs = append(attrs, slog.Int("status", p.Response.StatusCode))
	}
	if p.Err != nil {
		attrs = append(attrs, slog.String("error", p.Err.Error()))
	}
	attrs = append(attrs, slog.Duration("elapsed", p.Elapsed), slog.Duration("total", p.Total))
	if p.Wait > 0 {
		attrs = append(attrs, slog.Duration("wait", p.Wait))
	}
	if p.Key != "" {
		attrs = append(attrs, slog.String("key_digest", keygen.Digest(p.Key)))
	}
	lg.LogAttrs(ctx, level, "saferetry: poll of a 202's monitor", attrs...)
}
