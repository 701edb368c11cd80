package idemcheck

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"mime"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/saferetry/saferetry/internal/resend"
	"github.com/saferetry/saferetry/internal/wait"
)

// maxAnswer bounds the body of an answer read by the checker: a larger one
// counts as no answer.
const maxAnswer = 1 << 20

// replayedHeader marks a replayed answer (the de facto name, as saferetry's
// middleware and others send it).
const replayedHeader = "Idempotent-Replayed"

// checker is one run: its settings, its client and what earlier checks saw.
type checker struct {
	cfg                    Config
	client                 *http.Client
	owned                  *http.Transport // closed at the end of the run
	target, route          string
	method, keyHeader      string
	header, other          http.Header
	n                      int
	timeout, maxRetryAfter time.Duration

	first, second answer       // the replay check's two answers
	fresh         []answer     // first answers under fresh keys, for the marker
	samples       []answer     // first answers under fresh keys, the request's body and principal
	byEffect      bool         // the running check's result rests on telling effects apart
	transients    atomic.Int32 // transient or lost answers retried during the running check
	concKey       string       // the concurrent check's key
	concEffect    string       // the one effect it saw ("" when none)
	conflicts     []answer     // conflicts seen by the concurrent check
	ipConflicts   []answer     // conflicts seen by the in_progress check
}

func (c *checker) close() {
	if c.owned != nil {
		c.owned.CloseIdleConnections()
	}
}

// answer is one request and what came back.
type answer struct {
	key       string // the key header's value as sent
	status    int
	header    http.Header
	body      []byte
	err       error // no answer: a transport error, a timeout, a body too large
	transient int   // the status of a first try that was transient (502, 503, 504) and sent again
	lost      bool  // the first try got no answer and was sent again: this may be its replay
}

// transient reports whether status is a gateway's or a server's passing
// failure (502, 503, 504): a client retries it with the same key.
func transient(status int) bool {
	return status == http.StatusBadGateway || status == http.StatusServiceUnavailable ||
		status == http.StatusGatewayTimeout
}

// firstTransientPause is the pause before sending again a request whose
// answer was transient and had no Retry-After.
const firstTransientPause = 100 * time.Millisecond

// send makes one request with the key header set to keyValue (sendOnce)
// and, when it got no answer (a connection lost on the way, a timeout) or
// a transient 502, 503 or 504, sends it once more with the same key, as a
// retrying client would: a transient answer after its Retry-After (or
// 100 ms), at most c.maxRetryAfter; no answer at once. The second answer
// is the one the check judges, and it records the first (answer.transient,
// answer.lost): after no answer, it may be the replay of a first try that
// ran.
func (c *checker) send(ctx context.Context, keyValue string, body []byte,
	header http.Header) answer {
	a := c.sendOnce(ctx, keyValue, body, header)
	switch {
	case a.err != nil && ctx.Err() == nil:
		c.transients.Add(1)
		again := c.sendOnce(ctx, keyValue, body, header)
		again.lost = true
		return again
	case a.err != nil || !transient(a.status):
		return a
	}
	pause, ok := retryAfter(a.header.Get("Retry-After"), time.Now())
	if !ok {
		pause = firstTransientPause
	}
	if wait.Sleep(ctx, min(pause, c.maxRetryAfter)) != nil {
		return a
	}
	c.transients.Add(1)
	again := c.sendOnce(ctx, keyValue, body, header)
	again.transient = a.status
	return again
}

// sendOnce makes one request with the key header set to keyValue, bounded
// by c.timeout, and reads at most maxAnswer bytes of the answer.
func (c *checker) sendOnce(ctx context.Context, keyValue string, body []byte,
	header http.Header) answer {
	a := answer{key: keyValue}
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, c.method, c.target, bytes.NewReader(body))
	if err != nil {
		a.err = err
		return a
	}
	req.Header = header.Clone()
	if h := req.Header.Get("Host"); h != "" {
		req.Host = h
		req.Header.Del("Host")
	}
	req.Header[c.keyHeader] = []string{keyValue}
	// net/http sends a request with an Idempotency-Key again by itself,
	// once, when the kept-alive connection it rode closes before the
	// answer: a request the checker never counted, whose replay would then
	// pass for a first answer. It rewinds a body only through GetBody, and
	// looks up the key of a bodyless request under its canonical name.
	req.GetBody = nil
	if req.Body == nil || req.Body == http.NoBody {
		req.Header, _ = resend.Respell(req.Header, true, nil)
	}
	resp, err := c.client.Do(req)
	if err != nil {
		a.err = err
		return a
	}
	defer resp.Body.Close()
	a.status, a.header = resp.StatusCode, resp.Header
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxAnswer+1))
	switch {
	case err != nil:
		a.err = fmt.Errorf("%d, then reading its body: %w", a.status, err)
	case len(b) > maxAnswer:
		a.err = fmt.Errorf("%d with a body over %d bytes", a.status, maxAnswer)
	}
	a.body = b
	return a
}

