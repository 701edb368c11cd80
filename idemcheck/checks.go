package idemcheck

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/saferetry/saferetry/internal/wait"
	"github.com/saferetry/saferetry/keygen"
)

// inProgressTries is how many times the in_progress check retries after a
// conflict; bursts is how many bursts of N duplicates it looks for one in,
// the concurrent check's included.
const (
	inProgressTries = 3
	bursts          = 3
)

// run sends the first request, then runs every check in order.
func (c *checker) run(ctx context.Context) (Report, error) {
	rep := Report{Target: c.target}
	c.first = c.send(ctx, newKey("replay"), c.cfg.Body, c.header)
	if a := c.first; a.err != nil {
		return rep, fmt.Errorf("idemcheck: %s could not be checked: no answer to the first "+
			"request: %w",
			c.target, a.err)
	} else if _, mon, ok := c.advertisedBy(a); ok && a.status == http.StatusAccepted {
		return rep, fmt.Errorf("idemcheck: %s could not be checked: its first answer is 202 "+
			"Accepted with a status monitor (%s): the request runs on, and its answer is at the "+
			"monitor; the checker does not follow it: check a route, or a setting of the target, "+
			"that answers before it answers 202", c.target, mon)
	} else if !success(a.status) {
		return rep, fmt.Errorf("idemcheck: %s could not be checked: its first answer is %d %s, "+
			"not a success (2xx); check the URL, method, body and headers: %s",
			c.target, a.status, http.StatusText(a.status), showBytes(a.body))
	}
	if f := c.cfg.IDField; f != "" {
		if _, ok := effectID(c.first.body, f); !ok {
			return rep, fmt.Errorf("idemcheck: %s could not be checked: its first answer has no "+
				"JSON member %q (IDField, -id-field): %s", c.target, f, showBytes(c.first.body))
		}
	}
	c.fresh = append(c.fresh, c.first)
	c.samples = append(c.samples, c.first)
	// A second request under a fresh key, with the same body and principal:
	// two answers of requests that each ran show, before any check is
	// judged on it, whether the answers identify their effect.
	probe := c.send(ctx, newKey("identity"), c.cfg.Body, c.header)
	if probe.err != nil || !success(probe.status) {
		return rep, fmt.Errorf("idemcheck: %s could not be checked: a second request under a "+
			"fresh key got %s, not a success (2xx); the request must succeed under every fresh key",
			c.target, showAnswer(probe))
	}
	c.fresh = append(c.fresh, probe)
	c.samples = append(c.samples, probe)
	checks := []struct {
		name string
		f    func(context.Context) (Result, string, []string)
	}{
		{"replay", c.replay},
		{"concurrent", c.concurrent},
		{"in_progress", c.inProgress},
		{"mismatch", c.mismatch},
		{"scope", c.scope},
		{"invalid_key", c.invalidKey},
		{"marker", c.marker},
		{"monitor", c.monitor},
	}
	for _, ch := range checks {
		c.byEffect = false
		c.transients.Store(0)
		res, detail, ev := ch.f(ctx)
		if res == "" {
			continue // not run: the target advertises no monitor
		}
		if ev == nil {
			ev = []string{} // JSON: a list, never null
		}
		check := Check{Name: ch.name, Result: res, Detail: detail, Evidence: ev}
		if c.byEffect {
			c.unverified(&check)
		}
		if n := c.transients.Load(); n > 0 {
			check.Detail += fmt.Sprintf("; %d transient answers (502, 503, 504, or none) were "+
				"sent again once, as a retrying client would (see the evidence)", n)
		}
		rep.Checks = append(rep.Checks, check)
		if c.cfg.OnCheck != nil {
			c.cfg.OnCheck(check)
		}
		if ctx.Err() != nil {
			return rep, fmt.Errorf("idemcheck: the run was cut short during the %s check: %w",
				ch.name, context.Cause(ctx))
		}
	}
	return rep, nil
}

