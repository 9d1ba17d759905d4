package memory

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/dlock/dlock/lock"
)

func inspect(t testing.TB, m *Backend, q lock.KeyQuery) lock.KeyPage {
	t.Helper()
	p, err := m.InspectKeys(t.Context(), q)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestInspectWalk: a walk visits every held key once, whatever the page
// size and however short the scan budget makes the pages.
// TestInspectCursorPastShards: a cursor naming a shard the manager does not
// have is refused (the rest of InspectKeys is in package locktest).
func TestInspectCursorPastShards(t *testing.T) {
	m := newMemory(t, nil)
	if _, err := m.InspectKeys(t.Context(), lock.KeyQuery{Cursor: keyCursor{shard: 99}.String()}); !errors.Is(err, lock.ErrInvalid) {
		t.Fatalf("cursor past the shards: %v", err)
	}
}

func TestInspectWalk(t *testing.T) {
	m := newMemory(t, nil)
	const n = 3000
	for i := range n {
		mustLock(t, m, lockReq(lock.Pull, fmt.Sprint("res-", i), "h"))
		if i%3 == 0 {
			mustLock(t, m, lockReq(lock.Update, fmt.Sprint("res-", i), "h"))
		}
	}
	for i := range 500 { // free keys with records are walked over, not listed
		mustLock(t, m, lockReq(lock.Pull, fmt.Sprint("gone-", i), "g"))
		mustUnlock(t, m, lock.Pull, fmt.Sprint("gone-", i), "g", true)
	}
	want := n + n/3
	for _, c := range []struct{ limit, budget int }{{200, 1 << 16}, {37, 1 << 16}, {1000, 1 << 16}, {50, 40}} {
		t.Run(fmt.Sprintf("limit=%d,budget=%d", c.limit, c.budget), func(t *testing.T) {
			defer func(b int) { scanBudget = b }(scanBudget)
			scanBudget = c.budget
			seen := make(map[string]bool)
			cursor, pages := "", 0
			for {
				p := inspect(t, m, lock.KeyQuery{Cursor: cursor, Limit: c.limit})
				pages++
				if len(p.Keys) > min(c.limit, lock.MaxInspectLimit) {
					t.Fatalf("page of %d keys, limit %d", len(p.Keys), c.limit)
				}
				// One shard is read whole; the budget stops the walk at the
				// next shard.
				if p.Scanned > c.budget+4000/len(m.shards)*4 {
					t.Fatalf("a page examined %d keys", p.Scanned)
				}
				for _, k := range p.Keys {
					if seen[k.Key.String()] {
						t.Fatalf("%v listed twice", k.Key)
					}
					seen[k.Key.String()] = true
				}
				if p.Next == "" {
					break
				}
				cursor = p.Next
			}
			if len(seen) != want {
				t.Fatalf("walk saw %d keys in %d pages, want %d", len(seen), pages, want)
			}
		})
	}
}

func watchOps(t testing.TB, m *Backend) lock.OpStream {
	t.Helper()
	st, err := m.WatchOps(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(st.Close)
	return st
}

// TestOpFeedCostsNothingUnwatched: with nobody watching, no operator event
// is built, even while sessions make the manager build lock events.
func TestOpFeedCostsNothingUnwatched(t *testing.T) {
	m := newMemory(t, nil)
	work := func() {
		subscribe(t, m, "w", nil).Close()
		mustLock(t, m, lockReq(lock.Pull, "r", "a"))
		mustLock(t, m, lockReq(lock.Pull, "r", "b"))
		mustLock(t, m, lockReq(lock.Pull, "r", "c"))
		if _, err := m.Cancel(context.Background(), lock.Pull, "r", "c"); err != nil {
			t.Fatal(err)
		}
		mustUnlock(t, m, lock.Pull, "r", "a", false)
		mustUnlock(t, m, lock.Pull, "r", "b", true)
	}
	subscribe(t, m, "b", nil) // lock events are built for b's session
	work()
	if n := m.ops.built.Load(); n != 0 {
		t.Fatalf("%d operator events built while nobody watched", n)
	}
	ops := watchOps(t, m)
	work()
	if n := m.ops.built.Load(); n == 0 || len(ops.Take(nil)) != int(n) {
		t.Fatalf("watched: %d events built", n)
	}
	ops.Close()
	before := m.ops.built.Load()
	work()
	if n := m.ops.built.Load(); n != before {
		t.Fatalf("%d operator events built after the watcher left", n-before)
	}
}

func TestOpFeedSlowClosed(t *testing.T) {
	m := newMemory(t, func(c *Config) { c.StreamBuffer = 2 })
	ops := watchOps(t, m)
	for range 3 {
		mustLock(t, m, lockReq(lock.Pull, "r", "a"))
		mustUnlock(t, m, lock.Pull, "r", "a", true)
	}
	select {
	case <-ops.Done():
	default:
		t.Fatal("an operator stream that stopped reading was not closed")
	}
	if !ops.Slow() || m.Stats().SlowStreams != 1 || m.ops.n.Load() != 0 {
		t.Fatalf("slow=%v stats=%+v watchers=%d", ops.Slow(), m.Stats(), m.ops.n.Load())
	}
	_ = m.Close()
	if _, err := m.WatchOps(t.Context()); !errors.Is(err, lock.ErrClosed) {
		t.Fatalf("WatchOps after Close: %v", err)
	}
}