func success(status int) bool { return status >= 200 && status <= 299 }

// conflict reports whether status asks the client to come back later with
// the same key: 409 (in progress), 425 (too early), 429.
func conflict(status int) bool {
	return status == http.StatusConflict || status == http.StatusTooEarly ||
		status == http.StatusTooManyRequests
}

func clientError(status int) bool { return status >= 400 && status <= 499 }

// effect names the effect a success answer reports: the IDField member when
// it is set and present, otherwise the whole body.
func (c *checker) effect(a answer) string {
	if c.cfg.IDField != "" {
		if id, ok := effectID(a.body, c.cfg.IDField); ok {
			return id
		}
	}
	return "body:" + string(a.body)
}

// otherEffect reports whether IDField shows that success answers a and b
// report different effects: both carry the member, with different values.
func (c *checker) otherEffect(a, b answer) bool {
	if c.cfg.IDField == "" {
		return false
	}
	x, okA := effectID(a.body, c.cfg.IDField)
	y, okB := effectID(b.body, c.cfg.IDField)
	return okA && okB && x != y
}

// showEffect is effect for a person: the member and its value, or the body.
func (c *checker) showEffect(a answer) string {
	if c.cfg.IDField != "" {
		if id, ok := effectID(a.body, c.cfg.IDField); ok {
			return c.cfg.IDField + " " + strconv.Quote(id)
		}
	}
	return "body " + showBytes(a.body)
}

// effectID returns the JSON member at the dotted path field of body, as
// text: a string's value, a number's literal, or the JSON of anything else;
// false when body is not JSON or has no such member (or it is null).
func effectID(body []byte, field string) (string, bool) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var v any
	if dec.Decode(&v) != nil {
		return "", false
	}
	for part := range strings.SplitSeq(field, ".") {
		m, ok := v.(map[string]any)
		if !ok {
			return "", false
		}
		if v, ok = m[part]; !ok {
			return "", false
		}
	}
	switch x := v.(type) {
	case nil:
		return "", false
	case string:
		return x, true
	case json.Number:
		return x.String(), true
	default:
		b, err := json.Marshal(x)
		return string(b), err == nil
	}
}

// problemCode returns the "code" member of a JSON problem answer, or its
// "type", or "".
func problemCode(body []byte) string {
	var p struct {
		Code any `json:"code"`
		Type any `json:"type"`
	}
	if json.Unmarshal(body, &p) != nil {
		return ""
	}
	for _, v := range []any{p.Code, p.Type} {
		if s, ok := v.(string); ok && s != "" {
			return s
		}
	}
	return ""
}

// retryAfter reads a Retry-After value, delta-seconds or an HTTP-date
// (relative to now), as a wait of at least zero; false when there is none
// or it does not parse.
func retryAfter(v string, now time.Time) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, false
	}
	if n, err := strconv.ParseUint(v, 10, 63); err == nil {
		if n > uint64(time.Duration(1<<63-1)/time.Second) {
			return time.Duration(1<<63 - 1), true
		}
		return time.Duration(n) * time.Second, true
	}
	t, err := http.ParseTime(v)
	if err != nil {
		return 0, false
	}
	return max(t.Sub(now), 0), true
}

// alterBody returns body changed as a client bug would change it (see the
// mismatch check in the package documentation). The result always differs
// from body.
func alterBody(body []byte, contentType string) []byte {
	mt, _, _ := mime.ParseMediaType(contentType)
	trimmed := bytes.TrimSpace(body)
	if mt == "application/json" || strings.HasSuffix(mt, "+json") ||
		(mt == "" && len(trimmed) > 0 && trimmed[0] == '{') {
		if out, ok := alterJSON(body); ok {
			return out
		}
	}
	out := slices.Clip(body)
	if mt == "application/x-www-form-urlencoded" {
		if len(body) == 0 {
			return []byte("idemcheck=1")
		}
		return append(out, "&idemcheck=1"...)
	}
	return append(out, " idemcheck"...)
}

