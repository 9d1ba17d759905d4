package memory

import (
	"sync"
	"testing"

	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/locktest"
)

// TestConformance holds the memory engine to the rules every backend
// follows (package locktest). Its timers follow the time package, so the
// fake-time tests run too.
func TestConformance(t *testing.T) {
	var mu sync.Mutex
	stores := map[*testing.T]*memRefStore{} // a restart's references: one store per test
	locktest.Run(t, func(t *testing.T, cfg locktest.Config) lock.Backend {
		c := DefaultConfig()
		c.Rules = cfg.Rules
		if cfg.ExactLimits {
			c.Shards = 1 // MaxKeys and CompletedMax are checked per shard
		}
		if cfg.RefCounting {
			mu.Lock()
			if stores[t] == nil {
				stores[t] = &memRefStore{}
			}
			c.RefStore = stores[t]
			mu.Unlock()
		}
		m, err := New(t.Context(), c)
		if err != nil {
			t.Fatal(err)
		}
		return m
	})
}
