// Command example sends a POST through an instrumented saferetry Transport
// to a local server that answers 503 once, then prints the attempts' spans
// and the client metrics with the OpenTelemetry stdout exporters.
//
//	go run ./example
package main

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/stdout/stdoutmetric"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/otelsaferetry"
)

func main() {
	if err := run(); err != nil {
		log.Fatal(err)
	}
}

func run() error {
	ctx := context.Background()

	spans, err := stdouttrace.New(stdouttrace.WithPrettyPrint())
	if err != nil {
		return err
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(spans))
	metrics, err := stdoutmetric.New(stdoutmetric.WithPrettyPrint())
	if err != nil {
		return err
	}
	// The periodic reader exports at Shutdown, at the end of the run.
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewPeriodicReader(metrics)))
	otel.SetTracerProvider(tp)
	otel.SetMeterProvider(mp)
	otel.SetTextMapPropagator(propagation.TraceContext{})

	// A server that is unavailable for the first attempt.
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if hits.Add(1) == 1 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintf(os.Stderr, "server: traceparent %s\n", r.Header.Get("Traceparent"))
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()

	// The global providers, set above, are the defaults.
	client := &http.Client{Transport: saferetry.NewTransport(nil, otelsaferetry.ClientOptions()...)}

	ctx, span := tp.Tracer("example").Start(ctx, "checkout")
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/orders",
		strings.NewReader(`{"sku":"42"}`))
	if err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	span.End()
	fmt.Fprintf(os.Stderr, "client: %s after %d attempts\n", resp.Status, hits.Load())

	if err := tp.Shutdown(ctx); err != nil {
		return err
	}
	return mp.Shutdown(ctx)
}