// alterJSON increases the first number member of a JSON object (in sorted
// order of the member names) by one, or adds a member "idemcheck"; false
// when body is not one JSON object.
func alterJSON(body []byte) ([]byte, bool) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var obj map[string]any
	if dec.Decode(&obj) != nil || obj == nil {
		return nil, false
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, false // trailing data: not one object
	}
	changed := false
	for _, k := range slices.Sorted(maps.Keys(obj)) {
		if n, ok := obj[k].(json.Number); ok {
			obj[k] = bump(n)
			changed = true
			break
		}
	}
	if !changed {
		name := "idemcheck"
		for i := 1; obj[name] != nil; i++ {
			name = "idemcheck_" + strconv.Itoa(i)
		}
		obj[name] = 1
	}
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if enc.Encode(obj) != nil {
		return nil, false
	}
	return bytes.TrimSuffix(b.Bytes(), []byte("\n")), true
}

// bump returns a number that differs from n: n+1 (n-1 for the largest
// int64), or n/2 where n+1 is n in float64.
func bump(n json.Number) json.Number {
	if i, err := strconv.ParseInt(string(n), 10, 64); err == nil {
		if i == 1<<63-1 {
			return json.Number(strconv.FormatInt(i-1, 10))
		}
		return json.Number(strconv.FormatInt(i+1, 10))
	}
	f, err := strconv.ParseFloat(string(n), 64)
	if err != nil {
		return "1"
	}
	g := f + 1
	if g == f {
		g = f / 2
	}
	return json.Number(strconv.FormatFloat(g, 'g', -1, 64))
}

// evidence is one line for a request and its answer.
func evidence(what string, a answer) string {
	switch {
	case a.transient != 0:
		what += fmt.Sprintf(" (a transient %d first, sent again)", a.transient)
	case a.lost:
		what += " (no answer first, sent again)"
	}
	if a.err != nil {
		return what + ": no answer: " + a.err.Error()
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s: %d", what, a.status)
	if code := problemCode(a.body); code != "" && !success(a.status) {
		fmt.Fprintf(&b, " %s", code)
	}
	for _, h := range []string{"Retry-After", replayedHeader} {
		if v := a.header.Values(h); len(v) > 0 {
			fmt.Fprintf(&b, ", %s: %s", h, showBytes([]byte(strings.Join(v, ", "))))
		}
	}
	fmt.Fprintf(&b, ", %s", showBytes(a.body))
	return b.String()
}

// showAnswer is an answer for a person: its status and the start of its
// body, or why there is none.
func showAnswer(a answer) string {
	if a.err != nil {
		return "no answer (" + a.err.Error() + ")"
	}
	return fmt.Sprintf("%d %s: %s", a.status, http.StatusText(a.status), showBytes(a.body))
}

// showKey is a key for a person: Go-quoted, cut after 40 bytes when longer
// than 64.
func showKey(k string) string {
	if len(k) <= 64 {
		return strconv.Quote(k)
	}
	return fmt.Sprintf("%s... (%d bytes)", strconv.Quote(k[:40]), len(k))
}

// showBytes is a body for a person: as it is when it is short, valid UTF-8
// without control characters, otherwise Go-quoted; cut after 120 bytes.
func showBytes(b []byte) string {
	b = bytes.TrimRight(b, "\r\n")
	if len(b) == 0 {
		return "(empty body)"
	}
	const limit = 120
	cut := len(b) > limit
	s := b
	if cut {
		s = b[:limit]
		for i := 0; i < utf8.UTFMax-1 && !utf8.Valid(s); i++ {
			s = s[:len(s)-1] // do not split the last character
		}
	}
	out := string(s)
	control := func(r rune) bool { return r < 0x20 || r == 0x7f }
	if !utf8.Valid(s) || strings.ContainsFunc(out, control) {
		out = strconv.Quote(out)
	}
	if cut {
		out += fmt.Sprintf("... (%d bytes)", len(b))
	}
	return out
}
