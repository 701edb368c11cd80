package idempotency_test

import (
	"encoding/json"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/saferetry/saferetry/idempotency"
)

func TestStoredRequest(t *testing.T) {
	in := idempotency.StoredRequest{Method: "POST", URL: "/p?a=1", Host: "h", ContentType: "application/json", Body: []byte{0, 1, 2}}
	out, err := idempotency.DecodeRequest(in.Encode())
	require.NoError(t, err)
	require.Equal(t, in, out)
	_, err = idempotency.DecodeRequest([]byte("{"))
	require.ErrorIs(t, err, idempotency.ErrBadRequestRecord)
}

// FuzzStoredRequestEncode checks the hand-written encoder against
// encoding/json, byte for byte, and that DecodeRequest reads it back.
func FuzzStoredRequestEncode(f *testing.F) {
	f.Add("0123abcd", "POST", "/orders?a=1&b=<2>", "api.example", "application/json", []byte(`{"a":1}`))
	f.Add("", "PATCH", "/\u00e9\"\\\n", "", "", []byte{})
	f.Add("x", "", "", "h\xff", "text/plain; charset=\"utf-8\"", []byte{0, 1, 2})
	f.Fuzz(func(t *testing.T, id, method, url, host, ct string, body []byte) {
		in := idempotency.StoredRequest{ID: id, Method: method, URL: url, Host: host, ContentType: ct, Body: body}
		want, err := json.Marshal(in)
		require.NoError(t, err)
		got := in.Encode()
		require.Equal(t, string(want), string(got))
		out, err := idempotency.DecodeRequest(got)
		require.NoError(t, err)
		valid := true
		for _, v := range []string{id, method, url, host, ct} {
			valid = valid && utf8.ValidString(v)
		}
		if valid { // encoding/json replaces invalid UTF-8 with U+FFFD
			if len(in.Body) == 0 {
				in.Body = nil
			}
			require.Equal(t, in, out)
		}
	})
}
