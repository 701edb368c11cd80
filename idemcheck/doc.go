// Package idemcheck checks, from the outside, that an HTTP endpoint honours
// the Idempotency-Key header: that the retries of one logical request take
// effect effectively once. It sends real requests to a real endpoint (a
// staging API, or an httptest server in a go test) and reports, check by
// check, what it saw and what a retrying client of that endpoint would
// suffer. The command cmd/idemcheck runs it from a shell or CI.
//
//	rep, err := idemcheck.Run(ctx, idemcheck.Config{
//		URL:     srv.URL + "/payments",
//		Body:    []byte(`{"amount":4200}`),
//		Header: http.Header{
//			"Authorization": {"Bearer acct_1"},
//			"Content-Type":  {"application/json"},
//		},
//		Other:   http.Header{"Authorization": {"Bearer acct_2"}},
//		IDField: "id",
//	})
//	if err != nil { ... } // the target could not be checked
//	if rep.Failed() { t.Error(rep) }
//
// # The checks
//
// Each check is named in the report, with the requests and answers that
// support its result ([Check.Evidence]), and judged as it finishes
// ([Config.OnCheck]): [Pass], [Fail], [Skip] (unverified: the check could
// not run, or what it saw is no evidence either way) or [Info] (neither:
// what the target chose where the contract leaves a choice, for a person
// to judge). Before the checks, the request is sent under two fresh keys
// (the second to see whether answers identify their effect).
//
//   - replay: one key and one body twice, one after the other. The second
//     answer must equal the first (status and body): no second effect.
//   - concurrent: [Config.N] requests with one key, sent at once. Exactly one
//     effect; every other answer is the replay or a conflict (409, 425 or
//     429), never a second effect and never another failure.
//   - in_progress: the first conflict seen, its status, problem code and
//     Retry-After (info); then the request is retried after it (at most
//     three times, each wait capped by [Config.MaxRetryAfter]) and must get
//     the replay. When the concurrent check saw no conflict, up to two more
//     bursts of N requests under fresh keys look for one; skipped, so
//     unverified, when none of the three bursts saw one (the target's work
//     is quicker than a burst).
//   - mismatch: the first key with an altered body must get a 4xx, never the
//     first answer and never a new effect. The body is altered as a client
//     bug would alter it: in a JSON object the first number member (in
//     sorted order) is increased by one, or a member "idemcheck" is added;
//     a form gets a field idemcheck=1; other bodies get " idemcheck"
//     appended. The unchanged body is then sent again under the first key,
//     and must get the replay: a target that refuses every reuse of a key,
//     whatever the body, shows nothing about bodies with its 4xx, and the
//     check is skipped. Last, the altered body is sent once under a fresh
//     key, which must succeed: otherwise the 4xx may be the target's
//     validation and the check is skipped.
//   - scope: the first key and body under a second principal ([Config.Other])
//     must not get the first principal's answer: its effect, or a replay
//     (Idempotent-Replayed: true, when first executions carry none).
//     Skipped without Other, or when the target refuses the second
//     principal (401, 403).
//   - invalid_key: a key with a control character (a tab) and a key of 256
//     bytes (one over the 255 of package keygen) should each get a 4xx
//     (pass). A 5xx fails: the server failed on the key, perhaps after the
//     effect ran. A key the target accepts is retried, and for the long one
//     its 255-byte prefix is sent as a key of its own: the check fails when
//     the retry makes a second effect (the key is not enforced as sent) or
//     when the prefix gets the long key's answer (keys are cut, so two keys
//     share a scope); otherwise it is info. What it cannot see from outside:
//     whether a request refused with a 4xx ran anything first (without a
//     way to list effects, a 4xx is taken at its word).
//   - marker: whether replays carry Idempotent-Replayed, and whether the keys
//     real clients send are accepted: a key with inner spaces, and a key
//     sent as an RFC 9651 sf-string (whose bare form must then replay it).
//     Info, unless the first answer to every fresh key (but for one sent
//     again after no answer) carries Idempotent-Replayed: true, which
//     fails. One that does, when others do not, is reported: a proxy that
//     sends a request again after losing the target's answer explains it.
//   - monitor: only when the target advertises a status monitor
//     (Operation-Location, else Location, on an in-progress conflict or a
//     202 Accepted; otherwise the check is not in the report). Its URL
//     must hold no form of the key; for the completed operation (asked
//     again while it answers 202, at most three more times) it must answer
//     what the key's replay answers, status and body byte for byte; a
//     guessed identifier (the URL's last segment with a character changed)
//     must get no success, and the second principal (Other) neither the
//     operation nor another answer than a guessed identifier gets (a 403
//     where that gets 404 tells it that the operation exists). A monitor
//     on another origin is info: the checker sends its credentials to the
//     target's origin only.
//
// # What the target must allow
//
// A run makes 13 requests plus N (up to 2N more when the first burst sees
// no conflict, up to three retries after a conflict, three more when the
// target accepts malformed keys, up to eight reads and a replay when it
// advertises a monitor, and one more per transient or lost answer) and
// creates seven effects (six without Other; one more per extra burst and
// per malformed key accepted): point it at a sandbox or staging endpoint
// where that is harmless. The request ([Config.Method], [Config.Body],
// [Config.Header]) must succeed (2xx) under a fresh key every time, as a
// new logical request, since every check but replay uses a key of its
// own. A transient 502, 503 or 504 is sent again once, after its
// Retry-After (at most [Config.MaxRetryAfter]) or 100 ms, and a request
// that got no answer at once, with the same key, as a retrying client
// would; the second answer is the one judged (after no answer, it may be
// the replay of a first try that ran, which the checks allow for), and
// the evidence and the detail say so.
//
// # The checker's client sends each request once
//
// Go's net/http sends a request again by itself, once and silently, when
// the kept-alive connection it rode closes before the answer and the
// request is a GET or carries an Idempotency-Key (Request.isReplayable):
// every POST with a key qualifies. Against a provider that ignores keys,
// that re-send is a second charge that no log of the caller shows; through
// a lossy path, it made the target's replay look like the first answer to
// a fresh key. The checker's requests carry no GetBody, through which
// alone net/http rewinds a body, and a bodyless one carries its key under
// its lower-case name, which net/http does not look up: each request goes
// out once, through the default client or [Config.Transport], and the
// checker decides what is sent again. A Go client of your own that sends
// keyed requests through net/http has the same re-send: the saferetry
// Transport stops it (see its package documentation).
//
// # Telling effects apart
//
// Effects are told apart by the JSON member [Config.IDField] of success
// answers when it is set, and by the whole success body otherwise. Two
// things can go wrong, and a run guards against the first:
//
//   - The answer does not identify its effect (a 204, a constant
//     {"status":"accepted"}, or an answer that only echoes what the request
//     sent: its key, its account): a replay and a second effect look alike.
//     The run sees it when two requests under fresh keys with the same body
//     (the first two, the concurrent check's key, the marker check's keys)
//     get the same answer, or answers that differ only by the key each
//     echoes (the key as sent, its bare form, its random part, their URL
//     escapes). Every check whose result rests on telling effects apart
//     (replay, concurrent, mismatch, scope, invalid_key's replays) is then
//     skipped with that reason, never passed or failed, and in_progress
//     and marker say that what they report is unverified.
//   - The body carries something else that varies from answer to answer
//     (a timestamp, a request id): without IDField a replay then looks
//     like a second effect, and replay and concurrent fail. Set IDField.
//
// Every key is fresh, made per run, and names the check that sent it
// (idemcheck-replay-<uuid>, idemcheck-concurrent-<uuid>, ...), so the
// target can be checked again and again and its logs show which check sent
// what. Every request is bounded by [Config.Timeout], every answer read to
// at most 1 MiB, and the whole run by the context: a hung or hostile target
// cannot hang the checker. Redirects are not followed.
package idemcheck
