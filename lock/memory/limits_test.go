package memory

import (
	"fmt"
	"strconv"
	"testing"
	"testing/synctest"
	"time"

	"github.com/dlock/dlock/lock"
)

// queueWork is the queue work spent on key k so far.
func queueWork(m *Backend, k lock.Key) uint64 {
	s := m.shardFor(k.Resource)
	s.mu.Lock()
	defer s.mu.Unlock()
	if ks := s.key(k); ks != nil && ks.wq != nil {
		return ks.wq.work
	}
	return 0
}

// TestSessionLossCost: removing N lost waiters from one queue visits O(N)
// queue slots, not O(N²). The measure is a count, not a time.
func TestSessionLossCost(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const n = 5000
		m := newMemory(t, func(c *Config) { c.SessionGrace = time.Second })
		k := lock.Key{Type: lock.Pull, Resource: "K"}
		mustLock(t, m, lock.LockRequest{Type: lock.Pull, Resource: "K", Node: "holder", Lease: lock.LeaseTTL})
		var lost []lock.Stream
		var live []string
		for i := range n {
			node := fmt.Sprintf("n%d", i)
			if i%10 == 0 {
				live = append(live, node)
				mustLock(t, m, lock.LockRequest{Type: lock.Pull, Resource: "K", Node: node, Lease: lock.LeaseTTL})
				continue
			}
			lost = append(lost, subscribe(t, m, node, nil))
			mustLock(t, m, lockReq(lock.Pull, "K", node))
		}
		before := queueWork(m, k)
		for _, st := range lost {
			st.Close()
		}
		time.Sleep(2 * time.Second)
		synctest.Wait()
		work := queueWork(m, k) - before
		if st := status(t, m, lock.Pull, "K", ""); st.QueueLength != len(live) {
			t.Fatalf("queue of %d, want the %d live waiters", st.QueueLength, len(live))
		}
		t.Logf("removing %d lost waiters visited %d queue slots", len(lost), work)
		if work > 4*n {
			t.Fatalf("removing %d lost waiters visited %d queue slots, want O(n): at most %d", len(lost), work, 4*n)
		}
		for i, node := range live {
			if p := status(t, m, lock.Pull, "K", node).Position; p != i+1 {
				t.Fatalf("%s at position %d, want %d", node, p, i+1)
			}
		}
	})
}

// TestMassExpiry: a mass of ttl waiters expiring at once is removed in
// O(N) queue work too, in steps.
func TestMassExpiry(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const n = 3000
		m := newMemory(t, func(c *Config) { c.LockTTL = 10 * time.Second })
		k := lock.Key{Type: lock.Pull, Resource: "K"}
		mustLock(t, m, lockReq(lock.Pull, "K", "holder"))
		time.Sleep(5 * time.Second)
		for i := range n {
			mustLock(t, m, lockReq(lock.Pull, "K", "w"+strconv.Itoa(i)))
		}
		before := queueWork(m, k)
		time.Sleep(4 * time.Second)
		mustLock(t, m, lockReq(lock.Pull, "K", "holder")) // renewed until 19 s
		time.Sleep(7 * time.Second)                       // the waiters' ttl ran out at 15 s
		synctest.Wait()
		st := status(t, m, lock.Pull, "K", "")
		if st.Holder != "holder" || st.QueueLength != 0 || m.Stats().Expiries != n {
			t.Fatalf("after the waiters' ttl: %+v, %d expiries", st, m.Stats().Expiries)
		}
		if work := queueWork(m, k) - before; work > 4*n {
			t.Fatalf("expiring %d waiters visited %d queue slots, want at most %d", n, work, 4*n)
		}
	})
}
