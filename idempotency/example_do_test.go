package idempotency_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
	"github.com/saferetry/saferetry/keygen"
)

// A queue consumer handles each message through the function door: a
// redelivered message gets the stored output without a second transfer,
// and a refused transfer, marked definitive, is stored and refused again
// without running.
func ExampleMiddleware_Do() {
	mw := idempotency.New(memstore.New(), idempotency.WithLogger(nil))
	transfers := 0
	transfer := func(ctx context.Context, run *idempotency.Run) ([]byte, error) {
		if string(run.Payload) == "amount=-5" {
			return nil, fmt.Errorf("a negative amount: %w", idempotency.ErrDefinitive)
		}
		transfers++ // the side effect
		return fmt.Appendf(nil, "transfer %d of %s", transfers, run.Payload), nil
	}
	handle := func(messageID, body string) {
		res, err := mw.Do(context.Background(), idempotency.Call{
			Principal: "ledger",
			Operation: "transfer",
			Key:       keygen.Event("transfer", messageID), // event-derived: a redelivery has it too
			Payload:   []byte(body),
		}, transfer)
		switch {
		case errors.Is(err, idempotency.ErrDefinitive):
			fmt.Printf("%s: refused for good (replayed %v): %v\n", messageID, res.Replayed, err)
		case err != nil:
			fmt.Printf("%s: %v; nack for a redelivery\n", messageID, err)
		default:
			fmt.Printf("%s: %s (replayed %v)\n", messageID, res.Output, res.Replayed)
		}
	}
	handle("m-1", "amount=100")
	handle("m-1", "amount=100") // redelivered
	handle("m-2", "amount=-5")
	handle("m-2", "amount=-5") // redelivered
	fmt.Println("transfers:", transfers)
	// Output:
	// m-1: transfer 1 of amount=100 (replayed false)
	// m-1: transfer 1 of amount=100 (replayed true)
	// m-2: refused for good (replayed false): a negative amount: idempotency: definitive failure
	// m-2: refused for good (replayed true): a negative amount: idempotency: definitive failure
	// transfers: 1
}
