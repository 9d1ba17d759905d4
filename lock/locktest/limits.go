package locktest

import (
	"context"
	"errors"
	"strings"
	"testing"
	"testing/synctest"
	"time"
	"unicode/utf8"

	"github.com/dlock/dlock/lock"
)

// The limits of docs/SECURITY.md: identifiers, error texts, sessions,
// queues, keys and watchers, each refused with its sentinel error and
// counted in Stats.

var limitTests = []test{
	{name: "IDRules", run: testIDRules},
	{name: "ErrorTextBounded", run: testErrorTextBounded},
	{name: "MaxKeys", run: testMaxKeys},
	{name: "MaxQueue", run: testMaxQueue},
	{name: "MaxSessions", fakeTime: true, run: testMaxSessions},
	{name: "MaxSessionsPerNode", run: testMaxSessionsPerNode},
	{name: "MaxWatchers", run: testMaxWatchers},
}

func testIDRules(t *testing.T, s *suite) {
	m := s.open(t, nil)
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
		if _, err := m.TryLock(context.Background(), lockReq(lock.Pull, "r", id)); !errors.Is(err, lock.ErrInvalid) {
			t.Errorf("node id with %s (%q): %v, want ErrInvalid", name, id, err)
		}
		if _, err := m.TryLock(context.Background(), lockReq(lock.Pull, id, "a")); !errors.Is(err, lock.ErrInvalid) {
			t.Errorf("resource id with %s (%q): %v, want ErrInvalid", name, id, err)
		}
		if _, _, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: id}); !errors.Is(err, lock.ErrInvalid) {
			t.Errorf("stream of a node id with %s (%q): %v, want ErrInvalid", name, id, err)
		}
	}
	if st := m.Stats(); st.Keys != 0 || st.Sessions != 0 {
		t.Fatalf("refused ids left state: %+v", st)
	}
	for _, id := range []string{"sha256:0123abcd", "ノード-1", "café", "a b", "a\u200Db", "🔒"} {
		if _, err := m.TryLock(context.Background(), lockReq(lock.Pull, id, id)); err != nil {
			t.Errorf("id %q refused: %v", id, err)
		}
	}
}

// testErrorTextBounded: an unlock's error text of 60 KiB is kept, in the
// completion record and in the events, cut to MaxErrorLen.
func testErrorTextBounded(t *testing.T, s *suite) {
	m := s.open(t, nil)
	obs := subscribe(t, m, "", &lock.Key{Type: lock.Pull, Resource: "r"})
	waiter := subscribe(t, m, "w", nil)
	long := strings.Repeat("é", 30<<10)
	mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	mustLock(t, m, lockReq(lock.Pull, "r", "w"))
	if _, err := m.Unlock(context.Background(), lock.UnlockRequest{Type: lock.Pull, Resource: "r", Node: "a", Success: true, Error: long}); err != nil {
		t.Fatal(err)
	}
	check := func(where, got string) {
		t.Helper()
		head, ok := strings.CutSuffix(got, "…")
		if !ok || len(got) > lock.MaxErrorLen || !utf8.ValidString(got) || !strings.HasPrefix(long, head) {
			t.Errorf("%s: error of %d bytes (%q…), want at most %d, a prefix of the text, ending with …", where, len(got), got[:min(len(got), 8)], lock.MaxErrorLen)
		}
	}
	st := status(t, m, lock.Pull, "r", "")
	if st.LastCompleted == nil {
		t.Fatal("no completion record")
	}
	check("completion record", st.LastCompleted.Error)
	for _, c := range []struct {
		name string
		got  []lock.Delivery
	}{{"observer", expect(t, obs, 2)}, {"waiter", expect(t, waiter, 1)}} {
		var done []*lock.Event
		for _, d := range c.got {
			if d.Event.Name == lock.EventOperationCompleted {
				done = append(done, d.Event)
			}
		}
		if len(done) != 1 {
			t.Fatalf("%s got %d operation_completed events, want 1", c.name, len(done))
		}
		check(c.name+"'s event", done[0].Error)
	}
	if n := m.Stats().TruncatedErrors; n != 1 {
		t.Fatalf("TruncatedErrors = %d, want 1", n)
	}
	// The retry of that unlock is recognised though its text was cut.
	r, err := m.Unlock(context.Background(), lock.UnlockRequest{Type: lock.Pull, Resource: "r", Node: "a", Success: true, Error: long})
	if err != nil || !r.Replayed {
		t.Fatalf("retried unlock: %+v %v, want replayed", r, err)
	}
}

