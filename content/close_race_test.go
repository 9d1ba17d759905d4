package content

import (
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/internal/dlocktest"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/lock"
)

// TestUnlockRetryNotStartedOnceClosing: an unlock that fails for a reason
// worth retrying, in a call that began before Close, starts no retry once
// Close has begun: Close waits for the retries, and one added during its
// Wait would outlive it, or make Wait panic. Here the server refuses every
// /unlock with 503, and the store is as Close leaves it before it cancels:
// a retry started would try for ever, and the wait below would not end.
func TestUnlockRetryNotStartedOnceClosing(t *testing.T) {
	srv := dlocktest.Start(t, dlocktest.Options{RefCount: true, Wrap: func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/unlock" {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusServiceUnavailable)
				w.Write([]byte(`{"error":"unavailable","code":"unavailable","message":"etcd did not answer"}` + "\n"))
				return
			}
			next.ServeHTTP(w, r)
		})
	}})
	c := &client.Client{Server: srv.URL(), Node: "a", MaxRetries: -1, RequestTimeout: 500 * time.Millisecond}
	s, err := New(t.Context(), Config{Root: t.TempDir(), Client: c})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	defer s.Close()
	req := client.Request{Type: lock.Pull, Resource: blobDigest.String()}
	if _, err := c.Release(t.Context(), req, 1, nil); err == nil || !retryableUnlock(err) {
		t.Fatalf("the server's /unlock: %v, want an error worth retrying", err)
	}
	s.mu.Lock()
	s.closing = true
	s.mu.Unlock()
	s.unlock(t.Context(), req, 1, errors.New("download failed"))
	waited := make(chan struct{})
	go func() {
		s.wg.Wait()
		close(waited)
	}()
	select {
	case <-waited:
	case <-time.After(kit.Patience):
		t.Fatal("an unlock's retry started after Close began")
	}
}
