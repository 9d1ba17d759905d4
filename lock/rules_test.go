package lock

import (
	"strings"
	"testing"
	"time"
)

// TestRulesLockDelay: the lock delay is off by default, and a negative one
// is refused by name.
func TestRulesLockDelay(t *testing.T) {
	r := DefaultRules()
	if r.LockDelay != 0 {
		t.Fatalf("default lock delay %v, want 0 (off)", r.LockDelay)
	}
	if err := r.Validate(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	r.LockDelay = 10 * time.Second
	if err := r.Validate(); err != nil {
		t.Fatalf("a lock delay of 10s: %v", err)
	}
	r.LockDelay = -time.Second
	if err := r.Validate(); err == nil || !strings.Contains(err.Error(), "lock delay") {
		t.Fatalf("a negative lock delay: %v, want an error naming it", err)
	}
}
