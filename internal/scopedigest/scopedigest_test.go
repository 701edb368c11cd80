package scopedigest

import (
	"crypto/sha256"
	"encoding/hex"
	"testing"
)

// The digest depends on where each part ends, not only on the
// concatenated bytes, and is the SHA-256 of the length-prefixed parts.
func TestSumSeparatesParts(t *testing.T) {
	a := Sum("ab", "c", "d", "e")
	if b := Sum("a", "bc", "d", "e"); a == b {
		t.Fatalf("Sum(ab,c,d,e) = Sum(a,bc,d,e) = %x", a)
	}
	if a != Sum("ab", "c", "d", "e") {
		t.Fatal("Sum is not deterministic")
	}
	in := "\x00\x00\x00\x00\x00\x00\x00\x02ab" + "\x00\x00\x00\x00\x00\x00\x00\x01c" +
		"\x00\x00\x00\x00\x00\x00\x00\x01d" + "\x00\x00\x00\x00\x00\x00\x00\x01e"
	if want := sha256.Sum256([]byte(in)); a != want {
		t.Fatalf("Sum = %s, want %s", hex.EncodeToString(a[:]), hex.EncodeToString(want[:]))
	}
	if empty, want := Sum("", "", "", ""), sha256.Sum256(make([]byte, 32)); empty != want {
		t.Fatalf("Sum of empty parts = %x, want %x", empty, want)
	}
}
