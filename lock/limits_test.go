package lock

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"testing/synctest"
	"time"
	"unicode/utf8"
)

// Tests of the limits of docs/SECURITY.md: identifiers, error texts, replay
// logs, sessions, queues, keys, and the cost of a mass session loss.

func TestIDRules(t *testing.T) {
	m := newMemory(t, nil)
	refused := map[string]string{
		"U+FFFD (what encoding/json makes of a lone surrogate)": "a\uFFFD",
		"invalid UTF-8":              "a\xff",
		"a surrogate encoded raw":    "a\xed\xa0\x80",
		"a C1 control":               "a\u0085",
		"DEL":                        "a\x7f",
		"right-to-left override":     "a\u202Eb",
		"left-to-right embedding":    "a\u202A",
		"pop directional formatting": "a\u202C",
		"first strong isolate":       "a\u2068",
		"pop directional isolate":    "a\u2069",
		"left-to-right mark":         "a\u200E",
		"right-to-left mark":         "a\u200F",
		"arabic letter mark":         "a\u061C",
	}
	for name, id := range refused {
		if _, err := m.TryLock(context.Background(), lockReq(Pull, "r", id)); !errors.Is(err, ErrInvalid) {
			t.Errorf("node id with %s (%q): %v, want ErrInvalid", name, id, err)
		}
		if _, err := m.TryLock(context.Background(), lockReq(Pull, id, "a")); !errors.Is(err, ErrInvalid) {
			t.Errorf("resource id with %s (%q): %v, want ErrInvalid", name, id, err)
		}
		if _, _, err := m.Subscribe(t.Context(), SubscribeRequest{Node: id}); !errors.Is(err, ErrInvalid) {
			t.Errorf("stream of a node id with %s (%q): %v, want ErrInvalid", name, id, err)
		}
	}
	if st := m.Stats(); st.Keys != 0 || st.Sessions != 0 {
		t.Fatalf("refused ids left state: %+v", st)
	}
	for _, id := range []string{"sha256:0123abcd", "ノード-1", "café", "a b", "a\u200Db", "🔒"} {
		if _, err := m.TryLock(context.Background(), lockReq(Pull, id, id)); err != nil {
			t.Errorf("id %q refused: %v", id, err)
		}
	}
}

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
		got, cut := truncateError(c.in)
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

// TestErrorTextBounded: an unlock's error text of 60 KiB is kept, in the
// completion record and in the events, cut to MaxErrorLen.
func TestErrorTextBounded(t *testing.T) {
	m := newMemory(t, nil)
	obs := subscribe(t, m, "", &Key{Pull, "r"})
	waiter := subscribe(t, m, "w", nil)
	long := strings.Repeat("é", 30<<10)
	mustLock(t, m, lockReq(Pull, "r", "a"))
	mustLock(t, m, lockReq(Pull, "r", "w"))
	if _, err := m.Unlock(context.Background(), UnlockRequest{Type: Pull, Resource: "r", Node: "a", Success: true, Error: long}); err != nil {
		t.Fatal(err)
	}
	check := func(where, got string) {
		t.Helper()
		head, ok := strings.CutSuffix(got, "…")
		if !ok || len(got) > MaxErrorLen || !utf8.ValidString(got) || !strings.HasPrefix(long, head) {
			t.Errorf("%s: error of %d bytes (%q…), want at most %d, a prefix of the text, ending with …", where, len(got), got[:min(len(got), 8)], MaxErrorLen)
		}
	}
	st := status(t, m, Pull, "r", "")
	if st.LastCompleted == nil {
		t.Fatal("no completion record")
	}
	check("completion record", st.LastCompleted.Error)
	for name, s := range map[string]Stream{"observer": obs, "waiter": waiter} {
		var done []*Event
		for _, d := range events(s) {
			if d.Event.Name == EventOperationCompleted {
				done = append(done, d.Event)
			}
		}
		if len(done) != 1 {
			t.Fatalf("%s got %d operation_completed events, want 1", name, len(done))
		}
		check(name+"'s event", done[0].Error)
	}
	if n := m.Stats().TruncatedErrors; n != 1 {
		t.Fatalf("TruncatedErrors = %d, want 1", n)
	}
	// The retry of that unlock is recognised though its text was cut.
	r, err := m.Unlock(context.Background(), UnlockRequest{Type: Pull, Resource: "r", Node: "a", Success: true, Error: long})
	if err != nil || !r.Replayed {
		t.Fatalf("retried unlock: %+v %v, want replayed", r, err)
	}
}

