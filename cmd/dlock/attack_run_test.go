package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/dlock/dlock/internal/dlocktest"
)

// TestAttackRunUnvouchedGrant: a server grants the lock but vouches for
// nothing (guaranteed_ms 0: an etcd-backed server that lost etcd just as
// it granted, or one with a bug). The client takes such a hold as lost
// when Lock returns; dlock run must then not start the command at all.
// (It used to start it, see Lost closed, send SIGTERM, and, Result.Margin
// being 0, fall back to --kill-after, 5 s, for SIGKILL: the command ran on
// a hold nobody vouched for.)
func TestAttackRunUnvouchedGrant(t *testing.T) {
	srv := dlocktest.Start(t, dlocktest.Options{Wrap: dlocktest.RewriteAnswers("/lock", func(_ int, body []byte) []byte {
		var m map[string]any
		if json.Unmarshal(body, &m) == nil && m["acquired"] == true {
			m["guaranteed_ms"] = 0
			body, _ = json.Marshal(m)
		}
		return body
	})})
	ran := filepath.Join(t.TempDir(), "ran")
	_, errOut, st := dlock(t, srv.URL(), "run", "--resource", "r", "--", "touch", ran)
	if _, err := os.Stat(ran); err == nil {
		t.Fatalf("the command ran on a grant vouched for 0 ms (status %d, %s)", st, errOut)
	}
	if st != ExitLockLost {
		t.Fatalf("status %d, want %d (lock lost): %s", st, ExitLockLost, errOut)
	}
}
