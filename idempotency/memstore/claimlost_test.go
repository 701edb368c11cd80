package memstore_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/idempotencytest"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// cutClaim is a memory store whose claim, once armed, applies and then
// fails, as a claim whose connection died after the store ran it.
type cutClaim struct {
	*memstore.Store
	armed atomic.Bool
	cuts  atomic.Int64
}

func (s *cutClaim) Claim(ctx context.Context, c idempotency.Claim) (idempotency.ClaimResult,
	error) {
	res, err := s.Store.Claim(ctx, c)
	if err != nil || !s.armed.CompareAndSwap(true, false) {
		return res, err
	}
	s.cuts.Add(1)
	return idempotency.ClaimResult{}, errors.New("the connection died after the claim ran")
}

// A claim whose answer is lost is the caller's, through both doors.
func TestClaimWhoseAnswerIsLost(t *testing.T) {
	s := &cutClaim{Store: memstore.New()}
	idempotencytest.TestClaimAnswerLost(t, s, func() { s.armed.Store(true) }, s.cuts.Load)
}