// identifies reports whether the target's success answers tell effects
// apart, as the run has seen them so far: no two requests under fresh keys
// with the same body and principal (the first request, the second one, the
// concurrent check's key, ...) got the same answer, or the same IDField,
// once the key each was sent under is set aside (echoFree), and at least
// two did. Otherwise it says why not.
func (c *checker) identifies() (bool, string) {
	for i, a := range c.samples {
		for _, b := range c.samples[:i] {
			switch {
			case bytes.Equal(a.body, b.body) || c.effect(a) == c.effect(b):
				return false, fmt.Sprintf("two requests under fresh keys, %s and %s, got the same "+
					"%s",
					showKey(b.key), showKey(a.key), c.showEffect(a))
			case c.echoFree(a) == c.echoFree(b):
				return false, fmt.Sprintf("the answers to two requests under fresh keys, %s and "+
					"%s, differ only by the key they echo (%s): an answer that repeats what its "+
					"request sent is no evidence of one effect",
					showKey(b.key), showKey(a.key), c.showEffect(a))
			}
		}
	}
	if len(c.samples) < 2 {
		return false, "fewer than two requests under fresh keys succeeded, so nothing shows that " +
			"two effects get two different answers"
	}
	return true, ""
}

// uuidRE matches the random part of the checker's keys (keygen.Random).
var uuidRE = regexp.MustCompile(`[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}`)

// echoFree returns what a success answer says of its effect (effect), with
// every form of the key it was sent under set aside: the key as sent, its
// bare form (an sf-string's content), its random part, and their escapes in
// a URL. An answer that only repeats what its request sent (the key, the
// account, the body) gives the same value under every key.
func (c *checker) echoFree(a answer) string {
	e := c.effect(a)
	for _, f := range keyForms(a.key) {
		if f != "" {
			e = strings.ReplaceAll(e, f, "\x00key\x00")
		}
	}
	return e
}

// keyForms returns the forms of a key as it may be echoed: as sent, its
// bare form (an sf-string's content), its random part, and their escapes
// in a URL, the longest first.
func keyForms(key string) []string {
	forms := []string{key}
	if bare, err := strconv.Unquote(key); err == nil {
		forms = append(forms, bare)
	}
	forms = append(forms, uuidRE.FindAllString(key, -1)...)
	for _, f := range slices.Clone(forms) {
		forms = append(forms, url.QueryEscape(f), url.PathEscape(f))
	}
	slices.SortFunc(forms, func(x, y string) int { return len(y) - len(x) })
	return forms
}

// unverified turns the result of a check that rests on telling effects
// apart into Skip (an Info says it is unverified) when the answers do not
// identify their effect: a replay and a second effect would then look
// alike.
func (c *checker) unverified(ch *Check) {
	ok, why := c.identifies()
	if ok {
		return
	}
	what := "set IDField (-id-field) to the JSON member that names the effect"
	if c.cfg.IDField != "" {
		what = "IDField (-id-field) " + strconv.Quote(c.cfg.IDField) +
			" does not name the effect; set it to one that does"
	}
	if ch.Result == Info {
		ch.Detail += "; unverified: the answers do not identify their effect (" + why + ")"
		return
	}
	ch.Result = Skip
	ch.Detail = fmt.Sprintf("the answers do not identify their effect, so a replay and a second "+
		"effect look alike: %s; %s (seen: %s)", why, what, ch.Detail)
}

// sameEffect reports whether two success answers name the same effect: the
// same body, or the same effect (IDField).
func (c *checker) sameEffect(x, y answer) bool {
	return bytes.Equal(x.body, y.body) || c.effect(x) == c.effect(y)
}

// noAnswer is the detail of a check whose request got no answer.
func (c *checker) noAnswer(a answer) string {
	return fmt.Sprintf("a client of %s waiting for this answer times out and retries or gives up "+
		"without knowing the outcome: no answer (%v)", c.route, a.err)
}

