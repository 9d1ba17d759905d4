package lock

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
)

func inspect(t testing.TB, m *Memory, q KeyQuery) KeyPage {
	t.Helper()
	p, err := m.InspectKeys(t.Context(), q)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func keyNames(p KeyPage) []string {
	var out []string
	for _, k := range p.Keys {
		out = append(out, k.Key.String())
	}
	slices.Sort(out)
	return out
}

func waiterNames(v KeyView) string {
	var out []string
	for _, w := range v.Queue {
		out = append(out, w.Node)
	}
	return strings.Join(out, " ")
}

func TestInspectKeys(t *testing.T) {
	m := newMemory(t, nil)
	mustLock(t, m, lockReq(Pull, "sha256:aa", "h"))
	for _, n := range []string{"w1", "w2", "w3"} {
		mustLock(t, m, lockReq(Pull, "sha256:aa", n))
	}
	mustLock(t, m, lockReq(Update, "sha256:aa", "u"))
	mustLock(t, m, lockReq(Pull, "sha256:bb", "x"))
	mustLock(t, m, lockReq(Pull, "done", "d"))
	mustUnlock(t, m, Pull, "done", "d", true) // free: only a record, not listed

	all := inspect(t, m, KeyQuery{})
	if got := keyNames(all); !slices.Equal(got, []string{"pull:sha256:aa", "pull:sha256:bb", "update:sha256:aa"}) || all.Next != "" {
		t.Fatalf("keys %v next %q", got, all.Next)
	}
	mustUnlock(t, m, Pull, "sha256:aa", "h", false) // hand-off to w1
	p := inspect(t, m, KeyQuery{Resource: "aa", Node: "w3"})
	if len(p.Keys) != 1 {
		t.Fatalf("filtered keys %v", keyNames(p))
	}
	v := p.Keys[0]
	if v.Holder != "w1" || v.Token == 0 || !v.Unclaimed || v.Lease != LeaseTTL || v.AcquiredAt.IsZero() ||
		waiterNames(v) != "w2 w3" || v.QueueLength != 2 || v.LastCompleted == nil || v.LastCompleted.Node != "h" || v.LastCompleted.Success {
		t.Fatalf("view %+v", v)
	}
	for _, c := range []struct {
		q    KeyQuery
		want []string
	}{
		{KeyQuery{Node: "h"}, []string{"pull:sha256:aa"}}, // its last completion
		{KeyQuery{Node: "u"}, []string{"update:sha256:aa"}},
		{KeyQuery{Node: "d"}, nil},
		{KeyQuery{Resource: "bb"}, []string{"pull:sha256:bb"}},
		{KeyQuery{Resource: "sha256:"}, []string{"pull:sha256:aa", "pull:sha256:bb", "update:sha256:aa"}},
		{KeyQuery{Resource: "zz"}, nil},
	} {
		if got := keyNames(inspect(t, m, c.q)); !slices.Equal(got, c.want) {
			t.Errorf("%+v: %v, want %v", c.q, got, c.want)
		}
	}
	if _, err := m.InspectKeys(t.Context(), KeyQuery{Cursor: "bogus!"}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("bad cursor: %v", err)
	}
	if _, err := m.InspectKeys(t.Context(), KeyQuery{Cursor: keyCursor{shard: 99}.String()}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("cursor past the shards: %v", err)
	}
}

func TestInspectQueueCapped(t *testing.T) {
	m := newMemory(t, nil)
	mustLock(t, m, lockReq(Pull, "r", "h"))
	for i := range QueueShown + 10 {
		mustLock(t, m, lockReq(Pull, "r", fmt.Sprint("w", i)))
	}
	v := inspect(t, m, KeyQuery{}).Keys[0]
	if len(v.Queue) != QueueShown || v.QueueLength != QueueShown+10 || v.Queue[0].Node != "w0" || v.Queue[QueueShown-1].Node != fmt.Sprint("w", QueueShown-1) {
		t.Fatalf("queue %d of %d, first %v", len(v.Queue), v.QueueLength, v.Queue[0])
	}
}

// TestInspectWalk: a walk visits every held key once, whatever the page
// size and however short the scan budget makes the pages.
func TestInspectWalk(t *testing.T) {
	m := newMemory(t, nil)
	const n = 3000
	for i := range n {
		mustLock(t, m, lockReq(Pull, fmt.Sprint("res-", i), "h"))
		if i%3 == 0 {
			mustLock(t, m, lockReq(Update, fmt.Sprint("res-", i), "h"))
		}
	}
	for i := range 500 { // free keys with records are walked over, not listed
		mustLock(t, m, lockReq(Pull, fmt.Sprint("gone-", i), "g"))
		mustUnlock(t, m, Pull, fmt.Sprint("gone-", i), "g", true)
	}
	want := n + n/3
	for _, c := range []struct{ limit, budget int }{{200, 1 << 16}, {37, 1 << 16}, {1000, 1 << 16}, {50, 40}} {
		t.Run(fmt.Sprintf("limit=%d,budget=%d", c.limit, c.budget), func(t *testing.T) {
			defer func(b int) { scanBudget = b }(scanBudget)
			scanBudget = c.budget
			seen := make(map[string]bool)
			cursor, pages := "", 0
			for {
				p := inspect(t, m, KeyQuery{Cursor: cursor, Limit: c.limit})
				pages++
				if len(p.Keys) > min(c.limit, MaxInspectLimit) {
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

func TestRecentCompletions(t *testing.T) {
	m := newMemory(t, nil)
	for i := range 5 {
		res := fmt.Sprint("r", i)
		mustLock(t, m, lockReq(Pull, res, fmt.Sprint("n", i%2)))
		mustUnlock(t, m, Pull, res, fmt.Sprint("n", i%2), i != 3)
	}
	got, err := m.RecentCompletions(t.Context(), KeyQuery{Limit: 3})
	if err != nil {
		t.Fatal(err)
	}
	var order []string
	for _, c := range got {
		order = append(order, fmt.Sprintf("%s:%s:%v", c.Key.Resource, c.Node, c.Success))
	}
	if want := "r4:n0:true r3:n1:false r2:n0:true"; strings.Join(order, " ") != want {
		t.Fatalf("completions %v, want %s", order, want)
	}
	got, _ = m.RecentCompletions(t.Context(), KeyQuery{Node: "n1"})
	if len(got) != 2 || got[0].Key.Resource != "r3" || got[1].Key.Resource != "r1" {
		t.Fatalf("node filter: %+v", got)
	}
	got, _ = m.RecentCompletions(t.Context(), KeyQuery{Resource: "2"})
	if len(got) != 1 || got[0].Key.Resource != "r2" {
		t.Fatalf("resource filter: %+v", got)
	}
}

func TestInspectSessions(t *testing.T) {
	m := newMemory(t, nil)
	var streams []Stream
	for i := range 7 {
		streams = append(streams, subscribe(t, m, fmt.Sprint("node-", i), nil))
	}
	subscribe(t, m, "node-0", nil)
	mustLock(t, m, LockRequest{Type: Pull, Resource: "r", Node: "node-0", Lease: LeaseSession})
	mustLock(t, m, LockRequest{Type: Pull, Resource: "r", Node: "node-1", Lease: LeaseSession})
	streams[6].Close()
	var seen []SessionView
	cursor := ""
	for {
		p, err := m.InspectSessions(t.Context(), SessionQuery{Cursor: cursor, Limit: 3})
		if err != nil {
			t.Fatal(err)
		}
		if len(p.Sessions) > 3 || p.Total != 7 {
			t.Fatalf("page %+v", p)
		}
		seen = append(seen, p.Sessions...)
		if cursor = p.Next; cursor == "" {
			break
		}
	}
	if len(seen) != 7 || seen[0] != (SessionView{Node: "node-0", Streams: 2, Keys: 1}) ||
		seen[1] != (SessionView{Node: "node-1", Streams: 1, Keys: 1}) || seen[6] != (SessionView{Node: "node-6", InGrace: true}) {
		t.Fatalf("sessions %+v", seen)
	}
	p, _ := m.InspectSessions(t.Context(), SessionQuery{Node: "-5"})
	if len(p.Sessions) != 1 || p.Sessions[0].Node != "node-5" || p.Next != "" {
		t.Fatalf("filtered %+v", p)
	}
}

func watchOps(t testing.TB, m *Memory) OpStream {
	t.Helper()
	st, err := m.WatchOps(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(st.Close)
	return st
}

func opNames(evs []OpEvent) []string {
	var out []string
	for _, ev := range evs {
		switch {
		case ev.Event != nil:
			out = append(out, ev.Event.Name+":"+ev.Event.Node)
		case ev.Session.Ended:
			out = append(out, "session_ended:"+ev.Session.Node)
		default:
			out = append(out, fmt.Sprintf("session:%s:%d", ev.Session.Node, ev.Session.Streams))
		}
	}
	return out
}

// TestOpFeed: the operator feed reports every transition of a key in
// order, queue joins and leaves included, and session changes.
func TestOpFeed(t *testing.T) {
	m := newMemory(t, nil)
	ops := watchOps(t, m)
	mustLock(t, m, lockReq(Pull, "r", "a"))
	mustLock(t, m, lockReq(Pull, "r", "b"))
	mustLock(t, m, lockReq(Pull, "r", "c"))
	if _, err := m.Cancel(context.Background(), Pull, "r", "c"); err != nil {
		t.Fatal(err)
	}
	mustUnlock(t, m, Pull, "r", "a", false)
	mustLock(t, m, lockReq(Pull, "r", "d"))
	mustUnlock(t, m, Pull, "r", "b", true)
	s := subscribe(t, m, "n", nil)
	s.Close()
	got := strings.Join(opNames(ops.Take(nil)), " ")
	want := "lock_assigned:a queue_joined:b queue_joined:c queue_left:c lock_assigned:b operation_completed:a " +
		"queue_joined:d operation_completed:b session:n:1 session:n:0"
	if got != want {
		t.Fatalf("feed\n got %s\nwant %s", got, want)
	}
}

// TestOpFeedCostsNothingUnwatched: with nobody watching, no operator event
// is built, even while sessions make the manager build lock events.
func TestOpFeedCostsNothingUnwatched(t *testing.T) {
	m := newMemory(t, nil)
	work := func() {
		subscribe(t, m, "w", nil).Close()
		mustLock(t, m, lockReq(Pull, "r", "a"))
		mustLock(t, m, lockReq(Pull, "r", "b"))
		mustLock(t, m, lockReq(Pull, "r", "c"))
		if _, err := m.Cancel(context.Background(), Pull, "r", "c"); err != nil {
			t.Fatal(err)
		}
		mustUnlock(t, m, Pull, "r", "a", false)
		mustUnlock(t, m, Pull, "r", "b", true)
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
		mustLock(t, m, lockReq(Pull, "r", "a"))
		mustUnlock(t, m, Pull, "r", "a", true)
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
	if _, err := m.WatchOps(t.Context()); !errors.Is(err, ErrClosed) {
		t.Fatalf("WatchOps after Close: %v", err)
	}
}

// TestInspectQueueWithHoles: waiters that leave from the middle and the head
// leave holes in the queue's slice (shard.go, qremove); the view skips them
// and keeps the order. It read the slice as if it had none, and a nil waiter
// panicked under the shard mutex.
func TestInspectQueueWithHoles(t *testing.T) {
	m := newMemory(t, nil)
	mustLock(t, m, lockReq(Pull, "r", "h"))
	for i := range 5 {
		mustLock(t, m, lockReq(Pull, "r", fmt.Sprint("w", i)))
	}
	for _, n := range []string{"w2", "w0"} {
		if _, err := m.Cancel(t.Context(), Pull, "r", n); err != nil {
			t.Fatal(err)
		}
	}
	v := inspect(t, m, KeyQuery{}).Keys[0]
	if got := waiterNames(v); got != "w1 w3 w4" || v.QueueLength != 3 {
		t.Fatalf("queue %q (%d), want w1 w3 w4 (3)", got, v.QueueLength)
	}
}
