package keygen_test

import (
	"errors"
	"fmt"

	"github.com/saferetry/saferetry/keygen"
)

func ExampleEvent() {
	fmt.Println(keygen.Event("order-confirm", "42"))
	fmt.Println(keygen.Event("a-b", "c"))
	fmt.Println(keygen.Event("a", "b-c"))
	fmt.Println(keygen.Event("refund", "ord 7", "50%"))
	// Output:
	// order-confirm-42
	// a-b-c
	// a-b%2Dc
	// refund-ord%207-50%25
}

func ExampleValidate() {
	fmt.Println(keygen.Validate("order-confirm-42"))
	fmt.Println(keygen.Validate("order 42"))
	err := keygen.Validate("order\t42")
	fmt.Println(errors.Is(err, keygen.ErrInvalidKey))
	var ike *keygen.InvalidKeyError
	if errors.As(err, &ike) {
		fmt.Println(ike.Reason, ike.Pos)
	}
	fmt.Println(err)
	// Output:
	// <nil>
	// <nil>
	// true
	// invalid character 5
	// keygen: invalid idempotency key (digest 9aae19a5693b, 8 bytes): invalid character 0x09 at byte 5 (want visible ASCII or a space, 0x20..0x7E)
}
