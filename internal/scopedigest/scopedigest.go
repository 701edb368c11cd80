// Package scopedigest computes the digest under which the SQL and Redis
// stores keep a record: the SHA-256 of the scope's four parts.
package scopedigest

import (
	"crypto/sha256"
	"encoding/binary"
)

// Size is the length of a digest in bytes.
const Size = sha256.Size

// Sum returns the SHA-256 of the scope's four parts (principal, method,
// route, key), each preceded by its length as an 8-byte big-endian
// integer, so that no two scopes share the input whatever bytes their
// parts hold. On PostgreSQL 11 or later the same value is
// sha256(int8send(octet_length(p1)) || p1 || ...) over the parts as bytea.
func Sum(principal, method, route, key string) [Size]byte {
	b := make([]byte, 0, 4*8+len(principal)+len(method)+len(route)+len(key))
	for _, p := range [...]string{principal, method, route, key} {
		b = binary.BigEndian.AppendUint64(b, uint64(len(p)))
		b = append(b, p...)
	}
	return sha256.Sum256(b)
}
