// Package headercodec encodes the response header a store keeps with a
// completed record, byte for byte whatever its names and values hold (invalid
// UTF-8 included, which JSON would turn into U+FFFD). The SQL and Redis
// stores share the layout; it is a contract with the records they have
// written, so it never changes under format byte 1:
//
//	format byte (1)
//	uvarint number of names, then per name in sorted (byte-wise) order:
//	  uvarint length, name bytes, uvarint number of values,
//	  per value: uvarint length, value bytes
//
// Every uvarint is the shortest encoding of its value. Decode accepts only
// what Encode writes, so that Encode(Decode(b)) is b for every accepted b.
package headercodec

import (
	"encoding/binary"
	"errors"
	"net/http"
	"slices"
)

// format is the first byte of an encoded header: the version of the layout
// that follows.
const format = 1

// ErrMalformed is the error Decode returns for bytes that Encode did not
// write: an unknown format, a truncated or over-long input, a varint that is
// not the shortest, names out of their sorted order or given twice.
var ErrMalformed = errors.New("malformed stored response header")

// Encode returns h's encoding: nil for a nil header (a store keeps no
// header: SQL NULL, a missing field), and at least the format byte and a
// count for any other, an empty one included, so that nil-ness survives the
// round trip.
func Encode(h http.Header) []byte {
	if h == nil {
		return nil
	}
	names := make([]string, 0, len(h))
	size := 1 + binary.MaxVarintLen64
	for k, vs := range h {
		names = append(names, k)
		size += 2*binary.MaxVarintLen64 + len(k)
		for _, v := range vs {
			size += binary.MaxVarintLen64 + len(v)
		}
	}
	slices.Sort(names)
	b := make([]byte, 0, size)
	b = append(b, format)
	b = binary.AppendUvarint(b, uint64(len(names)))
	for _, k := range names {
		b = appendString(b, k)
		vs := h[k]
		b = binary.AppendUvarint(b, uint64(len(vs)))
		for _, v := range vs {
			b = appendString(b, v)
		}
	}
	return b
}

func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

// Decode reverses Encode: nil for nil, and ErrMalformed for any input that
// Encode does not write (an empty, non-nil input included). What it
// allocates is in proportion to len(b), whatever the counts in b claim. Every
// list of values decodes as a non-nil slice, an empty one too.
func Decode(b []byte) (http.Header, error) {
	if b == nil {
		return nil, nil
	}
	if len(b) == 0 || b[0] != format {
		return nil, ErrMalformed
	}
	// One copy holds every name and value: each is a substring of it.
	d := decoder{s: string(b[1:])}
	n := d.count()
	h := make(http.Header, n)
	prev := ""
	for i := range n {
		k := d.str()
		if i > 0 && k <= prev && d.err == nil {
			d.err = ErrMalformed // out of order, or given twice
		}
		prev = k
		vs := make([]string, d.count())
		for j := range vs {
			vs[j] = d.str()
		}
		if d.err != nil {
			return nil, d.err
		}
		h[k] = vs
	}
	if d.err == nil && len(d.s) != 0 {
		d.err = ErrMalformed
	}
	if d.err != nil {
		return nil, d.err
	}
	return h, nil
}

// decoder reads uvarint-prefixed fields; after the first error every read
// returns a zero value and err stays set.
type decoder struct {
	s   string
	err error
}

// uvarint reads a uvarint in its shortest encoding.
func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	var v uint64
	for i := 0; i < len(d.s) && i < binary.MaxVarintLen64; i++ {
		c := d.s[i]
		if c < 0x80 {
			if (i == binary.MaxVarintLen64-1 && c > 1) || (i > 0 && c == 0) {
				break // overflows 64 bits, or not the shortest encoding
			}
			d.s = d.s[i+1:]
			return v | uint64(c)<<(7*i)
		}
		v |= uint64(c&0x7f) << (7 * i)
	}
	d.err = ErrMalformed
	return 0
}

// count reads a number of items, each of which takes at least one byte, so
// that a corrupt count never allocates more than the input's length.
func (d *decoder) count() int {
	v := d.uvarint()
	if v > uint64(len(d.s)) {
		d.err = ErrMalformed
		return 0
	}
	return int(v)
}

func (d *decoder) str() string {
	v := d.uvarint()
	if v > uint64(len(d.s)) {
		d.err = ErrMalformed
		return ""
	}
	s := d.s[:v]
	d.s = d.s[v:]
	return s
}
