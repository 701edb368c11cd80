package linearizability

import (
	"cmp"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

// checkTimeout bounds porcupine's search on one history. A history it cannot
// decide within it fails the test (Unknown is never taken for Ok).
const checkTimeout = 10 * time.Second

// verdict is the check of one history.
type verdict struct {
	result porcupine.CheckResult
	// bad is the first partition (one key's operations) that is not
	// linearizable, ordered by call, when result is Illegal.
	bad []porcupine.Operation
}

func check(m model, ops []porcupine.Operation) verdict {
	pm := m.porcupine()
	v := verdict{result: porcupine.CheckOperationsTimeout(pm, ops, checkTimeout)}
	if v.result != porcupine.Illegal {
		return v
	}
	for _, part := range partitionByKey(ops) {
		if porcupine.CheckOperationsTimeout(pm, part, checkTimeout) == porcupine.Illegal {
			v.bad = slices.SortedFunc(slices.Values(part), func(a, b porcupine.Operation) int {
				return cmp.Compare(a.Call, b.Call)
			})
			break
		}
	}
	return v
}

// requireLinearizable fails t, with porcupine's visualization written to a
// directory that outlives the test, unless ops is linearizable.
func requireLinearizable(t *testing.T, m model, ops []porcupine.Operation) {
	t.Helper()
	start := time.Now()
	v := check(m, ops)
	t.Logf("porcupine: %s, %d operations in %d keys, checked in %v",
		v.result, len(ops), len(partitionByKey(ops)), time.Since(start).Round(time.Millisecond))
	switch v.result {
	case porcupine.Ok:
		return
	case porcupine.Unknown:
		t.Fatalf("porcupine could not decide within %v; the keys with the most calls of unknown "+
			"outcome: %s", checkTimeout, unknownsByKey(ops))
	}
	dir, err := os.MkdirTemp("", "lincheck-")
	if err != nil {
		t.Fatalf("history %s, and no directory for its visualization: %v", v.result, err)
	}
	path := filepath.Join(dir, strings.ReplaceAll(t.Name(), "/", "_")+".html")
	if err := visualize(m, ops, path); err != nil {
		t.Errorf("writing the visualization: %v", err)
	}
	t.Fatalf("the history is not linearizable\nporcupine's visualization: %s\n%s",
		path, m.explain(v.bad))
}

// visualize writes porcupine's HTML visualization of ops to path.
func visualize(m model, ops []porcupine.Operation, path string) error {
	pm := m.porcupine()
	// The visualization draws client i on row i: number them densely.
	ops = slices.Clone(ops)
	dense := map[int]int{}
	for i, op := range ops {
		id, ok := dense[op.ClientId]
		if !ok {
			id = len(dense)
			dense[op.ClientId] = id
		}
		ops[i].ClientId = id
	}
	_, info := porcupine.CheckOperationsVerbose(pm, ops, checkTimeout)
	return porcupine.VisualizePath(pm, info, path)
}

// explain says why one key's operations are not linearizable, from
// porcupine's longest partial linearization: its last steps, the state they
// leave, and the operations of which none can come next. This and the
// visualization are the failure's reproduction.
func (m model) explain(part []porcupine.Operation) string {
	if len(part) == 0 {
		return ""
	}
	pm := m.porcupine()
	_, info := porcupine.CheckOperationsVerbose(pm, part, checkTimeout)
	var longest []porcupine.Operation
	for _, p := range info.PartialLinearizationsOperations() {
		for _, l := range p {
			if len(l) > len(longest) {
				longest = l
			}
		}
	}
	t0 := part[0].Call
	at := func(op porcupine.Operation) string {
		ret := "never"
		if op.Return != math.MaxInt64 {
			ret = fmt.Sprint((op.Return - t0) / 1000)
		}
		return fmt.Sprintf("[%d, %s] client %d: %s", (op.Call-t0)/1000, ret, op.ClientId,
			m.describeOp(op.Input.(input), op.Output.(output)))
	}
	var b strings.Builder
	fmt.Fprintf(&b, "key %q, %d operations (times in µs from its first call); the longest "+
		"linearizable order porcupine found takes %d of them, ending:\n",
		part[0].Input.(input).Key, len(part), len(longest))
	state := pm.Init()
	for i, op := range longest {
		_, state = pm.Step(state, op.Input, op.Output)
		if i >= len(longest)-8 {
			fmt.Fprintf(&b, "  %s\n      => %s\n", at(op), pm.DescribeState(state))
		}
	}
	done := map[porcupine.Operation]bool{}
	for _, op := range longest {
		done[op] = true
	}
	var rest []porcupine.Operation
	first := int64(math.MaxInt64)
	for _, op := range part {
		if !done[op] {
			rest = append(rest, op)
			first = min(first, op.Return)
		}
	}
	b.WriteString("and none of these can come next:\n")
	for _, op := range rest {
		if op.Call <= first {
			fmt.Fprintf(&b, "  %s\n", at(op))
		}
	}
	return b.String()
}

// unknownsByKey lists the three keys with the most calls of unknown outcome
// (each open until the end of its key's history, they make the search grow).
func unknownsByKey(ops []porcupine.Operation) string {
	type key struct {
		name         string
		ops, unknown int
	}
	var keys []key
	for _, part := range partitionByKey(ops) {
		k := key{name: part[0].Input.(input).Key, ops: len(part)}
		for _, op := range part {
			if op.Output.(output).Unknown {
				k.unknown++
			}
		}
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b key) int { return cmp.Compare(b.unknown, a.unknown) })
	var parts []string
	for _, k := range keys[:min(3, len(keys))] {
		parts = append(parts, fmt.Sprintf("%q %d of %d calls", k.name, k.unknown, k.ops))
	}
	return strings.Join(parts, ", ")
}