func TestMaxKeys(t *testing.T) {
	m := newMemory(t, func(c *Config) { c.Shards = 1; c.MaxKeys = 2; c.CompletedRetention = 0 })
	mustLock(t, m, lockReq(Pull, "r1", "a"))
	mustLock(t, m, lockReq(Update, "r1", "a"))
	_, err := m.TryLock(context.Background(), lockReq(Pull, "r2", "a"))
	if !errors.Is(err, ErrTooManyKeys) {
		t.Fatalf("a third key: %v, want ErrTooManyKeys", err)
	}
	// Keys that exist take waiters and renewals.
	if r := mustLock(t, m, lockReq(Pull, "r1", "b")); !r.Queued {
		t.Fatalf("waiter on an existing key: %+v", r)
	}
	mustLock(t, m, lockReq(Pull, "r1", "a"))
	// A key that became free makes room.
	mustUnlock(t, m, Update, "r1", "a", true)
	if r := mustLock(t, m, lockReq(Pull, "r2", "a")); !r.Acquired {
		t.Fatalf("after a key went: %+v", r)
	}
	if st := m.Stats(); st.RefusedKeys != 1 || st.Keys != 2 {
		t.Fatalf("stats %+v, want 1 refusal and 2 keys", st)
	}
}

func TestMaxQueue(t *testing.T) {
	m := newMemory(t, func(c *Config) { c.MaxQueue = 2 })
	mustLock(t, m, lockReq(Pull, "r", "a"))
	mustLock(t, m, lockReq(Pull, "r", "b"))
	mustLock(t, m, lockReq(Pull, "r", "c"))
	if _, err := m.TryLock(context.Background(), lockReq(Pull, "r", "d")); !errors.Is(err, ErrQueueFull) {
		t.Fatalf("third waiter: %v, want ErrQueueFull", err)
	}
	// Waiters and the holder renew; another type of the resource is another queue.
	if r := mustLock(t, m, lockReq(Pull, "r", "c")); !r.Queued || r.Position != 2 {
		t.Fatalf("waiter's renewal at a full queue: %+v", r)
	}
	mustLock(t, m, lockReq(Pull, "r", "a"))
	mustLock(t, m, lockReq(Update, "r", "d"))
	mustUnlock(t, m, Pull, "r", "a", false)
	if r := mustLock(t, m, lockReq(Pull, "r", "d")); !r.Queued || r.Position != 2 {
		t.Fatalf("after a hand-off made room: %+v", r)
	}
	if st := m.Stats(); st.RefusedQueue != 1 || st.Queued != 2 {
		t.Fatalf("stats %+v, want 1 refusal and 2 waiters", st)
	}
}

func TestMaxSessions(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemory(t, func(c *Config) { c.MaxSessions = 2; c.SessionGrace = 5 * time.Second })
		sa := subscribe(t, m, "a", nil)
		subscribe(t, m, "b", nil)
		subscribe(t, m, "a", nil) // another stream of a session that exists
		if _, _, err := m.Subscribe(t.Context(), SubscribeRequest{Node: "c"}); !errors.Is(err, ErrTooManySessions) {
			t.Fatalf("third session's stream: %v, want ErrTooManySessions", err)
		}
		// A session lease would open a session: refused, and nothing is left.
		_, err := m.TryLock(context.Background(), LockRequest{Type: Pull, Resource: "r", Node: "c", Lease: LeaseSession})
		if !errors.Is(err, ErrTooManySessions) {
			t.Fatalf("session lease for a third node: %v, want ErrTooManySessions", err)
		}
		if st := m.Stats(); st.Keys != 0 || st.Sessions != 2 {
			t.Fatalf("a refused lock left state: %+v", st)
		}
		// Without a session the lease is ttl; switching it to session is refused.
		if r := mustLock(t, m, lockReq(Pull, "r", "c")); !r.Acquired {
			t.Fatalf("ttl lock: %+v", r)
		}
		if _, err := m.TryLock(context.Background(), LockRequest{Type: Pull, Resource: "r", Node: "c", Lease: LeaseSession}); !errors.Is(err, ErrTooManySessions) {
			t.Fatalf("switching to a session lease: %v, want ErrTooManySessions", err)
		}
		if st := status(t, m, Pull, "r", ""); st.Holder != "c" {
			t.Fatalf("the refused switch lost the hold: %+v", st)
		}
		// A session that ends makes room.
		sa.Close()
		for _, st := range slices.Clone(m.sess.get("a").streams) {
			st.Close()
		}
		time.Sleep(6 * time.Second)
		synctest.Wait()
		st, _, err := m.Subscribe(t.Context(), SubscribeRequest{Node: "c"})
		if err != nil {
			t.Fatalf("after a session ended: %v", err)
		}
		st.Close()
		if s := m.Stats(); s.RefusedSessions != 3 {
			t.Fatalf("RefusedSessions = %d, want 3", s.RefusedSessions)
		}
	})
}

