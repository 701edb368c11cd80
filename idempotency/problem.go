package idempotency

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// Code is a problem code: the "code" member of the RFC 9457 problem+json body of
// every answer of the middleware's own (type
// "https://saferetry.dev/problems/" + code). They are stable: clients match
// on them. docs/CONTRACT.md says what a client does with each. In
// Event.Code it is the label of a refusal in logs and metrics.
type Code string

// The problem codes.
const (
	// CodeInProgress (409, Retry-After: 1): a request with the same key and
	// fingerprint is running. Retry with the same key.
	CodeInProgress Code = "idempotency_request_in_progress"
	// CodeKeyReused (422, or the 4xx of WithMismatchStatus): the key was used
	// for a different request. Do not retry; use a new key.
	CodeKeyReused Code = "idempotency_key_reused"
	// CodeKeyMissing (400): the route requires a key (WithKeyRequired).
	CodeKeyMissing Code = "idempotency_key_missing"
	// CodeKeyInvalid (400): the key breaks keygen.ParseHeader's rule.
	CodeKeyInvalid Code = "idempotency_key_invalid"
	// CodeStoreUnavailable (503): the store failed; nothing was stored, and
	// a retry with the same key is safe.
	CodeStoreUnavailable Code = "idempotency_store_unavailable"
	// CodeStoreFull (503, Retry-After: 1): a bounded store has no room for
	// a new key (ErrStoreFull); the handler did not run.
	CodeStoreFull Code = "idempotency_store_full"
	// CodeRequestTooLarge (413): the body is over WithMaxRequestBody, or
	// the record over what the store can ever hold (ErrRecordTooLarge).
	CodeRequestTooLarge Code = "idempotency_request_too_large"
	// CodeRequestUnreadable (400): reading the request body failed.
	CodeRequestUnreadable Code = "idempotency_request_unreadable"
	// CodePrincipalUnavailable (503, Retry-After: 1): the principal function
	// failed (the authentication backend is down, say): a server failure,
	// nothing ran. Retry with the same key.
	CodePrincipalUnavailable Code = "idempotency_principal_unavailable"
	// CodePrincipalRefused (401): the principal function refused the
	// request's credentials (ErrPrincipalRefused). Do not retry as is.
	CodePrincipalRefused Code = "idempotency_principal_refused"
	// CodePrincipalMissing (401): a key but no principal, without
	// WithAnonymousKeys.
	CodePrincipalMissing Code = "idempotency_principal_missing"
	// CodeRequestIncomplete (503): the handler answered while a call to
	// another service (Run.External) had an unknown outcome; the record is
	// kept for a resume. Retry with the same key.
	CodeRequestIncomplete Code = "idempotency_request_incomplete"
	// CodeResponseNotReplayable (409): the request completed, but its
	// response body was over WithMaxStoredBody; "original_status" holds its
	// status. Do not retry.
	CodeResponseNotReplayable Code = "idempotency_response_not_replayable"
	// CodeRequestAbsent (404, the Monitor only): no request with this key
	// in the caller's scope, or one that completed longer ago than the
	// replay window, or an identifier that names nothing of the caller's.
	// Sending the request again with the same key is safe: it runs once.
	CodeRequestAbsent Code = "idempotency_request_absent"
	// CodeLookupInvalid (400, or 405 for a method other than GET or HEAD;
	// the Monitor only): a lookup whose Idempotency-Lookup header is
	// missing, malformed, or names a method the middleware does not guard
	// or a route the monitor does not know. Do not retry as is.
	CodeLookupInvalid Code = "idempotency_lookup_invalid"
)

const problemTypeBase = "https://saferetry.dev/problems/"

// problem is the RFC 9457 problem+json body of the middleware's answers.
type problem struct {
	Type           string `json:"type"`
	Title          string `json:"title"`
	Status         int    `json:"status"`
	Code           Code   `json:"code"`
	Detail         string `json:"detail,omitempty"`
	OriginalStatus int    `json:"original_status,omitempty"`
}

var problemTitles = map[Code]string{
	CodeInProgress:            "A request with this idempotency key is in progress",
	CodeKeyReused:             "The idempotency key was used for a different request",
	CodeKeyMissing:            "An idempotency key is required",
	CodeKeyInvalid:            "The idempotency key is invalid",
	CodeStoreUnavailable:      "The idempotency store is unavailable",
	CodeStoreFull:             "The idempotency store is full",
	CodeRequestTooLarge:       "The request body is too large",
	CodeRequestUnreadable:     "The request body could not be read",
	CodePrincipalUnavailable:  "The caller could not be identified",
	CodePrincipalRefused:      "The caller's credentials were refused",
	CodePrincipalMissing:      "A request with an idempotency key must identify its caller",
	CodeResponseNotReplayable: "The stored response cannot be replayed",
	CodeRequestIncomplete:     "The request could not be finished yet",
	CodeRequestAbsent:         "No request with this idempotency key",
	CodeLookupInvalid:         "The lookup is invalid",
}

// writeProblem writes a problem+json answer with Cache-Control: no-store,
// and Retry-After: 1 for the codes a client retries after a pause (in
// progress, store full, principal unavailable).
// originalStatus is set for CodeResponseNotReplayable only.
func writeProblem(w http.ResponseWriter, status int, code Code, detail string, originalStatus int) {
	body, _ := json.Marshal(problem{
		Type: problemTypeBase + string(code), Title: problemTitles[code], Status: status,
		Code: code, Detail: detail, OriginalStatus: originalStatus,
	}) // strings and ints: cannot fail
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Cache-Control", "no-store")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	if code == CodeInProgress || code == CodeStoreFull || code == CodePrincipalUnavailable {
		h.Set("Retry-After", "1")
	}
	w.WriteHeader(status)
	_, _ = w.Write(body)
}
