package keygen_test

import (
	"errors"
	"fmt"
	"strings"

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

// An invalid key's error names it by its digest, never by its bytes.
func ExampleValidate() {
	fmt.Println(keygen.Validate("order-confirm-42"))
	fmt.Println(keygen.Validate("order 42"))
	err := keygen.Validate("order\t42")
	fmt.Println(errors.Is(err, keygen.ErrInvalidKey))
	var ike *keygen.InvalidKeyError
	if errors.As(err, &ike) {
		fmt.Println(ike.Reason, ike.Pos, ike.Digest)
	}
	fmt.Println(strings.Contains(err.Error(), "order"))
	// Output:
	// <nil>
	// <nil>
	// true
	// invalid_char 5 9aae19a5693b
	// false
}
