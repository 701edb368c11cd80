// Command ratios reads `go test -bench` output (several rounds of the same
// benchmarks, in any order) and prints markdown: saferetry's guardrails and
// targets, each with the measured median and whether it is met, then per
// benchmark group the median of every unit for every contender and its ratio
// to the bare column of the same run.
//
//	go run ./cmd/ratios results/raw.txt > medians.md
//
// A benchmark's last name element is its column (client=X or store=X); the
// column whose value is "bare" is the base of its group.
package main

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

type key struct{ group, col, unit string }

type data struct {
	samples   map[key][]float64
	groups    []string            // in order of first appearance
	cols      map[string][]string // group -> columns in order of first appearance
	units     map[string][]string // group -> units in order of first appearance
	seenGroup map[string]bool
}

var procSuffix = regexp.MustCompile(`-\d+$`)

func parse(r io.Reader, d *data) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 4 || !strings.HasPrefix(f[0], "Benchmark") || len(f)%2 != 0 {
			continue
		}
		if _, err := strconv.Atoi(f[1]); err != nil {
			continue
		}
		name := procSuffix.ReplaceAllString(strings.TrimPrefix(f[0], "Benchmark"), "")
		i := strings.LastIndex(name, "/")
		if i < 0 {
			continue
		}
		group, col := name[:i], name[i+1:]
		if !d.seenGroup[group] {
			d.seenGroup[group] = true
			d.groups = append(d.groups, group)
		}
		if !slices.Contains(d.cols[group], col) {
			d.cols[group] = append(d.cols[group], col)
		}
		for j := 2; j+1 < len(f); j += 2 {
			v, err := strconv.ParseFloat(f[j], 64)
			if err != nil {
				continue
			}
			unit := f[j+1]
			if !slices.Contains(d.units[group], unit) {
				d.units[group] = append(d.units[group], unit)
			}
			k := key{group, col, unit}
			d.samples[k] = append(d.samples[k], v)
		}
	}
	return sc.Err()
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	s := slices.Clone(v)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

func (d *data) med(group, col, unit string) float64 {
	return median(d.samples[key{group, col, unit}])
}

// baseCol returns the column of group whose value is "bare".
func (d *data) baseCol(group string) string {
	for _, c := range d.cols[group] {
		if strings.HasSuffix(c, "=bare") {
			return c
		}
	}
	return ""
}

func colName(c string) string {
	if i := strings.IndexByte(c, '='); i >= 0 {
		return c[i+1:]
	}
	return c
}

func num(v float64) string {
	switch {
	case math.IsNaN(v):
		return "-"
	case v == math.Trunc(v) && math.Abs(v) < 1e15:
		return strconv.FormatFloat(v, 'f', 0, 64)
	case math.Abs(v) >= 100:
		return strconv.FormatFloat(v, 'f', 0, 64)
	default:
		return strconv.FormatFloat(v, 'f', 3, 64)
	}
}

// unit order in tables: time, memory, allocations, then the custom metrics.
func orderUnits(units []string) []string {
	rank := func(u string) int {
		switch u {
		case "ns/op":
			return 0
		case "B/op":
			return 1
		case "allocs/op":
			return 2
		}
		return 3
	}
	out := slices.Clone(units)
	slices.SortStableFunc(out, func(a, b string) int { return rank(a) - rank(b) })
	return out
}

func (d *data) tables(w io.Writer) {
	for _, g := range d.groups {
		base := d.baseCol(g)
		units := orderUnits(d.units[g])
		fmt.Fprintf(w, "#### %s\n\n", g)
		hdr := []string{"contender", "n"}
		for _, u := range units {
			hdr = append(hdr, u)
			if base != "" && (u == "ns/op" || u == "B/op") {
				hdr = append(hdr, "x bare")
			}
			if base != "" && u == "allocs/op" {
				hdr = append(hdr, "+ bare")
			}
		}
		fmt.Fprintf(w, "| %s |\n|%s\n", strings.Join(hdr, " | "), strings.Repeat(" --- |", len(hdr)))
		for _, c := range d.cols[g] {
			row := []string{colName(c), strconv.Itoa(len(d.samples[key{g, c, units[0]}]))}
			for _, u := range units {
				v := d.med(g, c, u)
				row = append(row, num(v))
				if base == "" {
					continue
				}
				b := d.med(g, base, u)
				switch u {
				case "ns/op", "B/op":
					row = append(row, strconv.FormatFloat(v/b, 'f', 2, 64))
				case "allocs/op":
					row = append(row, fmt.Sprintf("%+.0f", v-b))
				}
			}
			fmt.Fprintf(w, "| %s |\n", strings.Join(row, " | "))
		}
		fmt.Fprintln(w)
	}
}

type check struct {
	target, measured string
	met              bool
	skipped          bool
}

func mark(c check) string {
	switch {
	case c.skipped:
		return "not measured"
	case c.met:
		return "met"
	default:
		return "**missed**"
	}
}