// replay sends the first request's key and body again.
func (c *checker) replay(ctx context.Context) (Result, string, []string) {
	a := c.send(ctx, c.first.key, c.cfg.Body, c.header)
	c.second = a
	ev := []string{
		evidence("first, key "+showKey(c.first.key), c.first),
		evidence("retry, same key and body", a),
	}
	switch {
	case a.err != nil:
		return Fail, c.noAnswer(a), ev
	case a.status == c.first.status && bytes.Equal(a.body, c.first.body):
		c.byEffect = true
		return Pass, fmt.Sprintf("the retry got the first answer again (%d, %d bytes): one "+
			"effect, %s",
			a.status, len(a.body), c.showEffect(a)), ev
	case !success(a.status):
		return Fail, fmt.Sprintf("a client that retries a timed-out %s gets %d instead of the "+
			"answer to its request (the first answer was %d)",
			c.route, a.status, c.first.status), ev
	case c.cfg.IDField == "":
		return Fail, fmt.Sprintf("a client that retries a timed-out %s gets another answer than "+
			"the first: a second effect or a regenerated replay (%s; set IDField, -id-field, to "+
			"tell which)",
			c.route, differ(c.first, a)), ev
	case c.effect(a) == c.effect(c.first):
		c.byEffect = true
		return Fail, fmt.Sprintf("a client whose first answer was lost gets another answer on its "+
			"retry than the one the server sent first: the replay regenerates part of the body "+
			"(same %s; %s)",
			c.showEffect(a), differ(c.first, a)), ev
	default:
		return Fail, fmt.Sprintf("a client that retries a timed-out %s creates a second effect: "+
			"the retry with the same key and body made %s after %s",
			c.route, c.showEffect(a), c.showEffect(c.first)), ev
	}
}

// differ says where two answers differ.
func differ(x, y answer) string {
	if x.status != y.status {
		return fmt.Sprintf("status %d, then %d", x.status, y.status)
	}
	i := 0
	for i < len(x.body) && i < len(y.body) && x.body[i] == y.body[i] {
		i++
	}
	return fmt.Sprintf("the bodies differ from byte %d", i)
}

