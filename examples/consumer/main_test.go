package main

import (
	"bytes"
	"os"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

// TestMain runs the test binary as a worker process when the demo starts
// one (os.Executable is the test binary).
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == "-worker" {
		os.Exit(realMain(os.Args[1:], os.Stdout, os.Stderr))
	}
	goleak.VerifyTestMain(m)
}

// TestDemo runs a short demo: the guarded consumer charges every order
// once, through a worker killed mid-message; the bare one charges the
// orders re-published under a new id again.
func TestDemo(t *testing.T) {
	var out, errs bytes.Buffer
	if code := realMain([]string{"-messages", "200", "-kills", "1"}, &out, &errs); code != 0 {
		t.Fatalf("exit %d\n%s\n%s", code, out.String(), errs.String())
	}
	for _, want := range []string{
		"messages published:   200 (140 orders)",
		"duplicates:           30 again under a new message id, 30 again under the same id " +
			"(JetStream's window dropped 30)",
		"with the guard:       140 charges for 140 orders",
		"PASS: every order charged once",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the demo's output lacks %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "without the guard:    140 charges") {
		t.Errorf("the bare consumer charged no duplicate:\n%s", out.String())
	}
}

func TestFlags(t *testing.T) {
	var out, errs bytes.Buffer
	if code := realMain([]string{"-h"}, &out, &errs); code != 0 {
		t.Errorf("-h: exit %d", code)
	}
	if code := realMain([]string{"-messages", "5"}, &out, &errs); code != 2 {
		t.Errorf("-messages 5: exit %d, want 2", code)
	}
}
