package idempotency

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"errors"
)

// minMonitorSecret is the shortest secret WithMonitor accepts, in bytes.
const minMonitorSecret = 32

// An operation's identifier (the last segment of its monitor URL) is
//
//	base64url(version ‖ nonce ‖ AES-256-GCM(plaintext, aad))
//
// without padding, where plaintext holds what names the operation to the
// store (its method, route and key, and a prefix of its fingerprint) and
// aad is the principal it belongs to: an identifier opens only for its own
// principal, under a secret of the server's. The nonce is an HMAC of the
// principal and the plaintext under a second key derived from the secret
// (a synthetic IV): one operation always gets the same identifier, and two
// identifiers that differ name two operations, which is all an equal nonce
// could tell. So the identifier reveals nothing of the key and cannot be
// made, from the key or otherwise, without the secret.
const (
	idVersion   byte = 1
	idNonceSize      = 12
	idFPPrefix       = 32       // bytes of Record.Fingerprint the identifier keeps
	maxIDLength      = 16 << 10 // characters: a longer one is never issued, nor decoded
	idAEADInfo       = "saferetry idempotency monitor id v1: aead"
	idNonceInfo      = "saferetry idempotency monitor id v1: nonce"
)

// idKeys are the keys derived from one monitor secret.
type idKeys struct {
	aead  cipher.AEAD
	nonce []byte // the HMAC key of the synthetic nonce
}

// ids seals and opens operation identifiers: with the first of its keys,
// and with any of them, so that a fleet can rotate its secret (see
// WithMonitor).
type ids struct{ keys []idKeys }

// newIDs returns the ids of the secrets (the first seals), or an error when
// one is shorter than minMonitorSecret.
func newIDs(secrets [][]byte) (*ids, error) {
	out := &ids{}
	for _, s := range secrets {
		if len(s) < minMonitorSecret {
			return nil, errors.New("idempotency: a monitor secret must be at least 32 bytes")
		}
		k, err := hkdf.Key(sha256.New, s, nil, idAEADInfo, 32)
		if err != nil {
			return nil, err
		}
		n, err := hkdf.Key(sha256.New, s, nil, idNonceInfo, 32)
		if err != nil {
			return nil, err
		}
		block, err := aes.NewCipher(k)
		if err != nil {
			return nil, err
		}
		aead, err := cipher.NewGCM(block)
		if err != nil {
			return nil, err
		}
		out.keys = append(out.keys, idKeys{aead: aead, nonce: n})
	}
	if len(out.keys) == 0 {
		return nil, errors.New("idempotency: no monitor secret")
	}
	return out, nil
}

// operation is what an identifier names: a request's scope, less its
// principal (the identifier's own, checked at opening), and a prefix of the
// fingerprint of the request that made the record.
type operation struct {
	method, route, key string
	fingerprint        string // a prefix of Record.Fingerprint, at most idFPPrefix bytes
}

// seal returns the identifier of op for principal.
func (x *ids) seal(principal string, op operation) string {
	fp := op.fingerprint[:min(len(op.fingerprint), idFPPrefix)]
	plain := make([]byte, 0, 16+len(fp)+len(op.method)+len(op.route)+len(op.key))
	for _, f := range []string{fp, op.method, op.route} {
		plain = binary.AppendUvarint(plain, uint64(len(f)))
		plain = append(plain, f...)
	}
	plain = append(plain, op.key...)
	k := x.keys[0]
	mac := hmac.New(sha256.New, k.nonce)
	mac.Write(binary.AppendUvarint(nil, uint64(len(principal))))
	mac.Write([]byte(principal))
	mac.Write(plain)
	nonce := mac.Sum(nil)[:idNonceSize]
	out := append([]byte{idVersion}, nonce...)
	out = k.aead.Seal(out, nonce, plain, []byte(principal))
	return base64.RawURLEncoding.EncodeToString(out)
}

var errBadID = errors.New("idempotency: not an operation of this caller")

// open returns the operation id names for principal, or errBadID: an
// identifier that is malformed, too long, sealed under no secret of x, or
// another principal's. It never says which.
func (x *ids) open(principal, id string) (operation, error) {
	if x == nil || len(id) == 0 || len(id) > maxIDLength {
		return operation{}, errBadID
	}
	raw, err := base64.RawURLEncoding.Strict().DecodeString(id)
	if err != nil || len(raw) < 1+idNonceSize || raw[0] != idVersion {
		return operation{}, errBadID
	}
	nonce, sealed := raw[1:1+idNonceSize], raw[1+idNonceSize:]
	for _, k := range x.keys {
		plain, err := k.aead.Open(nil, nonce, sealed, []byte(principal))
		if err != nil {
			continue
		}
		return parseOperation(plain)
	}
	return operation{}, errBadID
}

// parseOperation reads the plaintext of an identifier: three length-prefixed
// fields (fingerprint prefix, method, route), then the key.
func parseOperation(b []byte) (operation, error) {
	var fields [3]string
	for i := range fields {
		n, w := binary.Uvarint(b)
		if w <= 0 || n > uint64(len(b)-w) {
			return operation{}, errBadID
		}
		fields[i] = string(b[w : w+int(n)])
		b = b[w+int(n):]
	}
	op := operation{fingerprint: fields[0], method: fields[1], route: fields[2], key: string(b)}
	if op.method == "" || op.key == "" || len(op.fingerprint) > idFPPrefix {
		return operation{}, errBadID
	}
	return op, nil
}

// matches reports whether rec was made by the request op names: its
// fingerprint starts with op's prefix.
func (op operation) matches(rec Record) bool {
	fp := rec.Fingerprint[:min(len(rec.Fingerprint), idFPPrefix)]
	return fp == op.fingerprint
}
