package canonjson

import "testing"

// realBody is a payment request of 553 bytes, as a card API receives it.
var realBody = []byte(`{"amount":4200,"currency":"EUR","customer":{"id":"cus_9s6XKzkNRiz8i3","email":"jenny.rosen@example.com","name":"Jenny Rosen","address":{"line1":"510 Townsend St","city":"San Francisco","postal_code":"94103","country":"US"}},"description":"Order #1042: 2 x espresso beans 1 kg, 1 x grinder","metadata":{"order_id":"1042","cart":"c_77812","campaign":"spring-sale"},"items":[{"sku":"BEAN-ESP-1KG","qty":2,"unit_amount":1500},{"sku":"GRND-01","qty":1,"unit_amount":1200}],"payment_method":"pm_card_visa","capture":true,"statement_descriptor":"SHOP*1042"}`)

// BenchmarkParser and BenchmarkReference compare Parser with the
// encoding/json version it replaced, on realBody.
func BenchmarkParser(b *testing.B) {
	p := Parser{FoldKeys: true}
	out := make([]byte, 0, 1024)
	b.ReportAllocs()
	for b.Loop() {
		out, _ = p.Append(out[:0], realBody)
	}
}

func BenchmarkReference(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		_, _ = referenceCanonical(realBody, true)
	}
}