func TestMaxSessionsPerNode(t *testing.T) {
	m := newMemory(t, func(c *Config) { c.MaxSessionsPerNode = 2 })
	s1 := subscribe(t, m, "a", nil)
	subscribe(t, m, "a", nil)
	if _, _, err := m.Subscribe(t.Context(), SubscribeRequest{Node: "a"}); !errors.Is(err, ErrTooManySessions) {
		t.Fatalf("third stream of a node: %v, want ErrTooManySessions", err)
	}
	subscribe(t, m, "b", nil)
	subscribe(t, m, "", &Key{Pull, "r"}) // observers are not a node's streams
	s1.Close()
	subscribe(t, m, "a", nil)
	if n := m.Stats().RefusedNodeStreams; n != 1 {
		t.Fatalf("RefusedNodeStreams = %d, want 1", n)
	}
}

// TestReplayBoundedInBytes: a session's log keeps what fits in
// SessionLogBytes, a replay from further back gets that and says where it
// starts, and a replay from within the log is whole.
func TestReplayBoundedInBytes(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemory(t, func(c *Config) { c.SessionLogBytes = MinSessionLogBytes; c.SessionGrace = 5 * time.Second })
		st, first, _ := m.Subscribe(t.Context(), SubscribeRequest{Node: "w"})
		text := strings.Repeat("<x>", 100) // escaped to 6 bytes a bracket
		for i := range 60 {
			r := "r" + strconv.Itoa(i)
			mustLock(t, m, lockReq(Pull, r, "a"))
			mustLock(t, m, lockReq(Pull, r, "w"))
			if _, err := m.Unlock(context.Background(), UnlockRequest{Type: Pull, Resource: r, Node: "a", Success: true, Error: text}); err != nil {
				t.Fatal(err)
			}
		}
		seen := events(st)
		if len(seen) != 60 {
			t.Fatalf("stream got %d events, want 60", len(seen))
		}
		st.Close()
		_, sub, err := m.Subscribe(t.Context(), SubscribeRequest{Node: "w", HasLast: true})
		if err != nil {
			t.Fatal(err)
		}
		size := 0
		for _, d := range sub.Replay {
			size += d.Event.WireSize()
		}
		n := len(sub.Replay)
		if n == 0 || n >= 60 || size > MinSessionLogBytes || size+seen[0].Event.WireSize() <= MinSessionLogBytes {
			t.Fatalf("replayed %d events of %d bytes, want the newest that fit in %d", n, size, MinSessionLogBytes)
		}
		if !slices.Equal(ids(sub.Replay), ids(seen[60-n:])) {
			t.Fatalf("replayed %v, want the newest %d of %v", ids(sub.Replay), n, ids(seen))
		}
		if !sub.Missed || sub.ID != seen[60-n-1].ID {
			t.Fatalf("subscribed id %d missed=%v, want %d (the newest event let go) and missed", sub.ID, sub.Missed, seen[60-n-1].ID)
		}
		// From the subscribed id, or from within the log, the replay is whole.
		for _, last := range []uint64{sub.ID, seen[60-n+1].ID} {
			_, again, _ := m.Subscribe(t.Context(), SubscribeRequest{Node: "w", LastID: last, HasLast: true})
			if again.Missed || again.ID != last || len(again.Replay) == 0 || again.Replay[0].ID <= last || again.Replay[len(again.Replay)-1].ID != seen[59].ID {
				t.Fatalf("replay after %d: id %d missed=%v %v", last, again.ID, again.Missed, ids(again.Replay))
			}
		}
		// The first subscription's id is older than what the log keeps.
		if _, again, _ := m.Subscribe(t.Context(), SubscribeRequest{Node: "w", LastID: first.ID, HasLast: true}); !again.Missed {
			t.Fatal("a replay from before the log's start did not report the gap")
		}
		// A session that ended and began anew cannot replay the old one.
		for _, s := range slices.Clone(m.sess.get("w").streams) {
			s.Close()
		}
		time.Sleep(6 * time.Second)
		synctest.Wait()
		s2, again, _ := m.Subscribe(t.Context(), SubscribeRequest{Node: "w", LastID: seen[59].ID, HasLast: true})
		defer s2.Close()
		if !again.Missed || len(again.Replay) != 0 {
			t.Fatalf("replay into a new session: missed=%v %d events, want missed and none", again.Missed, len(again.Replay))
		}
		if n := m.Stats().ReplayGaps; n != 3 {
			t.Fatalf("ReplayGaps = %d, want 3", n)
		}
	})
}

func ids(ds []Delivery) []uint64 {
	out := make([]uint64, len(ds))
	for i, d := range ds {
		out[i] = d.ID
	}
	return out
}

