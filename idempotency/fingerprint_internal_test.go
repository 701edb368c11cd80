package idempotency

import (
	"mime"
	"strings"
	"testing"
)

// mediaTypeRef is mediaType as it was before its fast path for values
// without parameters.
func mediaTypeRef(ct string) string {
	if ct == "" {
		return ""
	}
	mt, _, err := mime.ParseMediaType(ct)
	if err != nil {
		mt, _, _ = strings.Cut(ct, ";")
	}
	return strings.ToLower(strings.TrimSpace(mt))
}

func FuzzMediaTypeMatchesTheReference(f *testing.F) {
	for _, s := range []string{"application/json", " Application/JSON ", "text/plain; charset=utf-8", "json",
		"a/b/c", "\xff/x", "x/y\u0085", "bad type", `a/b"c`, "İ/x"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, ct string) {
		if got, want := mediaType(ct), mediaTypeRef(ct); got != want {
			t.Fatalf("mediaType(%q) = %q, the reference says %q", ct, got, want)
		}
	})
}
