package idempotency

// What the external tests (package idempotency_test, which may import
// memstore) reach of the package's unexported parts.

// Recovery data as Phase and External write it.
type (
	Recovery       = recovery
	CommittedPhase = committedPhase
	PendingCall    = pendingCall
)

// Encode returns rec as Phase writes it in Record.RecoveryData.
func (rec recovery) Encode() []byte { return rec.encode() }

var (
	DecodeRecovery     = decodeRecovery
	ErrBadRecoveryData = errBadRecoveryData
	ErrLeaseExpired    = errLeaseExpired
)

// FingerprintVersion is the version new records store.
const FingerprintVersion = fingerprintVersion

// Fingerprint returns a request's fingerprint of version v.
func Fingerprint(v int, method, route, path, rawQuery, contentType string, body []byte) string {
	fp, ok := fingerprint(fingerprintInput{method, route, path, rawQuery, contentType, body}, v)
	if !ok {
		panic("unknown fingerprint version")
	}
	return fp
}

// StoredRequest returns a request as the middleware stores it at a claim.
func StoredRequest(method, url, host, contentType string, body []byte) []byte {
	return storedRequest{Method: method, URL: url, Host: host, ContentType: contentType, Body: body}.encode()
}

// CompleterBackoffs returns how many records c is backing off from.
func CompleterBackoffs(c *Completer) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.backoff)
}

// DownstreamKeyOf returns Run.DownstreamKey(phase) of an execution of s.
func DownstreamKeyOf(s Scope, phase string) string {
	return (&Run{Scope: s}).DownstreamKey(phase)
}