func testMaxKeys(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.ExactLimits = true; c.MaxKeys = 2; c.CompletedRetention = 0 })
	mustLock(t, m, lockReq(lock.Pull, "r1", "a"))
	mustLock(t, m, lockReq(lock.Update, "r1", "a"))
	_, err := m.TryLock(context.Background(), lockReq(lock.Pull, "r2", "a"))
	if !errors.Is(err, lock.ErrTooManyKeys) {
		t.Fatalf("a third key: %v, want ErrTooManyKeys", err)
	}
	// Keys that exist take waiters and renewals.
	if r := mustLock(t, m, lockReq(lock.Pull, "r1", "b")); !r.Queued {
		t.Fatalf("waiter on an existing key: %+v", r)
	}
	mustLock(t, m, lockReq(lock.Pull, "r1", "a"))
	// A key that became free makes room.
	mustUnlock(t, m, lock.Update, "r1", "a", true)
	if r := mustLock(t, m, lockReq(lock.Pull, "r2", "a")); !r.Acquired {
		t.Fatalf("after a key went: %+v", r)
	}
	if st := m.Stats(); st.RefusedKeys != 1 || st.Keys != 2 {
		t.Fatalf("stats %+v, want 1 refusal and 2 keys", st)
	}
}

func testMaxQueue(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.MaxQueue = 2 })
	mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	mustLock(t, m, lockReq(lock.Pull, "r", "b"))
	mustLock(t, m, lockReq(lock.Pull, "r", "c"))
	if _, err := m.TryLock(context.Background(), lockReq(lock.Pull, "r", "d")); !errors.Is(err, lock.ErrQueueFull) {
		t.Fatalf("third waiter: %v, want ErrQueueFull", err)
	}
	// Waiters and the holder renew; another type of the resource is another queue.
	if r := mustLock(t, m, lockReq(lock.Pull, "r", "c")); !r.Queued || r.Position != 2 {
		t.Fatalf("waiter's renewal at a full queue: %+v", r)
	}
	mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	mustLock(t, m, lockReq(lock.Update, "r", "d"))
	mustUnlock(t, m, lock.Pull, "r", "a", false)
	if r := mustLock(t, m, lockReq(lock.Pull, "r", "d")); !r.Queued || r.Position != 2 {
		t.Fatalf("after a hand-off made room: %+v", r)
	}
	if st := m.Stats(); st.RefusedQueue != 1 || st.Queued != 2 {
		t.Fatalf("stats %+v, want 1 refusal and 2 waiters", st)
	}
}

