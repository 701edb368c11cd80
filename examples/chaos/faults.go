package main

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"time"
)

// A fault kind is one way the network or the server misbehaves. During a
// chaos run time is cut into episodes; each episode applies one kind (or
// "calm") to a fraction of the connections or requests that pass.
type faultKind string

const (
	faultCalm           faultKind = "calm"             // nothing goes wrong
	faultLatency        faultKind = "latency"          // toxiproxy: responses delayed 200..600 ms (beyond the attempt timeout)
	faultReset          faultKind = "reset"            // toxiproxy: connection reset as the response starts back (after the commit)
	faultResetReq       faultKind = "reset-req"        // toxiproxy: connection reset as the request goes out (never reaches the server)
	faultTimeout        faultKind = "timeout"          // toxiproxy: responses black-holed, the connection closed after 2 s
	fault503            faultKind = "503"              // HTTP layer: 503 before the handler (half carry Retry-After: 1)
	fault429            faultKind = "429"              // HTTP layer: 429 with Retry-After: 1 before the handler
	fault5xxAfterCommit faultKind = "5xx-after-commit" // HTTP layer: the handler commits, then a 502/503/504 replaces its response
	faultAbort          faultKind = "abort"            // HTTP layer: the handler commits, then the connection is closed with no response
	faultSlow           faultKind = "slow"             // handler: stalls longer than the attempt timeout before doing its work
)

// faultInfo describes a kind for -help and the default share of traffic an
// episode of it hits.
type faultInfo struct {
	kind  faultKind
	share float64 // default fraction of connections (toxics) or requests (HTTP layer) hit
	what  string
}

var faultCatalog = []faultInfo{
	{faultCalm, 0, "no fault"},
	{faultLatency, 0.6, "toxiproxy latency: answers delayed 4/3 of the attempt timeout +/- 50% (work done, answer late)"},
	{faultReset, 0.3, "toxiproxy reset_peer on the answer: connection reset (work done, answer lost)"},
	{faultResetReq, 0.3, "toxiproxy reset_peer on the request: connection reset (never reaches the server)"},
	{faultTimeout, 0.3, "toxiproxy timeout: answers black-holed, connection closed after 2 s (work done, answer lost)"},
	{fault503, 0.5, "HTTP layer: 503 before the handler runs, half with Retry-After: 1 (a storm)"},
	{fault429, 0.5, "HTTP layer: 429 with Retry-After: 1 before the handler runs (throttling)"},
	{fault5xxAfterCommit, 0.3, "HTTP layer: the handler commits, then a 502/503/504 replaces its answer"},
	{faultAbort, 0.3, "HTTP layer: the handler commits, then the connection is closed, no answer"},
	{faultSlow, 0.1, "handler stalls 1.5x the attempt timeout: a retry comes while it runs (on\n                            SQLite its transaction holds the one write lock: a brownout)"},
}

func lookupFault(k faultKind) (faultInfo, bool) {
	for _, f := range faultCatalog {
		if f.kind == k {
			return f, true
		}
	}
	return faultInfo{}, false
}

// defaultFaults is the -faults default: calm a quarter of the time, every
// fault kind equally often in the rest.
const defaultFaults = "calm=3,latency=1,reset=1,reset-req=1,timeout=1,503=1,429=1,5xx-after-commit=1,abort=1,slow=1"

// mixEntry is one item of a fault mix: a kind, its weight (how often its
// episodes come up) and the share of traffic an episode hits.
type mixEntry struct {
	kind   faultKind
	weight int
	share  float64
}

type faultMix []mixEntry

// ErrFaultSpec is matched by every *FaultSpecError.
var ErrFaultSpec = errors.New("invalid fault mix")

// FaultSpecError reports which item of a -faults value was rejected and why.
type FaultSpecError struct {
	Item   string
	Reason string
}

func (e *FaultSpecError) Error() string {
	return fmt.Sprintf("invalid fault mix item %q: %s", e.Item, e.Reason)
}

func (e *FaultSpecError) Is(target error) bool { return target == ErrFaultSpec }

