package redisstore

import (
	"encoding/binary"
	"errors"
	"net/http"
	"slices"
)

// headerFormat is the first byte of an encoded header: the version of the
// layout that follows.
const headerFormat = 1

// errBadHeader is wrapped by decodeHeader's errors.
var errBadHeader = errors.New("malformed stored response header")

// encodeHeader encodes h byte for byte, whatever its names and values hold,
// in sqlstore's layout:
//
//	format byte (1)
//	uvarint number of names, then per name in sorted order:
//	  uvarint length, name bytes, uvarint number of values,
//	  per value: uvarint length, value bytes
//
// A nil header is not stored at all (the record has no such field), so
// that nil-ness survives the round trip.
func encodeHeader(h http.Header) []byte {
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
	b = append(b, headerFormat)
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

// decodeHeader reverses encodeHeader. It refuses an unknown format, a
// truncated or over-long input, and names out of their sorted order (or
// given twice): it accepts only what encodeHeader writes.
func decodeHeader(b string) (http.Header, error) {
	if len(b) == 0 || b[0] != headerFormat {
		return nil, errBadHeader
	}
	d := headerDecoder{b: b[1:]}
	n := d.count()
	h := make(http.Header, n)
	prev := ""
	for i := range n {
		k := d.str()
		if i > 0 && k <= prev && d.err == nil {
			d.err = errBadHeader
		}
		prev = k
		nv := d.count()
		vs := make([]string, nv)
		for j := range vs {
			vs[j] = d.str()
		}
		if d.err != nil {
			return nil, d.err
		}
		h[k] = vs
	}
	if d.err == nil && len(d.b) != 0 {
		d.err = errBadHeader
	}
	if d.err != nil {
		return nil, d.err
	}
	return h, nil
}

// headerDecoder reads uvarint-prefixed fields; after the first error every
// read returns zero values and err stays set.
type headerDecoder struct {
	b   string
	err error
}

func (d *headerDecoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	var v uint64
	for i := 0; i < len(d.b) && i < binary.MaxVarintLen64; i++ {
		c := d.b[i]
		if c < 0x80 {
			if (i == binary.MaxVarintLen64-1 && c > 1) || (i > 0 && c == 0) {
				break // overflows 64 bits, or not the shortest encoding
			}
			d.b = d.b[i+1:]
			return v | uint64(c)<<(7*i)
		}
		v |= uint64(c&0x7f) << (7 * i)
	}
	d.err = errBadHeader
	return 0
}

// count reads a number of items, each of which takes at least one byte, so
// that a corrupt count never allocates more than the input's length.
func (d *headerDecoder) count() int {
	v := d.uvarint()
	if v > uint64(len(d.b)) {
		d.err = errBadHeader
		return 0
	}
	return int(v)
}

func (d *headerDecoder) str() string {
	v := d.uvarint()
	if v > uint64(len(d.b)) {
		d.err = errBadHeader
		return ""
	}
	s := d.b[:v]
	d.b = d.b[v:]
	return s
}
