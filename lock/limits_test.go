package lock

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"testing/synctest"
	"time"
	"unicode/utf8"
)

// Tests of the limits of docs/SECURITY.md: identifiers, error texts, replay
// logs, sessions, queues, keys, and the cost of a mass session loss.

func TestTruncateError(t *testing.T) {
	cases := []struct {
		name, in string
		cut      bool
	}{
		{"empty", "", false},
		{"short", "disk full", false},
		{"exactly the limit", strings.Repeat("x", MaxErrorLen), false},
		{"one byte over", strings.Repeat("x", MaxErrorLen+1), true},
		{"two-byte characters", strings.Repeat("é", 40000), true},
		{"four-byte characters", strings.Repeat("🔒", 1000), true},
		{"invalid UTF-8", "bad \xff\xfe byte", false},
		{"long and invalid", strings.Repeat("\xff\x41", 2000), true},
	}
	for _, c := range cases {
		got, cut := TruncateError(c.in)
		if cut != c.cut || len(got) > MaxErrorLen || !utf8.ValidString(got) {
			t.Errorf("%s: got %d bytes, cut=%v, valid=%v; want at most %d valid bytes, cut=%v", c.name, len(got), cut, utf8.ValidString(got), MaxErrorLen, c.cut)
			continue
		}
		if !cut {
			if utf8.ValidString(c.in) && got != c.in {
				t.Errorf("%s: changed to %q", c.name, got)
			}
			continue
		}
		head, ok := strings.CutSuffix(got, "…")
		if !ok || len(got) < MaxErrorLen-3 {
			t.Errorf("%s: %d bytes ending %q, want about %d ending with …", c.name, len(got), got[max(0, len(got)-6):], MaxErrorLen)
		}
		if utf8.ValidString(c.in) && !strings.HasPrefix(c.in, head) {
			t.Errorf("%s: the kept part is not a prefix of the text", c.name)
		}
	}
}

// queueWork is the queue work spent on key k so far.
func queueWork(m *Memory, k Key) uint64 {
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
		k := Key{Pull, "K"}
		mustLock(t, m, LockRequest{Type: Pull, Resource: "K", Node: "holder", Lease: LeaseTTL})
		var lost []Stream
		var live []string
		for i := range n {
			node := fmt.Sprintf("n%d", i)
			if i%10 == 0 {
				live = append(live, node)
				mustLock(t, m, LockRequest{Type: Pull, Resource: "K", Node: node, Lease: LeaseTTL})
				continue
			}
			lost = append(lost, subscribe(t, m, node, nil))
			mustLock(t, m, lockReq(Pull, "K", node))
		}
		before := queueWork(m, k)
		for _, st := range lost {
			st.Close()
		}
		time.Sleep(2 * time.Second)
		synctest.Wait()
		work := queueWork(m, k) - before
		if st := status(t, m, Pull, "K", ""); st.QueueLength != len(live) {
			t.Fatalf("queue of %d, want the %d live waiters", st.QueueLength, len(live))
		}
		t.Logf("removing %d lost waiters visited %d queue slots", len(lost), work)
		if work > 4*n {
			t.Fatalf("removing %d lost waiters visited %d queue slots, want O(n): at most %d", len(lost), work, 4*n)
		}
		for i, node := range live {
			if p := status(t, m, Pull, "K", node).Position; p != i+1 {
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
		k := Key{Pull, "K"}
		mustLock(t, m, lockReq(Pull, "K", "holder"))
		time.Sleep(5 * time.Second)
		for i := range n {
			mustLock(t, m, lockReq(Pull, "K", "w"+strconv.Itoa(i)))
		}
		before := queueWork(m, k)
		time.Sleep(4 * time.Second)
		mustLock(t, m, lockReq(Pull, "K", "holder")) // renewed until 19 s
		time.Sleep(7 * time.Second)                  // the waiters' ttl ran out at 15 s
		synctest.Wait()
		st := status(t, m, Pull, "K", "")
		if st.Holder != "holder" || st.QueueLength != 0 || m.Stats().Expiries != n {
			t.Fatalf("after the waiters' ttl: %+v, %d expiries", st, m.Stats().Expiries)
		}
		if work := queueWork(m, k) - before; work > 4*n {
			t.Fatalf("expiring %d waiters visited %d queue slots, want at most %d", n, work, 4*n)
		}
	})
}
