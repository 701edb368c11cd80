package main

import (
	"encoding/csv"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

func writeOCCTable(w io.Writer, rows []OCCRow, cell func(OCCRow, int) string) {
	head := []string{"clients"}
	for _, s := range Strategies {
		head = append(head, s.Name)
	}
	fmt.Fprintln(w, "| "+strings.Join(head, " | ")+" |")
	fmt.Fprintln(w, "|"+strings.Repeat(" ---: |", len(head)))
	for _, r := range rows {
		line := []string{strconv.Itoa(r.Clients)}
		for s := range Strategies {
			line = append(line, cell(r, s))
		}
		fmt.Fprintln(w, "| "+strings.Join(line, " | ")+" |")
	}
}

// writeOCCSummary prints one contention level with each strategy relative to
// full jitter.
func writeOCCSummary(w io.Writer, r OCCRow) {
	fmt.Fprintln(w, "| strategy | write calls | x full jitter | time to last success (ms) | x full jitter |")
	fmt.Fprintln(w, "| --- | ---: | ---: | ---: | ---: |")
	for s, st := range Strategies {
		fmt.Fprintf(w, "| %s | %.0f | %.2f | %.0f | %.2f |\n", st.Name,
			r.Calls[s], r.Calls[s]/r.Calls[stratFull],
			ms(r.Time[s]), float64(r.Time[s])/float64(r.Time[stratFull]))
	}
}

func writeOutageTable(w io.Writer, c OutageConfig, rs []OutageResult) {
	fmt.Fprintln(w, "| budget | logical requests | server hits | amplification | amplification during the outage | peak hits/s in the outage | success rate |")
	fmt.Fprintln(w, "| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
	for _, r := range rs {
		fmt.Fprintf(w, "| %s | %d | %d | %.3f | %.3f | %d | %.2f%% |\n", r.Policy, r.Requests, r.Hits,
			r.Amplification(), r.OutageAmplification(), r.PeakDuringOutage(c), 100*r.SuccessRate())
	}
}

func writeChainTable(w io.Writer, c ChainConfig, chain, oneLayer []ChainResult) {
	fmt.Fprintln(w, "| variant | peak | steady state, full outage | steady state, 50% outage | success rate, 50% outage |")
	fmt.Fprintln(w, "| --- | ---: | ---: | ---: | ---: |")
	for _, r := range append(chain[:len(chain):len(chain)], oneLayer...) {
		m := c.Summary(r)
		fmt.Fprintf(w, "| %s | %.2f | %.2f | %.2f | %.1f%% |\n", m.Variant, m.Peak, m.FullSteady, m.HalfSteady,
			100*m.HalfSuccess)
	}
}

// writeChainCSV writes chain.csv: per second of arrival, the user requests
// and each variant's requests at the bottom per user request.
func writeChainCSV(dir string, rs []ChainResult) (string, error) {
	head := []string{"second", "user_requests"}
	for _, r := range rs {
		head = append(head, r.Variant)
	}
	recs := [][]string{head}
	amp := make([][]float64, len(rs))
	for i, r := range rs {
		amp[i] = r.Amplification()
	}
	for s := range rs[0].Users {
		line := []string{strconv.Itoa(s), strconv.Itoa(rs[0].Users[s])}
		for i := range rs {
			line = append(line, strconv.FormatFloat(amp[i][s], 'f', 3, 64))
		}
		recs = append(recs, line)
	}
	path := filepath.Join(dir, "chain.csv")
	return path, writeCSVFile(path, recs)
}

// writeCSV writes occ.csv (one line per level and strategy) and outage.csv
// (one line per second: logical requests and hits per policy).
func writeCSV(dir string, occ []OCCRow, outage []OutageResult) ([]string, error) {
	var recs [][]string
	recs = append(recs, []string{"clients", "strategy", "calls", "time_ms"})
	for _, r := range occ {
		for s, st := range Strategies {
			recs = append(recs, []string{strconv.Itoa(r.Clients), st.Name,
				strconv.FormatFloat(r.Calls[s], 'f', 2, 64), strconv.FormatFloat(ms(r.Time[s]), 'f', 3, 64)})
		}
	}
	occPath := filepath.Join(dir, "occ.csv")
	if err := writeCSVFile(occPath, recs); err != nil {
		return nil, err
	}

	head := []string{"second", "logical"}
	n := 0
	for _, r := range outage {
		head = append(head, r.Policy)
		n = max(n, len(r.PerSecond), len(r.Logical))
	}
	recs = [][]string{head}
	for s := range n {
		line := []string{strconv.Itoa(s), strconv.Itoa(at(outage[0].Logical, s))}
		for _, r := range outage {
			line = append(line, strconv.Itoa(at(r.PerSecond, s)))
		}
		recs = append(recs, line)
	}
	outPath := filepath.Join(dir, "outage.csv")
	if err := writeCSVFile(outPath, recs); err != nil {
		return nil, err
	}
	return []string{occPath, outPath}, nil
}

func at(s []int, i int) int {
	if i < len(s) {
		return s[i]
	}
	return 0
}

func writeCSVFile(path string, recs [][]string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	cw := csv.NewWriter(f)
	if err := cw.WriteAll(recs); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// Check is one of the claims of Brooker's post, checked on a result.
type Check struct {
	Claim string
	OK    bool
}

func (c Check) String() string {
	mark := "yes"
	if !c.OK {
		mark = "NO"
	}
	return fmt.Sprintf("%s: %s", c.Claim, mark)
}

// CheckOCC checks the orderings docs/BENCHMARKS.md relies on at one contention level.
func CheckOCC(r OCCRow) []Check {
	fewest := true
	for s := range Strategies {
		if s != stratFull && r.Calls[s] <= r.Calls[stratFull] {
			fewest = false
		}
	}
	longest := true
	for s := range Strategies {
		if s != stratExpo && r.Time[s] >= r.Time[stratExpo] {
			longest = false
		}
	}
	return []Check{
		{"full jitter makes the fewest write calls", fewest},
		{"exponential without jitter makes at least twice full jitter's calls", r.Calls[stratExpo] >= 2*r.Calls[stratFull]},
		{"exponential without jitter takes the longest", longest},
		{"decorrelated jitter finishes sooner than full jitter", r.Time[stratDecorr] < r.Time[stratFull]},
	}
}