// targets evaluates the guardrails and targets on the medians: the cost when
// nothing fails (loopback and in-memory, against bare-timeout), no copy of a
// body with GetBody, no extra connections after a 503, the amplification of
// a full outage once the budget drains, the memory-store middleware's
// allocations, and the hedges' cut of a straggler's tail. A target whose
// benchmark is absent is left out, or reported as not measured.
func (d *data) targets() []check {
	var out []check
	has := func(g, c, u string) bool { return len(d.samples[key{g, c, u}]) > 0 }
	const sr = "client=saferetry"
	peers := []string{"client=retryablehttp", "client=failsafe", "client=retrygo"}
	// The cost when nothing fails (the guardrails): the baseline is
	// the bare transport as most callers run it, with http.Client.Timeout
	// set to saferetry's 30 s overall deadline (bare-timeout).
	const bt = "client=bare-timeout"
	for _, conc := range []string{"1", "16"} {
		g := "Happy/net=loopback/conc=" + conc
		if has(g, sr, "ns/op") && has(g, bt, "ns/op") {
			r := d.med(g, sr, "ns/op") / d.med(g, bt, "ns/op")
			out = append(out, check{"loopback, conc " + conc + ": ns/op within 1.05x of bare-timeout",
				fmt.Sprintf("%.2fx (%.2fx of bare)", r, d.med(g, sr, "ns/op")/d.med(g, "client=bare", "ns/op")), r <= 1.05, false})
		}
	}
	for _, conc := range []string{"1", "16"} {
		g := "Happy/net=memory/conc=" + conc
		if !has(g, sr, "ns/op") || !has(g, "client=bare", "ns/op") {
			continue
		}
		r := d.med(g, sr, "ns/op") / d.med(g, "client=bare", "ns/op")
		out = append(out, check{"in-memory, conc " + conc + ": ns/op at most 1.5x bare",
			fmt.Sprintf("%s against %s ns/op (%.2fx)", num(d.med(g, sr, "ns/op")), num(d.med(g, "client=bare", "ns/op")), r), r <= 1.5, false})
		da := d.med(g, sr, "allocs/op") - d.med(g, "client=bare", "allocs/op")
		out = append(out, check{"in-memory, conc " + conc + ": at most 6 allocs/op more than bare (hedging off)", fmt.Sprintf("%+.0f", da), da <= 6, false})
		db := d.med(g, sr, "B/op") - d.med(g, "client=bare", "B/op")
		out = append(out, check{"in-memory, conc " + conc + ": at most 1 KB/op more than bare (hedging off)", fmt.Sprintf("%+.0f B", db), db <= 1024, false})
	}
	for _, net := range []string{"loopback", "memory"} {
		g := "Post64K/net=" + net
		if has(g, sr, "copied-B/op") {
			v := d.med(g, sr, "copied-B/op") + d.med(g, sr, "reread-B/op")
			out = append(out, check{"64 KiB POST with GetBody (" + net + "): copies nothing", fmt.Sprintf("copied %s B/op, re-read %s B/op", num(d.med(g, sr, "copied-B/op")), num(d.med(g, sr, "reread-B/op"))), v == 0, false})
		}
	}
	for _, fails := range []string{"1", "2"} {
		g := "Transient/fail=" + fails
		if has(g, sr, "conns") {
			v := d.med(g, sr, "conns")
			out = append(out, check{"first " + fails + " attempt(s) 503: new connections <= 16 (client concurrency)", fmt.Sprintf("%s (bare %s)", num(v), num(d.med(g, "client=bare", "conns"))), v <= 16, false})
		}
	}
	if g := "Outage/outage=full"; has(g, sr, "hits/op") {
		v := d.med(g, sr, "tail-hits/op")
		var ps []string
		for _, p := range peers {
			ps = append(ps, fmt.Sprintf("%s %s", colName(p), num(d.med(g, p, "hits/op"))))
		}
		out = append(out, check{"full outage: amplification 1.00 (to two decimals) after the bucket drains",
			fmt.Sprintf("%s tail-hits/op (%s hits/op overall); peers %s", num(v), num(d.med(g, sr, "hits/op")), strings.Join(ps, ", ")), v < 1.005, false})
	}
	// Hedging against stragglers (1% of the hits held 1 s): the tail cut
	// against no hedging (bare), for at most 2% extra requests.
	if g := "Hedge"; has(g, "client=bare", "p99.9-ms") {
		base := d.med(g, "client=bare", "p99.9-ms")
		for _, c := range []string{"client=saferetry-hedge", "client=saferetry-hedge-p95"} {
			if !has(g, c, "p99.9-ms") {
				continue
			}
			v, extra := d.med(g, c, "p99.9-ms"), d.med(g, c, "extra-%")
			peer := strings.Replace(c, "saferetry", "failsafe", 1)
			measured := fmt.Sprintf("p99.9 %s ms against %s (%.1fx), %s%% extra requests", num(v), num(base), base/v, num(extra))
			if has(g, peer, "p99.9-ms") {
				pv := d.med(g, peer, "p99.9-ms")
				measured += fmt.Sprintf("; %s %s ms (%.1fx), %s%% extra", colName(peer), num(pv), base/pv, num(d.med(g, peer, "extra-%")))
			}
			out = append(out, check{"stragglers, " + colName(c) + ": p99.9 cut 10x or more, at most 2% extra requests",
				measured, base/v >= 10 && extra <= 2, false})
		}
	}
	g := "Middleware"
	if has(g, "store=memory", "allocs/op") {
		a := d.med(g, "store=memory", "allocs/op")
		da := a - d.med(g, "store=bare", "allocs/op")
		out = append(out, check{"memory-store middleware: at most 40 allocs per guarded request",
			fmt.Sprintf("%s (the bare handler's included; %+.0f over it)", num(a), da), a <= 40, false})
	} else {
		out = append(out, check{"memory-store middleware: at most 40 allocs per guarded request", "", false, true})
	}
	return out
}

