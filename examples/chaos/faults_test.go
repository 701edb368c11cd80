package main

import (
	"errors"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestParseFaultsDefault(t *testing.T) {
	mix, err := parseFaults(defaultFaults)
	require.NoError(t, err)
	require.Len(t, mix, len(faultCatalog), "the default mix uses every kind")
	require.Equal(t, defaultFaults, mix.String())
	for _, e := range mix {
		info, ok := lookupFault(e.kind)
		require.True(t, ok)
		require.Equal(t, info.share, e.share, "default share of %s", e.kind)
	}
}

func TestParseFaults(t *testing.T) {
	mix, err := parseFaults(" reset=2@0.5 , 5xx-after-commit=1, calm=0 ")
	require.NoError(t, err)
	require.Equal(t, faultMix{{kind: faultReset, weight: 2, share: 0.5}, {kind: fault5xxAfterCommit, weight: 1, share: 0.3}}, mix)
	require.Equal(t, "reset=2@0.5,5xx-after-commit=1", mix.String())

	for _, none := range []string{"none", "", "  "} {
		mix, err := parseFaults(none)
		require.NoError(t, err)
		require.Equal(t, faultMix{{kind: faultCalm, weight: 1}}, mix)
	}

	for spec, reason := range map[string]string{
		"reset":                       "want kind=weight",
		"bogus=1":                     "unknown kind",
		"reset=1,reset=2":             "twice",
		"reset=-1":                    "weight",
		"reset=1001":                  "weight",
		"reset=x":                     "weight",
		"reset=1@0":                   "share",
		"reset=1@1.5":                 "share",
		"reset=1@NaN":                 "share",
		"calm=1@0.5":                  "calm takes no share",
		"calm=0,reset=0":              "total weight is 0",
		"reset=1,,5xx-after-commit=1": "want kind=weight",
		strings.Repeat("a", 100):      "want kind=weight",
	} {
		_, err := parseFaults(spec)
		require.ErrorIs(t, err, ErrFaultSpec, spec)
		var fe *FaultSpecError
		require.True(t, errors.As(err, &fe))
		require.Contains(t, fe.Reason, reason, spec)
		require.LessOrEqual(t, len(fe.Item), 43, "the item is truncated for display")
	}
}

func FuzzParseFaults(f *testing.F) {
	for _, s := range []string{defaultFaults, "none", "reset=2@0.5", "calm=0", "x=1", "5xx-after-commit=1@1,abort=3@0.01", "=,@"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, spec string) {
		mix, err := parseFaults(spec)
		if err != nil {
			require.ErrorIs(t, err, ErrFaultSpec)
			require.Nil(t, mix)
			return
		}
		require.NotEmpty(t, mix)
		total := 0
		for _, e := range mix {
			require.Positive(t, e.weight)
			total += e.weight
			if e.kind != faultCalm {
				require.True(t, e.share > 0 && e.share <= 1)
			}
		}
		require.Positive(t, total)
		// What String prints parses back to the same mix.
		again, err := parseFaults(mix.String())
		require.NoError(t, err)
		require.Equal(t, mix, again)
	})
}

func TestScheduleDealsEveryKindOncePerDeck(t *testing.T) {
	mix, err := parseFaults("calm=3,reset=1,503=2")
	require.NoError(t, err)
	s := newSchedule(mix, rand.New(rand.NewPCG(1, 2)))
	for range 4 { // four full decks of 6
		got := map[faultKind]int{}
		for range 6 {
			got[s.next().kind]++
		}
		require.Equal(t, map[faultKind]int{faultCalm: 3, faultReset: 1, fault503: 2}, got)
	}
}

func TestEpisodeLength(t *testing.T) {
	require.Equal(t, 100*time.Millisecond, episodeLength(time.Second))
	require.Equal(t, 250*time.Millisecond, episodeLength(10*time.Second))
	require.Equal(t, 700*time.Millisecond, episodeLength(time.Hour))
}

func TestFaultHelpListsEveryKind(t *testing.T) {
	h := faultHelp()
	for _, f := range faultCatalog {
		require.Contains(t, h, string(f.kind))
	}
	require.True(t, strings.HasPrefix(strings.TrimSpace(h), "kind"))
}
