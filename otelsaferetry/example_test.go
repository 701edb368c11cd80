package otelsaferetry_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/otelsaferetry"
)

// The options instrument a Transport: here its metrics go to a meter
// provider of their own, and a server unavailable once costs two attempts
// and one retry.
func ExampleClientOptions() {
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if hits.Add(1) == 1 {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	}))
	defer srv.Close()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())

	base := &http.Transport{}
	defer base.CloseIdleConnections()
	opts := append(otelsaferetry.ClientOptions(otelsaferetry.WithMeterProvider(mp)), saferetry.WithLogger(nil))
	client := &http.Client{Transport: saferetry.NewTransport(base, opts...)}
	resp, err := client.Get(srv.URL)
	if err != nil {
		fmt.Println(err)
		return
	}
	resp.Body.Close()

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		fmt.Println(err)
		return
	}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if sum, ok := m.Data.(metricdata.Sum[int64]); ok {
				n := int64(0)
				for _, dp := range sum.DataPoints {
					n += dp.Value
				}
				fmt.Println(m.Name, n)
			}
		}
	}
	// Unordered output:
	// saferetry.client.attempts 2
	// saferetry.client.retries 1
}
