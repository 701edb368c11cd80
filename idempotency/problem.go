package idempotency

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// Problem codes: the "code" member of every problem+json body the middleware
// writes. They are stable; clients match on them, never on titles.
const (
	// CodeInProgress (409, Retry-After: 1): another request with the same key
	// and fingerprint is running. Retry with the same key. Equal to
	// retry.ProblemInProgress.
	CodeInProgress = "idempotency_request_in_progress"
	// CodeKeyReused (422 by default, 409 with WithMismatchStatus): the key was
	// used for a different request (another fingerprint). Do not retry; use a
	// new key for a new request. Equal to retry.ProblemKeyReused.
	CodeKeyReused = "idempotency_key_reused"
	// CodeKeyMissing (400): the route requires a key (WithKeyRequired).
	CodeKeyMissing = "idempotency_key_missing"
	// CodeKeyInvalid (400): the key header breaks keygen.ParseHeader's rule
	// (1 to 255 bytes of visible ASCII and inner spaces, bare or an RFC 9651
	// sf-string, on one field line): empty, on two field lines, a malformed
	// sf-string, a control character, a non-ASCII byte, or too long.
	CodeKeyInvalid = "idempotency_key_invalid"
	// CodeStoreUnavailable (503): the store failed (at the claim, at the
	// commit of the handler's unit, or by failing the heartbeats until the
	// lease was about to run out). Nothing of the response was stored;
	// retrying with the same key is safe. The handler may have started:
	// its writes in the request's unit did not commit, and phases it
	// committed are resumed, not repeated, by the retry. It never ran
	// unprotected. When the claim failed because a bounded store is full
	// (ErrStoreFull), the answer carries Retry-After: 1.
	CodeStoreUnavailable = "idempotency_store_unavailable"
	// CodeRequestTooLarge (413): the request body exceeds the limit set with
	// WithMaxRequestBody; the handler did not run.
	CodeRequestTooLarge = "idempotency_request_too_large"
	// CodeRequestUnreadable (400): reading the request body failed; the
	// handler did not run.
	CodeRequestUnreadable = "idempotency_request_unreadable"
	// CodePrincipalUnavailable (401): the principal function returned an
	// error; the handler did not run.
	CodePrincipalUnavailable = "idempotency_principal_unavailable"
	// CodePrincipalMissing (401): the request carries a key but no principal
	// (the principal function returned ""; by default, no Authorization
	// header), and the server does not let anonymous callers share one
	// scope of keys (WithAnonymousKeys); the handler did not run. Send the
	// request with credentials, the same ones on every retry.
	CodePrincipalMissing = "idempotency_principal_missing"
	// CodeRequestIncomplete (503): the handler answered while the outcome of
	// a call it made to another service (Run.External) was unknown, so its
	// answer was not stored; the record stays in progress, ready to resume.
	// Retry with the same key: the retry asks the other service for the
	// outcome under the same downstream key before calling again.
	CodeRequestIncomplete = "idempotency_request_incomplete"
	// CodeResponseNotReplayable (409): the request with this key completed,
	// but its response body was larger than the stored-body cap
	// (WithMaxStoredBody) and was not kept. The work is not done again; the
	// problem carries the original status in "original_status". Do not retry.
	CodeResponseNotReplayable = "idempotency_response_not_replayable"
)

// ProblemTypeBase prefixes every problem "type": the type of a problem is
// ProblemTypeBase + code, for example
// "https://saferetry.dev/problems/idempotency_key_reused". The URI is a
// stable identifier (RFC 9457 section 3.1.1); it is not guaranteed to
// resolve to a document. Clients should match on "code" or "type".
const ProblemTypeBase = "https://saferetry.dev/problems/"

// Problem is the RFC 9457 problem+json body the middleware writes for its
// own answers. OriginalStatus is set only for CodeResponseNotReplayable.
type Problem struct {
	Type           string `json:"type"`
	Title          string `json:"title"`
	Status         int    `json:"status"`
	Code           string `json:"code"`
	Detail         string `json:"detail,omitempty"`
	OriginalStatus int    `json:"original_status,omitempty"`
}

var problemTitles = map[string]string{
	CodeInProgress:            "A request with this idempotency key is in progress",
	CodeKeyReused:             "The idempotency key was used for a different request",
	CodeKeyMissing:            "An idempotency key is required",
	CodeKeyInvalid:            "The idempotency key is invalid",
	CodeStoreUnavailable:      "The idempotency store is unavailable",
	CodeRequestTooLarge:       "The request body is too large",
	CodeRequestUnreadable:     "The request body could not be read",
	CodePrincipalUnavailable:  "The caller could not be identified",
	CodePrincipalMissing:      "A request with an idempotency key must identify its caller",
	CodeResponseNotReplayable: "The stored response cannot be replayed",
	CodeRequestIncomplete:     "The request could not be finished yet",
}

// writeProblem writes a problem+json answer with Cache-Control: no-store.
func writeProblem(w http.ResponseWriter, status int, code, detail string, extra func(*Problem)) {
	p := Problem{
		Type:   ProblemTypeBase + code,
		Title:  problemTitles[code],
		Status: status,
		Code:   code,
		Detail: detail,
	}
	if extra != nil {
		extra(&p)
	}
	body, _ := json.Marshal(p) // cannot fail: strings and ints only
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Cache-Control", "no-store")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	if code == CodeInProgress {
		h.Set("Retry-After", "1")
	}
	w.WriteHeader(status)
	_, _ = w.Write(body)
}