// parseFaults reads a fault mix: "none", or comma-separated items
// kind=weight or kind=weight@share, where weight is an integer 0..1000 and
// share a fraction in (0, 1]. A kind may appear once. The mix must have a
// positive total weight.
func parseFaults(spec string) (faultMix, error) {
	spec = strings.TrimSpace(spec)
	if spec == "none" || spec == "" {
		return faultMix{{kind: faultCalm, weight: 1}}, nil
	}
	var mix faultMix
	seen := map[faultKind]bool{}
	total := 0
	for _, item := range strings.Split(spec, ",") {
		item = strings.TrimSpace(item)
		shown := item
		if len(shown) > 40 {
			shown = shown[:40] + "..."
		}
		bad := func(reason string) (faultMix, error) {
			return nil, &FaultSpecError{Item: shown, Reason: reason}
		}
		name, rest, ok := strings.Cut(item, "=")
		if !ok {
			return bad("want kind=weight or kind=weight@share")
		}
		info, ok := lookupFault(faultKind(strings.TrimSpace(name)))
		if !ok {
			return bad("unknown kind (see -help)")
		}
		if seen[info.kind] {
			return bad("kind given twice")
		}
		seen[info.kind] = true
		wstr, sstr, hasShare := strings.Cut(rest, "@")
		w, err := strconv.Atoi(strings.TrimSpace(wstr))
		if err != nil || w < 0 || w > 1000 {
			return bad("weight must be an integer from 0 to 1000")
		}
		share := info.share
		if hasShare {
			if info.kind == faultCalm {
				return bad("calm takes no share")
			}
			s, err := strconv.ParseFloat(strings.TrimSpace(sstr), 64)
			if err != nil || !(s > 0 && s <= 1) {
				return bad("share must be a number in (0, 1]")
			}
			share = s
		}
		total += w
		if w > 0 {
			mix = append(mix, mixEntry{kind: info.kind, weight: w, share: share})
		}
	}
	if total == 0 {
		return nil, &FaultSpecError{Item: spec, Reason: "total weight is 0 (use \"none\" for no faults)"}
	}
	return mix, nil
}

func (m faultMix) String() string {
	parts := make([]string, 0, len(m))
	for _, e := range m {
		s := string(e.kind) + "=" + strconv.Itoa(e.weight)
		if info, _ := lookupFault(e.kind); e.kind != faultCalm && e.share != info.share {
			s += "@" + strconv.FormatFloat(e.share, 'g', -1, 64)
		}
		parts = append(parts, s)
	}
	return strings.Join(parts, ",")
}

// schedule deals episodes from a shuffled deck holding each kind as many
// times as its weight, so that every kind of the mix comes up once per
// deck: a short run still sees each of them.
type schedule struct {
	mix  faultMix
	rnd  *rand.Rand
	deck []mixEntry
}

func newSchedule(mix faultMix, rnd *rand.Rand) *schedule {
	return &schedule{mix: mix, rnd: rnd}
}

func (s *schedule) next() mixEntry {
	if len(s.deck) == 0 {
		for _, e := range s.mix {
			for range e.weight {
				s.deck = append(s.deck, e)
			}
		}
		s.rnd.Shuffle(len(s.deck), func(i, j int) { s.deck[i], s.deck[j] = s.deck[j], s.deck[i] })
	}
	e := s.deck[0]
	s.deck = s.deck[1:]
	return e
}

// episodeLength is the mean length of a fault episode for a run of d: a
// fortieth of the run, between 100 and 700 ms, so that a short test run
// still cycles through the whole mix.
func episodeLength(d time.Duration) time.Duration {
	return min(max(d/40, 100*time.Millisecond), 700*time.Millisecond)
}

// faultHelp documents the kinds for -help.
func faultHelp() string {
	var b strings.Builder
	kinds := append([]faultInfo(nil), faultCatalog...)
	sort.SliceStable(kinds, func(i, j int) bool { return kinds[i].kind == faultCalm })
	fmt.Fprintf(&b, "    %-16s %5s  %s\n", "kind", "share", "what an episode does")
	for _, f := range kinds {
		share := ""
		if f.kind != faultCalm {
			share = fmt.Sprintf("%.0f%%", f.share*100)
		}
		fmt.Fprintf(&b, "    %-16s %5s  %s\n", f.kind, share, f.what)
	}
	return b.String()
}
