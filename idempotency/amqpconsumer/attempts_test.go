package amqpconsumer

import (
	"strconv"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
)

func TestAttempts(t *testing.T) {
	for _, c := range []struct {
		headers            amqp.Table
		counted, delivered int
	}{
		{nil, 0, 0},
		{amqp.Table{attemptHeader: int32(2)}, 2, 0},
		{amqp.Table{attemptHeader: int32(2), "x-delivery-count": int64(3)}, 2, 3},
		{amqp.Table{attemptHeader: "4", "x-delivery-count": uint8(1)}, 4, 1},
		{amqp.Table{attemptHeader: int64(-9)}, 0, 0},
		{amqp.Table{attemptHeader: int64(1) << 40}, 1 << 20, 0},
		{amqp.Table{attemptHeader: 2.5, "x-delivery-count": []byte("7")}, 0, 0},
	} {
		counted, delivered := attempts(amqp.Delivery{Headers: c.headers})
		if counted != c.counted || delivered != c.delivered {
			t.Errorf("attempts(%v) = %d, %d; want %d, %d", c.headers, counted, delivered,
				c.counted, c.delivered)
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
