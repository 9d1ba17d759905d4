package main

import (
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/internal/dlocktest"
	"github.com/dlock/dlock/lock"
)

// refusingServer runs a dlock server whose first `refusals` answers to
// /lock are 429 queue_full with Retry-After: 1, as a server at its limit
// answers. It returns the URL and the count of /lock requests.
func refusingServer(t *testing.T, refusals int64) (string, *atomic.Int64) {
	var locks atomic.Int64
	srv := dlocktest.Start(t, dlocktest.Options{Wrap: func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/lock" && locks.Add(1) <= refusals {
				status, body := api.ErrorResponse(lock.ErrQueueFull)
				w.Header().Set("Retry-After", "1")
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(status)
				w.Write([]byte(`{"error":"` + body.Error + `","code":"` + body.Code + `","message":"` + body.Message + `"}`))
				return
			}
			next.ServeHTTP(w, r)
		})
	}})
	return srv.URL(), &locks
}

// TestRunRetriesLoadRefusals: `dlock run` rides out 429s with Retry-After
// and runs the command; with too few --max-retries it gives up with the
// server's error.
func TestRunRetriesLoadRefusals(t *testing.T) {
	srv, locks := refusingServer(t, 2)
	ran := filepath.Join(t.TempDir(), "ran")
	if _, errOut, st := dlock(t, srv, "run", "--resource", "r", "--", "touch", ran); st != 0 {
		t.Fatalf("run against a server refusing twice: status %d, %s", st, errOut)
	}
	if _, err := os.Stat(ran); err != nil {
		t.Fatalf("the command did not run: %v", err)
	}
	if n := locks.Load(); n != 3 {
		t.Fatalf("%d /lock requests, want 3 (two refused, then granted)", n)
	}

	srv, locks = refusingServer(t, 3)
	_, errOut, st := dlock(t, srv, "run", "--resource", "r", "--max-retries", "1", "--", "true")
	if st != 1 || !strings.Contains(errOut, "queue_full") || locks.Load() != 2 {
		t.Fatalf("--max-retries 1 against three refusals: status %d after %d requests, %q; want 1 after 2 with queue_full", st, locks.Load(), errOut)
	}
}
