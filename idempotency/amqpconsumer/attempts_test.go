package amqpconsumer

import (
	"strconv"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
)

func TestFailures(t *testing.T) {
	for _, c := range []struct {
		headers amqp.Table
		want    int
	}{
		{nil, 0},
		{amqp.Table{attemptHeader: int32(2)}, 2},
		{amqp.Table{attemptHeader: int32(2), "x-delivery-count": int64(3)}, 2}, // crashes: no attempt
		{amqp.Table{attemptHeader: "4"}, 4},
		{amqp.Table{attemptHeader: int64(-9)}, 0},
		{amqp.Table{attemptHeader: int64(1) << 40}, 1 << 20},
		{amqp.Table{attemptHeader: 2.5}, 0},
		{amqp.Table{attemptHeader: []byte("7")}, 0},
	} {
		if got := failures(amqp.Delivery{Headers: c.headers}); got != c.want {
			t.Errorf("failures(%v) = %d, want %d", c.headers, got, c.want)
		}
	}
}

// FuzzHeaderInt: a count read from a header, whatever a producer put
// there, is within [0, 1<<20] and never panics.
func FuzzHeaderInt(f *testing.F) {
	f.Add("3", int64(3))
	f.Add("-1", int64(-1))
	f.Add("99999999999999999999", int64(1)<<62)
	f.Fuzz(func(t *testing.T, s string, n int64) {
		for _, v := range []any{s, n, int32(n), int16(n), int8(n), uint32(n), uint16(n),
			uint8(n), int(n)} {
			if got := headerInt(v); got < 0 || got > 1<<20 {
				t.Fatalf("headerInt(%#v) = %d", v, got)
			}
		}
		if want, err := strconv.ParseInt(s, 10, 64); err == nil && want >= 0 && want <= 1<<20 {
			if got := headerInt(s); int64(got) != want {
				t.Fatalf("headerInt(%q) = %d, want %d", s, got, want)
			}
		}
	})
}
