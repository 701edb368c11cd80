package saferetry

import (
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
)

// ErrKeyChanged is wrapped by the error of an attempt whose preparation
// added, removed or changed the idempotency key header.
var ErrKeyChanged = errors.New("saferetry: prepare changed the idempotency key header")

// prepare runs the Transport's preparation functions in order on the attempt's copy r,
// then checks that the key header (name, in any spelling) is what it was in
// before.
func prepare(fns []func(*http.Request, int) error,
	r *http.Request, attempt int, before http.Header, name string) error {
	for _, f := range fns {
		if err := f(r, attempt); err != nil {
			return fmt.Errorf("saferetry: preparing attempt %d: %w", attempt, err)
		}
	}
	if !sameField(before, r.Header, name) {
		return fmt.Errorf("saferetry: preparing attempt %d: %w", attempt, ErrKeyChanged)
	}
	return nil
}

// sameField reports whether a and b hold the same values for the field name,
// under every spelling of it.
func sameField(a, b http.Header, name string) bool {
	n := 0
	for k, v := range a {
		if strings.EqualFold(k, name) {
			if !slices.Equal(v, b[k]) {
				return false
			}
			n++
		}
	}
	for k := range b {
		if strings.EqualFold(k, name) {
			n--
		}
	}
	return n == 0
}
