package keygen

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"strings"

	"github.com/google/uuid"
)

// maxLen is the maximum length of a valid key, in bytes.
const maxLen = 255

// hashMarker separates the kept prefix of an over-long [Event] key from the
// hex SHA-256 of the full key. Outside this marker, every '%' in an Event key
// starts an escape followed by two upper-case hex digits, so "%~" never occurs
// in a key that was not shortened, and shortened keys cannot coincide with
// keys that were not.
const hashMarker = "%~"

// hashedPrefixLen is the longest prefix kept before hashMarker and the 64 hex
// digits of the SHA-256, so that a shortened key is at most maxLen bytes.
const hashedPrefixLen = maxLen - len(hashMarker) - sha256.Size*2

// Event returns a deterministic key derived from a business event: the
// event name followed by the values that identify one occurrence of it, for
// example Event("order-confirm", orderID). The same parts give the same key
// in every call, process and machine, so a retry can never forget its key.
//
// The rule, byte for byte:
//
//   - Each part is escaped separately, then the escaped parts are joined with
//     "-".
//   - In every part, '%', the three bytes that would need quoting in a
//     header value (',', '"', '\\') and every byte outside printable ASCII
//     0x21..0x7E (space, control characters, DEL, each byte of a non-ASCII
//     UTF-8 sequence) are replaced by '%' and two upper-case hex digits:
//     "%25" for '%', "%2C" for ',', "%20" for a space, "%C3%A9" for "é". So
//     an event key is always a bare header value (see [FormatHeader]).
//   - In the first part (the event name), '-' is kept verbatim, so
//     Event("order-confirm", "42") == "order-confirm-42".
//   - In every later part, '-' is escaped as "%2D", so
//     Event("a-b", "c") == "a-b-c" differs from Event("a", "b-c") == "a-b%2Dc".
//
// For a fixed number of parts n the mapping is injective: the last n-1
// escaped parts contain no '-', so splitting the key at its last n-1 '-'
// characters (from the right) recovers the escaped parts, the remainder is
// the escaped event name, and each escaped part decodes uniquely because '%'
// itself is always escaped.
//
// Limitation: keys of different part counts can coincide when an event name
// is a '-'-joined prefix of another, for example
// Event("order-confirm", "42") == Event("order", "confirm", "42"). Use one
// fixed number of parts for each event name, and names that are not
// '-'-joined prefixes of each other's names plus values.
//
// Length: when the escaped key is longer than 255 bytes, Event keeps
// its longest prefix that ends on an escape boundary and is at most 189
// bytes, then appends "%~" and the 64 lower-case hex digits of the SHA-256 of
// the full escaped key. The result is still deterministic and at most
// maxLen bytes; two different long keys coincide only if SHA-256 collides,
// and a shortened key never equals an unshortened one, because "%~" never
// occurs in an unshortened key.
//
// Zero parts, or a single empty part, give "", which [Validate] rejects
// with [ReasonEmpty]; every other result passes Validate. Event never
// fails or panics and is safe for concurrent use.
func Event(parts ...string) string {
	var b strings.Builder
	for i, p := range parts {
		if i > 0 {
			b.WriteByte('-')
		}
		escapePart(&b, p, i > 0)
	}
	s := b.String()
	if len(s) <= maxLen {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	cut := hashedPrefixLen
	// Do not split an escape: back off when one of the last two kept
	// bytes is the '%' that starts it.
	for k := 1; k <= 2; k++ {
		if s[cut-k] == '%' {
			cut -= k
			break
		}
	}
	return s[:cut] + hashMarker + hex.EncodeToString(sum[:])
}

const upperHex = "0123456789ABCDEF"

func escapePart(b *strings.Builder, p string, escapeDash bool) {
	for i := 0; i < len(p); i++ {
		c := p[i]
		if c < 0x21 || c > 0x7E || c == '%' || c == ',' || c == '"' || c == '\\' ||
			(escapeDash && c == '-') {
			b.WriteByte('%')
			b.WriteByte(upperHex[c>>4])
			b.WriteByte(upperHex[c&0x0F])
			continue
		}
		b.WriteByte(c)
	}
}

// Random returns a new random key: a version 4 UUID in its canonical
// 36-character form, from crypto/rand through github.com/google/uuid. Generate
// it once per logical request and reuse it for every attempt; a new value per
// attempt de-duplicates nothing. Random is safe for concurrent use and does
// not fail (crypto/rand does not return errors on supported platforms).
func Random() string {
	return uuid.NewString()
}

type ctxKey struct{}

// NewContext returns a copy of ctx that carries key as the request-scoped
// idempotency key: the saferetry Transport attaches it to every POST and PATCH
// made with the returned context that has no key of its own, so use one such
// context per logical outgoing operation: its request, and any re-run of
// it, then share one key. Do not make two different operations with one
// such context: a server would take the second for a retry of the first (a
// 422 for a different body, or the first one's stored answer for the same
// body). A unit of work that makes several writes derives one key per
// write, for example Event(key, "charge") and Event(key, "receipt").
// A nil ctx is treated as context.Background(). The key is not validated
// here: the saferetry Transport validates it when it attaches
// it to a request, and [Validate] is available for earlier checks. An empty
// key is stored but reported as absent by [FromContext]. Safe for concurrent
// use.
func NewContext(ctx context.Context, key string) context.Context {
	if ctx == nil {
		ctx = context.Background()
	}
	return context.WithValue(ctx, ctxKey{}, key)
}

// FromContext returns the request-scoped key that [NewContext] attached to
// ctx, and whether there is one. A nil ctx, a ctx without a key and an empty
// key all give "", false. Safe for concurrent use.
func FromContext(ctx context.Context) (string, bool) {
	if ctx == nil {
		return "", false
	}
	key, _ := ctx.Value(ctxKey{}).(string)
	return key, key != ""
}

// Digest returns the short digest under which the saferetry Transport and
// the idempotency middleware name a key in their logs, so that the client's
// and the server's records of one logical request can be matched without
// either logging the raw key: the first 6 bytes of the SHA-256 of key, in hex
// (12 characters). It is for correlation, not secrecy: a key from a small,
// guessable space (an event key over sequential order ids) can be found again
// by trying candidates. Safe for concurrent use.
func Digest(key string) string {
	sum := sha256.Sum256([]byte(key))
	return hex.EncodeToString(sum[:6])
}
