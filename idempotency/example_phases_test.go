package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"

	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/idempotency/memstore"
)

// cards is a card processor that de-duplicates charges by idempotency key.
type cards struct {
	mu      sync.Mutex
	charges map[string]string
}

func (c *cards) charge(key string) []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.charges[key]; !ok {
		c.charges[key] = fmt.Sprintf("ch_%d", len(c.charges)+1)
	}
	return []byte(c.charges[key])
}

func (c *cards) find(key string) ([]byte, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ch, ok := c.charges[key]
	return []byte(ch), ok
}

// The worked example: order -> charge -> receipt. The first execution
// creates the order and charges the card, but the processor's answer is
// lost; whatever the handler answers, its client gets 503
// idempotency_request_incomplete. The client's retry resumes: the order phase
// is not run again, the charge is looked up by its downstream key instead of
// being made twice, and the receipt and response commit. A later retry is a
// replay.
func ExampleRun_External() {
	processor := &cards{charges: map[string]string{}}
	loseAnswer := true
	pay := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		run, _ := idempotency.FromContext(ctx)
		order, err := run.Phase(ctx, "order", func(ctx context.Context) ([]byte, error) {
			fmt.Println("creating the order") // with the SQL store: INSERT through sqlstore.Tx(ctx)
			return []byte("ord_1"), nil
		})
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		charge, err := run.External(ctx, "charge",
			func(ctx context.Context, key string) ([]byte, error) {
				fmt.Println("charging the card")
				ch := processor.charge(key) // sent with Idempotency-Key: key
				if loseAnswer {
					loseAnswer = false
					return nil, errors.New("connection reset by the processor")
				}
				return ch, nil
			},
			func(ctx context.Context, key string) ([]byte, bool, error) {
				fmt.Println("looking the charge up")
				ch, found := processor.find(key)
				return ch, found, nil
			})
		if err != nil {
			http.Error(w, "card processor unreachable", http.StatusServiceUnavailable)
			return
		}
		fmt.Println("writing the receipt") // with the SQL store: INSERT through sqlstore.Tx(ctx)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"order":%q,"charge":%q}`, order, charge)
	})

	mux := http.NewServeMux()
	mux.Handle("POST /payments", idempotency.New(memstore.New()).Wrap(pay))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	send := func() {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/payments", strings.NewReader(`{"amount":4200}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "order-42-pay")
		req.Header.Set("Authorization", "Bearer shop-client") // the default principal: a digest of it
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			fmt.Println(err)
			return
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		fmt.Println(resp.StatusCode, resp.Header.Get(idempotency.ReplayedHeader), strings.TrimSpace(string(b)))
	}
	send()
	send() // the client's retry, same key
	send() // and another
	fmt.Println("charges:", len(processor.charges))
	// Output:
	// creating the order
	// charging the card
	// 503  {"type":"https://saferetry.dev/problems/idempotency_request_incomplete","title":"The request could not be finished yet","status":503,"code":"idempotency_request_incomplete","detail":"a call to another service made for this request has an unknown outcome; retry with the same key to finish it"}
	// looking the charge up
	// writing the receipt
	// 201  {"order":"ord_1","charge":"ch_1"}
	// 201 true {"order":"ord_1","charge":"ch_1"}
	// charges: 1
}
