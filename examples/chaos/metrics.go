package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"go.opentelemetry.io/otel/exporters/stdout/stdoutmetric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/saferetry/saferetry"
	"github.com/saferetry/saferetry/idempotency"
	"github.com/saferetry/saferetry/otelsaferetry"
)

// metrics is the run's OpenTelemetry instrumentation (-metrics): the
// fleet's client options and the middleware's server observer, recording
// into one meter provider whose reader exports once, when the run ends, to
// a file. Without -metrics there are no client options and the server
// observer is empty: they cost nothing.
type metrics struct {
	client []saferetry.Option
	server idempotency.Observer
	mp     *sdkmetric.MeterProvider
	file   *os.File
}

func newMetrics(path string) (*metrics, error) {
	if path == "" {
		return &metrics{}, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("-metrics: %w", err)
	}
	exp, err := stdoutmetric.New(stdoutmetric.WithWriter(f), stdoutmetric.WithPrettyPrint())
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("-metrics: %w", err)
	}
	// A periodic reader whose interval outlasts any run exports once, at
	// Shutdown.
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(
		sdkmetric.NewPeriodicReader(exp, sdkmetric.WithInterval(24*time.Hour))))
	opt := otelsaferetry.WithMeterProvider(mp)
	return &metrics{
		client: otelsaferetry.ClientOptions(opt),
		server: otelsaferetry.ServerObserver(opt),
		mp:     mp,
		file:   f,
	}, nil
}

// close exports the metrics and closes the file; it reports a failure on
// stderr (the run's own verdict does not depend on it).
func (m *metrics) close(stderr io.Writer) {
	if m.mp == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := m.mp.Shutdown(ctx)
	if cerr := m.file.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		fmt.Fprintln(stderr, "chaos: writing -metrics:", err)
		return
	}
	fmt.Fprintln(stderr, "chaos: OpenTelemetry metrics written to", m.file.Name())
}
