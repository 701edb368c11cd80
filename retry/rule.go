package retry

// Verdict is what a [Rule] says about one attempt's outcome.
type Verdict int8

const (
	// Keep leaves the decision to the next rule, and after the last rule
	// to the built-in allow-list.
	Keep Verdict = iota
	// Allow asks for a retry of an outcome the allow-list refuses (a 500
	// on one host, a custom error). The safety rules still apply: see
	// [Classify].
	Allow
	// Deny refuses a retry of an outcome the allow-list accepts (a 503 on
	// one path).
	Deny
)

// Rule is a user's retry policy for one kind of outcome. It sees the
// attempt's outcome (in: the request, the attempt number, the response's
// status and headers or the error) and the built-in decision d, and returns
// [Allow], [Deny] or [Keep]. A Rule must be pure and fast: it runs on every
// attempt, possibly from many goroutines at once; it must not read or close
// the response body or the request body, nor modify in.Request. A panic in
// a Rule is not recovered.
type Rule func(in Input, d Decision) Verdict

// Status returns a Rule that gives v to every response with one of the
// given status codes and [Keep] to every other outcome. For example
// Status(Deny, 503) turns off retries of 503, and Status(Allow, 500)
// retries 500 (never retried by default: it usually means a bug).
func Status(v Verdict, codes ...int) Rule {
	return func(in Input, _ Decision) Verdict {
		if in.Err != nil || in.Response == nil {
			return Keep
		}
		for _, c := range codes {
			if in.Response.StatusCode == c {
				return v
			}
		}
		return Keep
	}
}

// apply runs the rules in order (the first verdict other than Keep wins),
// then the safety rules, which no verdict lifts.
func apply(rules []Rule, in Input, d Decision) Decision {
	for _, r := range rules {
		if r == nil {
			continue
		}
		if v := r(in, d); v == Allow {
			d.Retry = true
			break
		} else if v == Deny {
			d.Retry = false
			break
		}
	}
	return safe(in, d)
}

// safe clamps d to the rules that hold whatever a Rule says: a success (a
// status below 400) and the caller's own cancellation or deadline are never
// retried, and a request that is not idempotent (no key, no idempotent
// method, or marked so by the caller) is retried only when it provably
// never reached the server.
func safe(in Input, d Decision) Decision {
	switch d.Class {
	case ClassOK, ClassCanceled, ClassCallerDeadline:
		d.Retry = false
	}
	if !in.Idempotent && !d.NeverSent {
		d.Retry = false
	}
	return d
}
