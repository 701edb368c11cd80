package deadline_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"

	"github.com/saferetry/saferetry/deadline"
)

// A handler behind Middleware sees the client's remaining time as its
// context's deadline.
func ExampleMiddleware() {
	h := deadline.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, ok := r.Context().Deadline()
		fmt.Fprint(w, ok)
	}))
	req := httptest.NewRequest(http.MethodPost, "/payments", nil)
	req.Header.Set(deadline.Header, "2500") // what a saferetry Transport sends
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	fmt.Println("deadline:", rec.Body.String())
	// Output: deadline: true
}
