package saferetry

import (
	"slices"
	"strconv"
	"strings"

	"github.com/saferetry/saferetry/keygen"
)

// redactedError is an attempt's error whose text names the call's key by
// its digest: a server that echoes the key where the client expects a
// status code or a header puts it into the base transport's error, whose
// text then reaches the log records, the observers and the caller. The
// error it wraps is unchanged, so errors.Is and errors.As still match it.
type redactedError struct {
	err   error
	forms []string // the key's forms to replace, longest first
	name  string   // what replaces them
}

func (e *redactedError) Error() string {
	text := e.err.Error()
	for _, f := range e.forms {
		text = strings.ReplaceAll(text, f, e.name)
	}
	return text
}

func (e *redactedError) Unwrap() error { return e.err }

// redact returns err with the call's key redacted from its text (nil and a
// call without a key: err as it is). The forms replaced are the key, each
// field line of it as sent (an RFC 9651 string, or the caller's own
// spelling), and each of those as %q quotes it, as net/http quotes what it
// could not parse. Only the whole key is recognised: a server that echoes
// a part of it (net/http cuts a status line at its first space) is not.
func (c *call) redact(err error) error {
	if err == nil || c.key == "" {
		return err
	}
	forms := []string{c.key}
	for _, v := range keyValues(c.header, c.t.keyName, c.t.cfg.keyHeader) {
		forms = append(forms, v, strings.TrimSpace(v))
	}
	for _, f := range forms[:len(forms):len(forms)] {
		q := strconv.Quote(f)
		forms = append(forms, q[1:len(q)-1])
	}
	// Longest first, so that a form that contains another is replaced
	// whole; no empty form, which would match everywhere.
	slices.SortFunc(forms, func(a, b string) int { return len(b) - len(a) })
	forms = slices.Compact(forms)
	for len(forms) > 0 && forms[len(forms)-1] == "" {
		forms = forms[:len(forms)-1]
	}
	return &redactedError{err: err, forms: forms, name: "[key " + keygen.Digest(c.key) + "]"}
}
