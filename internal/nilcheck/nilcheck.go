// Package nilcheck tells a nil interface value, and one that holds a nil
// pointer, func, map, slice or channel (a typed nil), from a usable one.
// The saferetry Transport and budget.Registry use it to treat a typed-nil
// base transport or budget as the default, rather than panic at its first
// use mid-request.
package nilcheck

import "reflect"

// Is reports whether v is nil or holds a nil pointer, func, map, slice,
// channel or interface.
func Is(v any) bool {
	if v == nil {
		return true
	}
	switch rv := reflect.ValueOf(v); rv.Kind() {
	case reflect.Pointer, reflect.Func, reflect.Map, reflect.Interface, reflect.Chan, reflect.Slice:
		return rv.IsNil()
	}
	return false
}