// TestMassSessionLoss: hundreds of sessions lost at once, holders and
// waiters on shared keys: every waiter of theirs leaves, every hold passes
// to the first live waiter in FIFO order, and no lost waiter is ever
// granted on the way.
func TestMassSessionLoss(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const n = 700 // several steps of endStep
		m := newMemory(t, func(c *Config) { c.SessionGrace = 5 * time.Second })
		subscribe(t, m, "A", nil)
		sb := subscribe(t, m, "B", nil)
		obs := subscribe(t, m, "", &Key{Pull, "K"})
		lost := make([]Stream, n)
		node := func(i int) string { return "L" + strconv.Itoa(i) }
		for i := range lost {
			lost[i] = subscribe(t, m, node(i), nil)
		}
		// K: held by L0; waiters L1…L299, A, L300…L499, B.
		mustLock(t, m, lockReq(Pull, "K", node(0)))
		for i := 1; i < 500; i++ {
			if i == 300 {
				mustLock(t, m, lockReq(Pull, "K", "A"))
			}
			mustLock(t, m, lockReq(Pull, "K", node(i)))
		}
		mustLock(t, m, lockReq(Pull, "K", "B"))
		// Keys held by L500… with A waiting, and B waiting behind lost waiters.
		for i := 500; i < n; i++ {
			k := "own" + strconv.Itoa(i)
			mustLock(t, m, lockReq(Update, k, node(i)))
			mustLock(t, m, lockReq(Update, k, node((i+1-500)%200+500)))
			mustLock(t, m, lockReq(Update, k, "A"))
		}
		events(obs)
		events(sb)
		// L1 comes back within the grace, then goes again: its grace restarts.
		lost[1].Close()
		time.Sleep(3 * time.Second)
		back := subscribe(t, m, node(1), nil)
		for _, st := range lost {
			st.Close()
		}
		back.Close()
		time.Sleep(3 * time.Second) // L1's first grace would be over
		synctest.Wait()
		if st := status(t, m, Pull, "K", node(1)); st.Position != 1 {
			t.Fatalf("a session whose stream came back was ended early: %+v", st)
		}
		time.Sleep(3 * time.Second)
		synctest.Wait()
		if st := status(t, m, Pull, "K", "B"); st.Holder != "A" || st.QueueLength != 1 || st.Position != 1 {
			t.Fatalf("K after the loss: %+v, want A holding and B next", st)
		}
		if got := names(events(obs)); !slices.Equal(got, []string{"lock_assigned:A", "operation_completed:" + node(0)}) {
			t.Fatalf("K's observer saw %v, want A's grant and L0's completion only", got)
		}
		for i := 500; i < n; i++ {
			if st := status(t, m, Update, "own"+strconv.Itoa(i), ""); st.Holder != "A" || st.QueueLength != 0 {
				t.Fatalf("own%d: %+v, want A holding alone", i, st)
			}
		}
		if st := m.Stats(); st.SessionsLost != n || st.Sessions != 2 || st.Queued != 1 || st.Held != 1+n-500 {
			t.Fatalf("stats %+v", st)
		}
		if len(events(sb)) != 0 {
			t.Fatal("B was told something though it only moved up")
		}
	})
}

// queueWork is the queue work spent on key k so far.
func queueWork(m *Memory, k Key) uint64 {
	s := m.shardFor(k.Resource)
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.key(k).qwork
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

// TestMaxWatchers: observers of keys and operator feeds share one bound; a
// refused session stream that also asked to observe gives its place back.
func TestMaxWatchers(t *testing.T) {
	m := newMemory(t, func(c *Config) { c.MaxWatchers = 2; c.MaxSessionsPerNode = 1 })
	o1 := subscribe(t, m, "", &Key{Pull, "r"})
	ops, err := m.WatchOps(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := m.Subscribe(t.Context(), SubscribeRequest{Observe: &Key{Pull, "s"}}); !errors.Is(err, ErrTooManyWatchers) {
		t.Fatalf("third watcher: %v, want ErrTooManyWatchers", err)
	}
	if _, err := m.WatchOps(t.Context()); !errors.Is(err, ErrTooManyWatchers) {
		t.Fatalf("operator feed past the bound: %v, want ErrTooManyWatchers", err)
	}
	subscribe(t, m, "a", nil) // a session stream is no watcher
	o1.Close()
	if _, _, err := m.Subscribe(t.Context(), SubscribeRequest{Node: "a", Observe: &Key{Pull, "r"}}); !errors.Is(err, ErrTooManySessions) {
		t.Fatalf("second stream of a: %v, want ErrTooManySessions", err)
	}
	subscribe(t, m, "", &Key{Pull, "r"}) // the refused stream gave its place back
	ops.Close()
	if _, err := m.WatchOps(t.Context()); err != nil {
		t.Fatalf("after a feed closed: %v", err)
	}
	if n := m.Stats().RefusedWatchers; n != 2 {
		t.Fatalf("RefusedWatchers = %d, want 2", n)
	}
}
