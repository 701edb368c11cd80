package idempotency

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestReaperObserverSeesUnfinishedRecordsWithTheirAge(t *testing.T) {
	s := NewMemoryStore()
	now := reapT0.Add(100 * time.Hour)
	seed(t, s, "stuck", reapT0, false) // in progress for 100 h
	seed(t, s, "done", reapT0, true)   // completed: not unfinished
	seed(t, s, "running", now, false)  // in progress, lease alive
	var got []Event
	log, _ := bufLogger()
	r := NewReaper(s, ReaperConfig{Logger: log, Observer: Observer{
		Unfinished: func(_ context.Context, e Event) { got = append(got, e) },
	}})
	rep, err := r.ReapOnce(t.Context(), now)
	require.NoError(t, err)
	require.Len(t, rep.Unfinished, 1)
	require.Len(t, got, 1)
	require.Equal(t, "stuck", got[0].Scope.Key)
	require.Equal(t, 100*time.Hour, got[0].Duration)
	require.Equal(t, int64(1), got[0].Generation)
}
