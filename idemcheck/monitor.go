package idemcheck

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/saferetry/saferetry/internal/wait"
)

// advertised returns an answer that points to a status monitor of the
// target (Operation-Location, else Location, on a conflict or a 202
// Accepted), and the monitor's URL, resolved against the target's.
func (c *checker) advertised() (answer, *url.URL, bool) {
	cands := append(append([]answer(nil), c.conflicts...), c.ipConflicts...)
	cands = append(cands, c.fresh...)
	for _, a := range cands {
		if a, mon, ok := c.advertisedBy(a); ok {
			return a, mon, true
		}
	}
	return answer{}, nil, false
}

// advertisedBy returns the monitor URL a points to, when a is a conflict or
// a 202 Accepted with Operation-Location or Location.
func (c *checker) advertisedBy(a answer) (answer, *url.URL, bool) {
	base, err := url.Parse(c.target)
	if err != nil || a.err != nil || (!conflict(a.status) && a.status != http.StatusAccepted) {
		return answer{}, nil, false
	}
	v := a.header.Get("Operation-Location")
	if v == "" {
		v = a.header.Get("Location")
	}
	ref, err := url.Parse(v)
	if v == "" || err != nil {
		return answer{}, nil, false
	}
	return a, base.ResolveReference(ref), true
}

// monitor checks the status monitor the target advertised, when it did
// ("" otherwise: the check is left out of the report): its URL holds no
// form of the key; for the completed operation it answers what a replay
// does, status and body byte for byte; it answers neither a guessed
// identifier nor another principal, and tells another principal nothing
// a guessed identifier does not.
func (c *checker) monitor(ctx context.Context) (Result, string, []string) {
	a, mon, ok := c.advertised()
	if !ok {
		return "", "", nil
	}
	ev := []string{evidence("monitor "+showBytes([]byte(mon.String()))+" advertised by key "+
		showKey(a.key), a)}
	base, _ := url.Parse(c.target)
	if mon.Scheme != base.Scheme || mon.Host != base.Host {
		return Info, "the target advertises a monitor on another origin (" + mon.Host +
			"); not checked: the checker sends its credentials to the target's origin only", ev
	}
	for _, f := range keyForms(a.key) {
		if len(f) >= 4 && strings.Contains(mon.String(), f) {
			return Fail, "anyone who sees a monitor URL (access logs, proxies, a browser's " +
				"history) learns the key, and with it can replay or block the request: the " +
				"monitor URL holds " + showKey(f), ev
		}
	}
	var mine answer
	for try := 0; try <= inProgressTries; try++ {
		mine = c.fetch(ctx, mon, c.header)
		ev = append(ev, evidence(fmt.Sprintf("GET the monitor (%d)", try+1), mine))
		if mine.err != nil || mine.status != http.StatusAccepted {
			break
		}
		pause, _ := retryAfter(mine.header.Get("Retry-After"), time.Now())
		if wait.Sleep(ctx, min(pause, c.maxRetryAfter)) != nil {
			return Fail, c.noAnswer(answer{err: context.Cause(ctx)}), ev
		}
	}
	switch {
	case mine.err != nil:
		return Fail, "a client that follows the monitor gets no answer: " + mine.err.Error(), ev
	case mine.status == http.StatusAccepted:
		return Skip, fmt.Sprintf("unverified: the monitor still says in progress after %d "+
			"tries, so its completed answer could not be compared with the replay",
			inProgressTries+1), ev
	}
	replay := c.send(ctx, a.key, c.cfg.Body, c.header)
	ev = append(ev, evidence("the key's replay", replay))
	switch {
	case replay.err != nil || !success(replay.status):
		return Skip, "unverified: the key's replay, to compare the monitor's answer with, " +
			"got " + showAnswer(replay), ev
	case mine.status != replay.status || !bytes.Equal(mine.body, replay.body):
		return Fail, fmt.Sprintf("a client that follows the monitor gets another answer than "+
			"one that retries: the monitor answered %s, the replay %s", showAnswer(mine),
			showAnswer(replay)), ev
	}
	guessed := *mon
	guessed.Path = alterLast(mon.Path)
	guessed.RawPath = ""
	g := c.fetch(ctx, &guessed, c.header)
	ev = append(ev, evidence("GET a guessed identifier "+showBytes([]byte(guessed.Path)), g))
	if g.err == nil && success(g.status) {
		return Fail, fmt.Sprintf("the monitor answers an identifier nobody was given "+
			"(%d): identifiers can be guessed", g.status), ev
	}
	if c.other != nil {
		o := c.fetch(ctx, mon, c.other)
		og := c.fetch(ctx, &guessed, c.other)
		ev = append(ev, evidence("GET the monitor as the second principal", o),
			evidence("GET the guessed identifier as the second principal", og))
		switch {
		case o.err == nil && success(o.status):
			return Fail, leak + fmt.Sprintf("the monitor gave the second principal the first "+
				"one's operation (%d)", o.status), ev
		case o.err == nil && og.err == nil && o.status != og.status:
			return Fail, fmt.Sprintf("the monitor tells another principal that the operation "+
				"exists: %d for it, %d for a guessed identifier", o.status, og.status), ev
		}
	}
	detail := fmt.Sprintf("the monitor's URL holds no form of the key; its answer for the "+
		"completed operation is the replay's, byte for byte (%d, %d bytes); a guessed "+
		"identifier gets %d", mine.status, len(mine.body), g.status)
	if c.other != nil {
		detail += "; the second principal gets the same as for a guessed identifier"
	}
	if mine.header.Get(replayedHeader) != "true" {
		detail += "; its answer carries no " + replayedHeader + ": true"
	}
	return Pass, detail, ev
}

// alterLast returns path with one character of its last segment changed.
func alterLast(path string) string {
	i := strings.LastIndexByte(path, '/') + 1
	if i >= len(path) {
		return path + "x"
	}
	b := []byte(path)
	j := i + (len(b)-i)/2
	if b[j] == 'A' {
		b[j] = 'B'
	} else {
		b[j] = 'A'
	}
	return string(b)
}

// fetch GETs u with header (no key), bounded as a request of the checker.
func (c *checker) fetch(ctx context.Context, u *url.URL, header http.Header) answer {
	var a answer
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		a.err = err
		return a
	}
	req.Header = header.Clone()
	for k := range req.Header {
		if strings.HasPrefix(http.CanonicalHeaderKey(k), "Content-") {
			delete(req.Header, k)
		}
	}
	if h := req.Header.Get("Host"); h != "" {
		req.Host = h
		req.Header.Del("Host")
	}
	resp, err := c.client.Do(req)
	if err != nil {
		a.err = err
		return a
	}
	defer resp.Body.Close()
	a.status, a.header = resp.StatusCode, resp.Header
	a.body, err = io.ReadAll(io.LimitReader(resp.Body, maxAnswer+1))
	switch {
	case err != nil:
		a.err = fmt.Errorf("%d, then reading its body: %w", a.status, err)
	case len(a.body) > maxAnswer:
		a.err = fmt.Errorf("%d with a body over %d bytes", a.status, maxAnswer)
	}
	return a
}
