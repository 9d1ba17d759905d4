package memory

import (
	"strconv"
	"testing"
	"testing/synctest"
	"time"
	"unsafe"

	"github.com/dlock/dlock/lock"
)

// TestStructSizes: a key and an entry stay at the 64 bytes docs/DESIGN.md
// ("What a held lock costs") counts them at; the lock delay hangs off the
// waitQueue rather than grow either.
func TestStructSizes(t *testing.T) {
	if n := unsafe.Sizeof(keyState{}); n != 64 {
		t.Errorf("keyState takes %d bytes, want 64", n)
	}
	if n := unsafe.Sizeof(entry{}); n != 64 {
		t.Errorf("entry takes %d bytes, want 64", n)
	}
}

// TestLockDelayLeavesNothing: a delay's entry leaves the shard's heap at
// the delay's end, and a key nobody asked for in it, without a completion
// record, is forgotten then and not before.
func TestLockDelayLeavesNothing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemory(t, func(c *Config) {
			c.Shards = 1
			c.CompletedRetention = 0
			c.LockTTL = 10 * time.Second
			c.LockDelay = 5 * time.Second
		})
		s := m.shards[0]
		mustLock(t, m, lockReq(lock.Pull, "r", "a"))
		time.Sleep(10 * time.Second)
		synctest.Wait()
		s.mu.Lock()
		ks, heap := s.key(lock.Key{Type: lock.Pull, Resource: "r"}), len(s.leases)
		s.mu.Unlock()
		if ks == nil || ks.holder != nil || heap != 1 {
			t.Fatalf("in the delay: key %v, %d deadlines in the heap; want the key kept, free, with its delay's", ks, heap)
		}
		if st := m.Stats(); st.Keys != 1 || st.Held != 0 || st.Expiries != 1 {
			t.Fatalf("stats in the delay: %+v", st)
		}
		checkKeys(t, m)
		time.Sleep(5 * time.Second)
		synctest.Wait()
		s.mu.Lock()
		ks, heap = s.key(lock.Key{Type: lock.Pull, Resource: "r"}), len(s.leases)
		s.mu.Unlock()
		if ks != nil || heap != 0 {
			t.Fatalf("after the delay: key %v, %d deadlines in the heap; want both gone", ks, heap)
		}
		if st := m.Stats(); st.Keys != 0 || st.Expiries != 1 {
			t.Fatalf("stats after the delay: %+v", st)
		}
	})
}

// TestLockDelayMassSessionLoss: more delays than one step of the timer
// (endStep) end together, each key handed to its waiter in its turn.
func TestLockDelayMassSessionLoss(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const n = 3*endStep + 7
		m := newMemory(t, func(c *Config) {
			c.Shards = 1
			c.SessionGrace = time.Second
			c.LockDelay = 5 * time.Second
		})
		lost := subscribe(t, m, "lost", nil)
		sw := subscribe(t, m, "w", nil)
		for i := range n {
			mustLock(t, m, lockReq(lock.Pull, "r"+strconv.Itoa(i), "lost"))
			mustLock(t, m, lockReq(lock.Pull, "r"+strconv.Itoa(i), "w"))
		}
		lost.Close()
		time.Sleep(time.Second + 5*time.Second - time.Millisecond)
		synctest.Wait()
		if st := m.Stats(); st.Held != 0 || st.Queued != n || st.SessionsLost != 1 {
			t.Fatalf("in the delays: %+v, want %d waiters and no holder", st, n)
		}
		if got := events(sw); len(got) != 0 {
			t.Fatalf("w was told %d events in the delays", len(got))
		}
		time.Sleep(time.Millisecond)
		synctest.Wait()
		if st := m.Stats(); st.Held != n || st.Queued != 0 || st.Handoffs != n {
			t.Fatalf("after the delays: %+v, want every key handed to w", st)
		}
		if got := events(sw); len(got) != n {
			t.Fatalf("w was told %d events, want %d grants", len(got), n)
		}
		checkKeys(t, m)
	})
}

// TestLockDelayPromotionRefused: at a delay's end each delete waiter that
// the references now refuse is told so and leaves, as at any hand-off, and
// the key is left free with its completion record.
func TestLockDelayPromotionRefused(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemory(t, func(c *Config) {
			c.RefStore = &memRefStore{}
			c.LockTTL = 10 * time.Second
			c.LockDelay = 5 * time.Second
		})
		sw := subscribe(t, m, "w", nil)
		sz := subscribe(t, m, "z", nil)
		mustLock(t, m, lockReq(lock.Delete, "r", "d"))
		mustLock(t, m, lockReq(lock.Delete, "r", "w"))
		time.Sleep(10 * time.Second)
		synctest.Wait()
		mustLock(t, m, lockReq(lock.Delete, "r", "z"))
		// A reference appears in the delay, as a restart with a stored
		// one would leave it: the promotion check must catch it.
		s := m.shardFor("r")
		s.mu.Lock()
		s.refs["r"] = &refState{nodes: map[string]struct{}{"n": {}}}
		s.mu.Unlock()
		time.Sleep(5 * time.Second)
		synctest.Wait()
		ev := events(sw)
		if len(ev) != 1 || ev[0].Event.Name != lock.EventOperationCompleted || ev[0].Event.Error != "in_use" {
			t.Fatalf("the refused waiter was told %v", names(ev))
		}
		if got := events(sz); len(got) != 1 || got[0].Event.Error != "in_use" {
			t.Fatalf("z, refused next, was told %v", names(got))
		}
		if st := status(t, m, lock.Delete, "r", ""); st.Held || st.QueueLength != 0 || st.LastCompleted == nil || st.LastCompleted.Error != "lock expired" {
			t.Fatalf("after the refusals: %+v", st)
		}
		checkKeys(t, m)
	})
}