// burst sends N requests with key at once and returns their answers.
func (c *checker) burst(ctx context.Context, key string) []answer {
	answers := make([]answer, c.n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range answers {
		wg.Go(func() {
			<-start
			answers[i] = c.send(ctx, key, c.cfg.Body, c.header)
		})
	}
	close(start)
	wg.Wait()
	return answers
}

// concurrent sends N requests with one key at once.
func (c *checker) concurrent(ctx context.Context) (Result, string, []string) {
	c.concKey = newKey("concurrent")
	answers := c.burst(ctx, c.concKey)

	ev := []string{fmt.Sprintf("key %s sent %d times at once", showKey(c.concKey), c.n)}
	var effects []string // distinct, in order of first appearance
	var shown []string
	successes, others := 0, 0
	var other answer
	for i, a := range answers {
		ev = append(ev, evidence(fmt.Sprintf("duplicate %d", i+1), a))
		switch {
		case a.err == nil && success(a.status):
			if successes == 0 {
				c.samples = append(c.samples, a)
			}
			successes++
			if e := c.effect(a); !slices.Contains(effects, e) {
				effects = append(effects, e)
				shown = append(shown, c.showEffect(a))
			}
		case a.err == nil && conflict(a.status):
			c.conflicts = append(c.conflicts, a)
		default:
			if others == 0 {
				other = a
			}
			others++
		}
	}
	if len(effects) == 1 {
		c.concEffect = effects[0]
	}
	switch {
	case len(effects) > 1:
		return Fail, fmt.Sprintf("a client that retries %s while its first attempt still runs (a "+
			"timeout shorter than the work) creates a second effect: %d duplicates sent at once "+
			"made %d effects (%s)", c.route, c.n, len(effects), strings.Join(shown, ", ")), ev
	case others > 0 && other.err != nil:
		return Fail, fmt.Sprintf("a client that retries %s while its first attempt still runs "+
			"gets no answer and cannot tell whether its request took effect: %d of %d duplicates "+
			"got none (%v)",
			c.route, others, c.n, other.err), ev
	case others > 0:
		return Fail, fmt.Sprintf("a client that retries %s while its first attempt still runs "+
			"gets %d, neither the replay nor a conflict to retry, and cannot tell whether its "+
			"request took effect: %d of %d duplicates", c.route, other.status, others, c.n), ev
	case len(effects) == 0:
		return Fail, fmt.Sprintf("no client learns the outcome of %s: none of %d duplicates sent "+
			"at once succeeded, each got a conflict, the one that ran included", c.route, c.n), ev
	}
	c.byEffect = true
	return Pass, fmt.Sprintf("%d duplicates sent at once made one effect (%s): %d answered with "+
		"it (its execution and replays), %d with a conflict",
		c.n, shown[0], successes, len(c.conflicts)), ev
}

// inProgress takes the first conflict of the concurrent check, or of up to
// two more bursts of N requests under fresh keys when that one saw none,
// reports it and retries after it.
func (c *checker) inProgress(ctx context.Context) (Result, string, []string) {
	key, conflicts, effect := c.concKey, c.conflicts, c.concEffect
	var ev []string
	for b := 2; len(conflicts) == 0 && b <= bursts && ctx.Err() == nil; b++ {
		key = newKey("in_progress")
		answers := c.burst(ctx, key)
		effect = ""
		var statuses []string
		for _, a := range answers {
			switch {
			case a.err != nil:
				statuses = append(statuses, "no answer")
			case conflict(a.status):
				conflicts = append(conflicts, a)
			case success(a.status) && effect == "":
				effect = c.effect(a)
				c.samples = append(c.samples, a)
			}
			if a.err == nil {
				statuses = append(statuses, strconv.Itoa(a.status))
			}
		}
		ev = append(ev, fmt.Sprintf("burst %d: key %s sent %d times at once: %s",
			b, showKey(key), c.n,
			strings.Join(statuses, ", ")))
	}
	c.ipConflicts = conflicts
	if len(conflicts) == 0 {
		return Skip, fmt.Sprintf("unverified: no conflict seen in %d bursts of %d duplicates sent "+
			"at once (each got the effect or its replay), so what a client that retries while the "+
			"work runs gets is unknown; a target whose work takes longer shows it", bursts, c.n), ev
	}
	cf := conflicts[0]
	code := cmp.Or(problemCode(cf.body), "no problem code")
	ra := cmp.Or(cf.header.Get("Retry-After"), "none")
	seen := fmt.Sprintf("%d %s, Retry-After: %s", cf.status, code, ra)
	ev = append(ev, evidence("conflict, key "+showKey(key), cf))
	var a answer
	for try := 1; try <= inProgressTries; try++ {
		pause, _ := retryAfter(cf.header.Get("Retry-After"), time.Now())
		pause = min(pause, c.maxRetryAfter)
		if wait.Sleep(ctx, pause) != nil {
			return Fail, c.noAnswer(answer{err: context.Cause(ctx)}), ev
		}
		a = c.send(ctx, key, c.cfg.Body, c.header)
		ev = append(ev, evidence(fmt.Sprintf("retry %d after %v", try, pause), a))
		if a.err != nil || !conflict(a.status) {
			break
		}
		cf = a
	}
	switch {
	case a.err != nil:
		return Fail, c.noAnswer(a), ev
	case conflict(a.status):
		return Fail, fmt.Sprintf("a client that honours the conflict's Retry-After does not get "+
			"its answer: %s; still %d after %d retries", seen, a.status, inProgressTries), ev
	case !success(a.status):
		return Fail, fmt.Sprintf("a client that retries %s after the conflict gets %d instead of "+
			"the replay: %s", c.route, a.status, seen), ev
	case effect != "" && c.effect(a) != effect:
		return Fail, fmt.Sprintf("a client that retries %s after the conflict creates a second "+
			"effect: %s; the retry made %s", c.route, seen, c.showEffect(a)), ev
	}
	c.byEffect = true
	detail := fmt.Sprintf("conflict %s; the retry after it got the replay (%d, %s)", seen, a.status,
		c.showEffect(a))
	if ra == "none" {
		detail += "; without Retry-After a client must guess when to retry"
	}
	return Info, detail, ev
}

// mismatch sends the first key with an altered body, then the altered body
// under a fresh key.
func (c *checker) mismatch(ctx context.Context) (Result, string, []string) {
	alt := alterBody(c.cfg.Body, c.header.Get("Content-Type"))
	a := c.send(ctx, c.first.key, alt, c.header)
	ev := []string{evidence("first key, altered body "+showBytes(alt), a)}
	switch {
	case a.err != nil:
		return Fail, c.noAnswer(a), ev
	case success(a.status) && c.sameEffect(a, c.first):
		return Fail, fmt.Sprintf("a client that reuses a key for another request (a bug, or a key "+
			"derived from too little) gets the first request's answer and believes its own took "+
			"effect: the altered body got the first answer (%d, %s)", a.status, c.showEffect(a)), ev
	case success(a.status):
		return Fail, fmt.Sprintf("a key does not bind its request: a client whose retry differs "+
			"from its first attempt (a re-serialised or re-priced body) runs it again under the "+
			"same key: the altered body made %s", c.showEffect(a)), ev
	case !clientError(a.status):
		return Fail, fmt.Sprintf("a client that reuses a key for another request gets %d, retries "+
			"in vain and never learns that the key is the problem (a 4xx is expected)",
			a.status), ev
	}
	seen := fmt.Sprintf("%d %s", a.status, cmp.Or(problemCode(a.body), "without a problem code"))
	// The 4xx is about the body only if the unchanged body, under the same
	// key, still gets the first answer.
	same := c.send(ctx, c.first.key, c.cfg.Body, c.header)
	ev = append(ev, evidence("first key, unchanged body", same))
	switch {
	case same.err != nil:
		return Fail, c.noAnswer(same), ev
	case success(same.status) && c.sameEffect(same, c.first):
		c.byEffect = true
	case success(same.status):
		c.byEffect = true
		return Fail, fmt.Sprintf("a client's retry that comes after another request reused its "+
			"key runs its request again: after the altered body got %s, the unchanged body under "+
			"the same key made %s after %s", seen, c.showEffect(same), c.showEffect(c.first)), ev
	case clientError(same.status):
		return Skip, fmt.Sprintf("unverified: the target refuses every reuse of the key, whatever "+
			"the body (the unchanged body under the same key got %d %s too), so its %s to the "+
			"altered body does not show that it compares bodies; a client's retry of a completed "+
			"request gets that refusal too",
			same.status, cmp.Or(problemCode(same.body), "without a problem code"), seen), ev
	default:
		return Fail, fmt.Sprintf("a client's retry that comes after another request reused its "+
			"key gets %d instead of the first answer", same.status), ev
	}
	control := c.send(ctx, newKey("mismatch"), alt, c.header)
	ev = append(ev, evidence("altered body, fresh key "+showKey(control.key), control))
	if control.err != nil || !success(control.status) {
		return Skip, fmt.Sprintf("the target refuses the altered body under a fresh key too, so "+
			"its %s may be validation, not key reuse", seen), ev
	}
	c.fresh = append(c.fresh, control)
	return Pass, fmt.Sprintf("the first key with an altered body got %s, not the first answer, "+
		"and the unchanged body under it the replay; under a fresh key the altered body succeeded "+
		"(%d)", seen,
		control.status), ev
}

// leak starts the detail of a failed scope check.
const leak = "a caller who sends another caller's key (a guessable, event-derived one, say) gets " +
	"that caller's stored answer, and its own request never runs: "

// scope sends the first key and body under the second principal.
func (c *checker) scope(ctx context.Context) (Result, string, []string) {
	if c.other == nil {
		return Skip, "no second principal given (Other, -other)", nil
	}
	a := c.send(ctx, c.first.key, c.cfg.Body, c.other)
	ev := []string{
		evidence("first principal, key "+showKey(c.first.key), c.first),
		evidence("second principal, same key and body", a),
	}
	switch {
	case a.err != nil:
		return Fail, c.noAnswer(a), ev
	case a.status == http.StatusUnauthorized || a.status == http.StatusForbidden:
		return Skip, fmt.Sprintf("the target refused the second principal (%d): give it "+
			"credentials the target accepts", a.status), ev
	case a.header.Get(replayedHeader) == "true" && !a.lost &&
		c.first.header.Get(replayedHeader) != "true" && !c.otherEffect(a, c.first):
		// The marker tells replays apart (the first execution had none),
		// where the answers cannot. The replay of an effect IDField shows
		// to be its own is no leak: the request was sent again on the way
		// (after no answer, by the checker or a proxy), and its first try
		// ran.
		return Fail, leak + "the second principal got a replay (" + replayedHeader + ": true)", ev
	case success(a.status) && c.effect(a) == c.effect(c.first):
		c.byEffect = true
		return Fail, leak + "the second principal got the first principal's answer", ev
	case success(a.status):
		c.fresh = append(c.fresh, a)
		c.byEffect = true
		return Pass, fmt.Sprintf("the second principal's request ran in its own scope: %d, %s",
			a.status, c.showEffect(a)), ev
	case clientError(a.status):
		return Info, fmt.Sprintf("the second principal got %d %s, not the first principal's "+
			"answer; keys seem shared across principals, so one caller's key can block another's "+
			"request",
			a.status, cmp.Or(problemCode(a.body), "without a problem code")), ev
	}
	return Fail, fmt.Sprintf("a second caller whose key happens to equal another's gets %d and "+
		"retries in vain", a.status), ev
}

// invalidKey sends a key with a control character and a key of 256 bytes;
// a key the target accepts is retried, and the long one's 255-byte prefix
// is sent as a key of its own.
func (c *checker) invalidKey(ctx context.Context) (Result, string, []string) {
	tab := newKey("invalid_key") + "\tx"
	long := newKey("invalid_key")
	long += strings.Repeat("x", 256-len(long)) // one byte over the 255 of keygen.Validate
	var ev, seen []string
	res, detail := Pass, ""
	fail := func(d string, byEffect bool) {
		if res != Fail { // the first failure is the one reported
			res, detail, c.byEffect = Fail, d, byEffect
		}
	}
	for _, k := range []struct{ what, key string }{
		{"a key with a tab", tab},
		{"a key of 256 bytes", long},
	} {
		a := c.send(ctx, k.key, c.cfg.Body, c.header)
		ev = append(ev, evidence(k.what+" "+showKey(k.key), a))
		switch {
		case a.err != nil:
			fail(c.noAnswer(a), false)
			continue
		case clientError(a.status):
			seen = append(seen, fmt.Sprintf("%s: refused, %d %s", k.what, a.status,
				cmp.Or(problemCode(a.body), "without a problem code")))
			continue
		case !success(a.status):
			fail(fmt.Sprintf("a client whose key is malformed gets %d and retries with the same "+
				"key; if the effect ran before the key was checked, every retry runs it again: %s "+
				"got %d (a 4xx is expected)", a.status, k.what, a.status), false)
			continue
		}
		// Accepted: the key must still de-duplicate, as it was sent.
		if res == Pass {
			res = Info
		}
		c.samples = append(c.samples, a)
		r := c.send(ctx, k.key, c.cfg.Body, c.header)
		ev = append(ev, evidence("its retry", r))
		switch {
		case r.err != nil:
			fail(c.noAnswer(r), false)
			continue
		case success(r.status) && c.effect(r) != c.effect(a):
			fail(fmt.Sprintf("a client whose key the server accepts but does not de-duplicate "+
				"runs its request again on every retry: %s was accepted (%d, %s) and its retry "+
				"made %s",
				k.what, a.status, c.showEffect(a), c.showEffect(r)), false)
			continue
		case r.status == a.status && bytes.Equal(r.body, a.body):
			if res != Fail {
				c.byEffect = true // "the replay": told by the answers
			}
			seen = append(seen, fmt.Sprintf("%s: accepted (%d), its retry got the replay",
				k.what, a.status))
		default:
			seen = append(seen, fmt.Sprintf("%s: accepted (%d), its retry got %d", k.what, a.status,
				r.status))
		}
		if k.key != long {
			continue
		}
		prefix := long[:255]
		p := c.send(ctx, prefix, c.cfg.Body, c.header)
		ev = append(ev, evidence("its first 255 bytes as a key", p))
		switch {
		case p.err != nil:
			fail(c.noAnswer(p), false)
		case success(p.status) && (bytes.Equal(p.body, a.body) || c.effect(p) == c.effect(a)):
			fail(fmt.Sprintf("keys are cut to 255 bytes, so two keys that differ after that share "+
				"one scope: a client's request gets another's stored answer and never runs; the "+
				"255-byte prefix of %s got its answer (%d, %s)",
				k.what, p.status, c.showEffect(p)), true)
		case success(p.status):
			seen = append(seen, fmt.Sprintf("its first 255 bytes are another key (%d, %s)",
				p.status,
				c.showEffect(p)))
		default:
			seen = append(seen, fmt.Sprintf("its first 255 bytes got %d", p.status))
		}
	}
	switch res {
	case Pass:
		detail = "both malformed keys were refused with a 4xx (" + strings.Join(seen, "; ") + ")"
	case Info:
		detail = "a malformed key was accepted and de-duplicated as sent (" +
			strings.Join(seen, "; ") + "); a 4xx is safer: a client cannot tell whether such a " +
			"key is what the server enforces"
	}
	return res, detail, ev
}

// marker reports the replay marker and whether the keys real clients send
// are accepted.
func (c *checker) marker(ctx context.Context) (Result, string, []string) {
	var notes, ev []string
	if v := c.second.header.Values(replayedHeader); c.second.err == nil && len(v) > 0 {
		notes = append(notes, "the replay carried "+replayedHeader+": "+strings.Join(v, ", "))
	} else {
		notes = append(notes, "the replay carried no "+replayedHeader+" header")
	}

	// A key with inner spaces, then its retry.
	spaced := "idemcheck marker " + keygen.Random()
	notes = append(notes, c.keyForm(ctx, "a key with spaces", spaced, spaced, &ev))
	// An sf-string key, then its bare form.
	bare := newKey("marker")
	notes = append(notes, c.keyForm(ctx, "an sf-string key", `"`+bare+`"`, bare, &ev))

	// The first answers to fresh keys, but for those sent again after no
	// answer, which may be the replay of a first try that ran. A re-send on
	// the way (a proxy that sends a request again after a lost connection)
	// can make one more a replay: the check fails only when every one
	// carries the marker, as a server that marks its first executions does.
	var firsts, marked int
	for _, a := range c.fresh {
		if a.lost {
			continue
		}
		firsts++
		if a.header.Get(replayedHeader) == "true" {
			marked++
			ev = append(ev, evidence("first answer, key "+showKey(a.key), a))
		}
	}
	switch {
	case marked > 1 && marked == firsts:
		c.byEffect = false // the header tells, whatever the answers identify
		return Fail, "a client that trusts " + replayedHeader + " takes a new effect for " +
			"the replay of an earlier one (and may skip its own follow-up work): the first " +
			"answer to every fresh key carried " + replayedHeader + ": true", ev
	case marked > 0:
		notes = append(notes, fmt.Sprintf("%d of %d first answers to fresh keys carried %s: "+
			"true, which a re-send on the way (a proxy that sends a request again after a lost "+
			"connection) explains; a server that marks its first executions marks them all",
			marked, firsts, replayedHeader))
	}
	return Info, strings.Join(notes, "; "), ev
}

// keyForm sends sent as the key header's value, then retry (the same key,
// perhaps in another form), and says what happened.
func (c *checker) keyForm(ctx context.Context, what, sent, retry string, ev *[]string) string {
	a := c.send(ctx, sent, c.cfg.Body, c.header)
	*ev = append(*ev, evidence(what+" "+showKey(sent), a))
	switch {
	case a.err != nil:
		return what + ": no answer"
	case !success(a.status):
		refused := fmt.Sprintf("%s: refused (%d %s", what, a.status, problemCode(a.body))
		return strings.TrimSpace(refused) + ")"
	}
	c.fresh = append(c.fresh, a)
	c.samples = append(c.samples, a)
	again := "its retry"
	if retry != sent {
		again = "its bare form " + strconv.Quote(retry)
	}
	r := c.send(ctx, retry, c.cfg.Body, c.header)
	*ev = append(*ev, evidence(again, r))
	switch {
	case r.err != nil:
		return fmt.Sprintf("%s: accepted (%d), %s got no answer", what, a.status, again)
	case r.status == a.status && bytes.Equal(r.body, a.body):
		c.byEffect = true // "the replay": told by the answers
		return fmt.Sprintf("%s: accepted (%d), %s got the replay", what, a.status, again)
	case success(r.status) && c.effect(r) != c.effect(a):
		return fmt.Sprintf("%s: accepted (%d), but %s made another effect", what, a.status, again)
	}
	return fmt.Sprintf("%s: accepted (%d), %s got %d", what, a.status, again, r.status)
}