func testMaxSessions(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.MaxSessions = 2; c.SessionGrace = 5 * time.Second })
	sa := subscribe(t, m, "a", nil)
	subscribe(t, m, "b", nil)
	sa2 := subscribe(t, m, "a", nil) // another stream of a session that exists
	if _, _, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: "c"}); !errors.Is(err, lock.ErrTooManySessions) {
		t.Fatalf("third session's stream: %v, want ErrTooManySessions", err)
	}
	// A session lease would open a session: refused, and nothing is left.
	_, err := m.TryLock(context.Background(), lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "c", Lease: lock.LeaseSession})
	if !errors.Is(err, lock.ErrTooManySessions) {
		t.Fatalf("session lease for a third node: %v, want ErrTooManySessions", err)
	}
	if st := m.Stats(); st.Keys != 0 || st.Sessions != 2 {
		t.Fatalf("a refused lock left state: %+v", st)
	}
	// Without a session the lease is ttl; switching it to session is refused.
	if r := mustLock(t, m, lockReq(lock.Pull, "r", "c")); !r.Acquired {
		t.Fatalf("ttl lock: %+v", r)
	}
	if _, err := m.TryLock(context.Background(), lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "c", Lease: lock.LeaseSession}); !errors.Is(err, lock.ErrTooManySessions) {
		t.Fatalf("switching to a session lease: %v, want ErrTooManySessions", err)
	}
	if st := status(t, m, lock.Pull, "r", ""); st.Holder != "c" {
		t.Fatalf("the refused switch lost the hold: %+v", st)
	}
	// A session that ends makes room.
	sa.Close()
	sa2.Close()
	time.Sleep(6 * time.Second)
	synctest.Wait()
	st, _, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: "c"})
	if err != nil {
		t.Fatalf("after a session ended: %v", err)
	}
	st.Close()
	if s := m.Stats(); s.RefusedSessions != 3 {
		t.Fatalf("RefusedSessions = %d, want 3", s.RefusedSessions)
	}
}

func testMaxSessionsPerNode(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.MaxSessionsPerNode = 2 })
	s1 := subscribe(t, m, "a", nil)
	subscribe(t, m, "a", nil)
	if _, _, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: "a"}); !errors.Is(err, lock.ErrTooManySessions) {
		t.Fatalf("third stream of a node: %v, want ErrTooManySessions", err)
	}
	subscribe(t, m, "b", nil)
	subscribe(t, m, "", &lock.Key{Type: lock.Pull, Resource: "r"}) // observers are not a node's streams
	s1.Close()
	subscribe(t, m, "a", nil)
	if n := m.Stats().RefusedNodeStreams; n != 1 {
		t.Fatalf("RefusedNodeStreams = %d, want 1", n)
	}
}

// testMaxWatchers: observers of keys and operator feeds share one bound; a
// refused session stream that also asked to observe gives its place back.
// A backend that is no lock.Inspector has no operator feeds: a second
// observer takes the feed's place.
func testMaxWatchers(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.MaxWatchers = 2; c.MaxSessionsPerNode = 1 })
	in, isInspector := m.(lock.Inspector)
	if !isInspector {
		t.Log("the backend is no lock.Inspector: observers stand in for operator feeds")
	}
	// watch opens an operator feed, or an observer of key t.
	watch := func() (func(), error) {
		if isInspector {
			ops, err := in.WatchOps(t.Context())
			if err != nil {
				return nil, err
			}
			t.Cleanup(ops.Close)
			return ops.Close, nil
		}
		st, _, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Observe: &lock.Key{Type: lock.Pull, Resource: "t"}})
		if err != nil {
			return nil, err
		}
		t.Cleanup(st.Close)
		return st.Close, nil
	}
	o1 := subscribe(t, m, "", &lock.Key{Type: lock.Pull, Resource: "r"})
	closeFeed, err := watch()
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Observe: &lock.Key{Type: lock.Pull, Resource: "s"}}); !errors.Is(err, lock.ErrTooManyWatchers) {
		t.Fatalf("third watcher: %v, want ErrTooManyWatchers", err)
	}
	if _, err := watch(); !errors.Is(err, lock.ErrTooManyWatchers) {
		t.Fatalf("operator feed past the bound: %v, want ErrTooManyWatchers", err)
	}
	subscribe(t, m, "a", nil) // a session stream is no watcher
	o1.Close()
	if _, _, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: "a", Observe: &lock.Key{Type: lock.Pull, Resource: "r"}}); !errors.Is(err, lock.ErrTooManySessions) {
		t.Fatalf("second stream of a: %v, want ErrTooManySessions", err)
	}
	subscribe(t, m, "", &lock.Key{Type: lock.Pull, Resource: "r"}) // the refused stream gave its place back
	closeFeed()
	if _, err := watch(); err != nil {
		t.Fatalf("after a feed closed: %v", err)
	}
	if n := m.Stats().RefusedWatchers; n != 2 {
		t.Fatalf("RefusedWatchers = %d, want 2", n)
	}
}
