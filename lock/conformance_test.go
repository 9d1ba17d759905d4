package lock_test

import (
	"testing"

	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/locktest"
)

// TestConformance holds Memory to the rules every backend follows
// (package locktest). Its timers follow the time package, so the fake-time
// tests run too.
func TestConformance(t *testing.T) {
	locktest.Run(t, func(t *testing.T, cfg lock.Config) lock.Backend {
		m, err := lock.NewMemory(t.Context(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		return m
	})
}