// peerTable prints the happy path's price of saferetry and of the peers
// against bare net/http, side by side: the extra allocations and bytes per
// request in memory (a GET, and a small POST when BenchmarkHappyPost ran),
// and the time ratios to bare, in memory and over
// loopback, at 1 and 16 callers.
func (d *data) peerTable(w io.Writer) {
	cols := []string{"client=saferetry", "client=retryablehttp", "client=aws-standard", "client=bare-timeout"}
	has := func(g, c, u string) bool { return len(d.samples[key{g, c, u}]) > 0 }
	if !has("Happy/net=memory/conc=1", "client=bare", "ns/op") {
		return
	}
	fmt.Fprintln(w, "### The happy path's price against bare net/http (medians)")
	fmt.Fprintln(w)
	fmt.Fprint(w, "| |")
	for _, c := range cols {
		fmt.Fprintf(w, " %s |", colName(c))
	}
	fmt.Fprint(w, "\n| --- |")
	for range cols {
		fmt.Fprint(w, " --- |")
	}
	fmt.Fprintln(w)
	row := func(label string, f func(c string) string) {
		fmt.Fprintf(w, "| %s |", label)
		for _, c := range cols {
			fmt.Fprintf(w, " %s |", f(c))
		}
		fmt.Fprintln(w)
	}
	extra := func(g, unit, format string) func(string) string {
		return func(c string) string {
			if !has(g, c, unit) {
				return "-"
			}
			return fmt.Sprintf(format, d.med(g, c, unit)-d.med(g, "client=bare", unit))
		}
	}
	ratio := func(g string) func(string) string {
		return func(c string) string {
			if !has(g, c, "ns/op") || !has(g, "client=bare", "ns/op") {
				return "-"
			}
			return fmt.Sprintf("%.2fx", d.med(g, c, "ns/op")/d.med(g, "client=bare", "ns/op"))
		}
	}
	row("extra allocations per request", extra("Happy/net=memory/conc=1", "allocs/op", "%+.0f"))
	row("extra bytes per request", extra("Happy/net=memory/conc=1", "B/op", "%+.0f B"))
	if has("HappyPost/net=memory/conc=1", "client=bare", "allocs/op") {
		row("extra allocations per POST", extra("HappyPost/net=memory/conc=1", "allocs/op", "%+.0f"))
		row("extra bytes per POST", extra("HappyPost/net=memory/conc=1", "B/op", "%+.0f B"))
	}
	for _, conc := range []string{"1", "16"} {
		row("time in memory, "+conc+" caller(s)", ratio("Happy/net=memory/conc="+conc))
	}
	for _, conc := range []string{"1", "16"} {
		row("time over loopback, "+conc+" caller(s)", ratio("Happy/net=loopback/conc="+conc))
	}
	fmt.Fprintln(w)
}

func main() {
	d := &data{samples: map[key][]float64{}, cols: map[string][]string{}, units: map[string][]string{}, seenGroup: map[string]bool{}}
	if len(os.Args) < 2 {
		if err := parse(os.Stdin, d); err != nil {
			fmt.Fprintln(os.Stderr, "ratios:", err)
			os.Exit(1)
		}
	}
	for _, name := range os.Args[1:] {
		f, err := os.Open(name)
		if err != nil {
			fmt.Fprintln(os.Stderr, "ratios:", err)
			os.Exit(1)
		}
		err = parse(f, d)
		f.Close()
		if err != nil {
			fmt.Fprintln(os.Stderr, "ratios:", err)
			os.Exit(1)
		}
	}
	w := bufio.NewWriter(os.Stdout)
	defer w.Flush()
	d.peerTable(w)
	fmt.Fprintln(w, "### Guardrails and targets (saferetry, medians)")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| target | measured | verdict |\n| --- | --- | --- |")
	for _, c := range d.targets() {
		fmt.Fprintf(w, "| %s | %s | %s |\n", c.target, c.measured, mark(c))
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "### Medians and ratios to bare (same run)")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "n is the number of rounds; \"x bare\" divides by the bare column's median of the same group, \"+ bare\" subtracts it.")
	fmt.Fprintln(w)
	d.tables(w)
}
