package locktest

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/dlock/dlock/lock"
)

// Events and replay (docs/API.md, "GET /subscribe"): what a session stream
// and an observer receive, and what a reconnect with a last event id gets.

var eventTests = []test{
	{name: "Replay", run: testReplay},
	{name: "SessionAndObserver", run: testSessionAndObserver},
	{name: "SlowStreamClosed", run: testSlowStreamClosed},
	{name: "Notify", run: testNotify},
	{name: "SessionLogBounded", run: testSessionLogBounded},
	{name: "ReplayBoundedInBytes", fakeTime: true, run: testReplayBoundedInBytes},
}

// noGrace is a session grace no test outlives: tests that close and reopen
// a session stream in real time keep the session.
func noGrace(c *Config) { c.SessionGrace = time.Hour }

func testReplay(t *testing.T, s *suite) {
	m := s.open(t, noGrace)
	st, sub, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: "b"})
	if err != nil {
		t.Fatal(err)
	}
	mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	mustLock(t, m, lockReq(lock.Pull, "r", "b"))
	mustLock(t, m, lockReq(lock.Pull, "s", "a"))
	mustLock(t, m, lockReq(lock.Pull, "s", "b"))
	st.Close()
	mustUnlock(t, m, lock.Pull, "r", "a", false) // b gets r while disconnected
	mustUnlock(t, m, lock.Pull, "s", "a", true)  // s done while disconnected
	st2, sub2, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: "b", LastID: sub.ID, HasLast: true})
	if err != nil {
		t.Fatal(err)
	}
	if sub2.ID != sub.ID || sub2.Missed {
		t.Fatalf("subscribed id %d missed=%v, want the last id %d", sub2.ID, sub2.Missed, sub.ID)
	}
	got := names(sub2.Replay)
	if want := []string{"lock_assigned:b", "operation_completed:a"}; !slices.Equal(got, want) {
		t.Fatalf("replayed %v, want %v", got, want)
	}
	if r := sub2.Replay; r[0].ID <= sub.ID || r[1].ID <= r[0].ID {
		t.Fatalf("replayed ids %v after %d, want increasing after it", ids(r), sub.ID)
	}
	if len(events(st2)) != 0 {
		t.Fatal("replayed events delivered twice")
	}
	// Replay from the middle.
	st2.Close()
	st3, sub3, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: "b", LastID: sub2.Replay[0].ID, HasLast: true})
	if err != nil {
		t.Fatal(err)
	}
	defer st3.Close()
	if len(sub3.Replay) != 1 || sub3.Replay[0].Event.Name != lock.EventOperationCompleted || sub3.Replay[0].ID != sub2.Replay[1].ID {
		t.Fatalf("replay after the first: %v", names(sub3.Replay))
	}
}

// testSessionAndObserver: a stream that is both a node's session and an
// observer of a key gets each event once, in order.
func testSessionAndObserver(t *testing.T, s *suite) {
	m := s.open(t, nil)
	both, _ := subscribeReq(t, m, lock.SubscribeRequest{Node: "b", Observe: &lock.Key{Type: lock.Pull, Resource: "r"}})
	mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	mustLock(t, m, lockReq(lock.Pull, "r", "b"))
	mustUnlock(t, m, lock.Pull, "r", "a", false)
	got := expect(t, both, 3)
	if want := []string{"lock_assigned:a", "lock_assigned:b", "operation_completed:a"}; !slices.Equal(names(got), want) {
		t.Fatalf("got %v, want %v (b's grant once)", names(got), want)
	}
	if !increasing(ids(got)) {
		t.Fatalf("event ids %v, want increasing", ids(got))
	}
}

func testSlowStreamClosed(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.StreamBuffer = 2 })
	st := subscribe(t, m, "", &lock.Key{Type: lock.Pull, Resource: "r"})
	keeps := subscribe(t, m, "", &lock.Key{Type: lock.Pull, Resource: "r"})
	for i := range 3 {
		mustLock(t, m, lockReq(lock.Pull, "r", "a"))
		mustUnlock(t, m, lock.Pull, "r", "a", i%2 == 0)
		expect(t, keeps, 2) // this one keeps up
	}
	select {
	case <-st.Done():
	case <-time.After(EventWait):
		t.Fatal("a stream that stopped reading was not closed")
	}
	if !st.Slow() || m.Stats().SlowStreams != 1 {
		t.Fatalf("slow=%v stats=%+v", st.Slow(), m.Stats())
	}
	// Others are unaffected.
	mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	if got := names(expect(t, keeps, 1)); !slices.Equal(got, []string{"lock_assigned:a"}) || keeps.Slow() {
		t.Fatalf("the stream that kept up got %v, slow=%v", got, keeps.Slow())
	}
}

// testNotify: a feed's Notify function is called at once when events are
// waiting already, again when events arrive after a Take emptied it, and
// when the feed ends, as the server's stream writers expect (docs/DESIGN.md,
// "Event streams").
func testNotify(t *testing.T, s *suite) {
	m := s.open(t, nil)
	st := subscribe(t, m, "a", nil)
	mustLock(t, m, lockReq(lock.Pull, "r", "a")) // waiting before Notify
	calls := make(chan struct{}, 16)
	notify := func() { calls <- struct{}{} }
	called := func(what string) {
		t.Helper()
		select {
		case <-calls:
		case <-time.After(EventWait):
			t.Fatalf("Notify's function was not called %s", what)
		}
	}
	expect(t, st, 1)
	mustLock(t, m, lockReq(lock.Pull, "s", "a"))
	st.Notify(notify)
	called("at once, with an event waiting")
	if got := names(st.Take(nil)); !slices.Equal(got, []string{"lock_assigned:a"}) {
		t.Fatalf("took %v, want s's grant", got)
	}
	mustLock(t, m, lockReq(lock.Pull, "t", "a"))
	called("when an event arrived")
	if got := names(st.Take(nil)); len(got) != 1 {
		t.Fatalf("took %v, want t's grant", got)
	}
	st.Close()
	called("when the feed ended")
	select {
	case <-st.Done():
	default:
		t.Fatal("Notify's function was called for the end before Done was closed")
	}
}

// testSessionLogBounded: a session keeps its last SessionLog events; a
// reconnect from within them replays them whole, one from before them
// replays what is kept and reports the gap.
func testSessionLogBounded(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.SessionLog = 8; noGrace(c) })
	st, first := subscribeReq(t, m, lock.SubscribeRequest{Node: "a"})
	var seen []lock.Delivery
	for range 50 {
		mustLock(t, m, lockReq(lock.Pull, "r", "a"))
		mustUnlock(t, m, lock.Pull, "r", "a", false)
		seen = append(seen, expect(t, st, 1)...)
	}
	if len(seen) != 50 {
		t.Fatalf("stream got %d events, want 50", len(seen))
	}
	if !increasing(append([]uint64{first.ID}, ids(seen)...)) {
		t.Fatalf("event ids %v after the subscribed %d, want increasing", ids(seen), first.ID)
	}
	st.Close()
	kept := seen[len(seen)-8:]
	// From 8 events back: those 8, in order.
	st2, sub := subscribeReq(t, m, lock.SubscribeRequest{Node: "a", LastID: seen[len(seen)-9].ID, HasLast: true})
	if !slices.Equal(ids(sub.Replay), ids(kept)) || sub.Missed || sub.ID != seen[len(seen)-9].ID {
		t.Fatalf("replayed %v (missed=%v, id %d), want %v", ids(sub.Replay), sub.Missed, sub.ID, ids(kept))
	}
	st2.Close()
	// From the start: the log holds 8, and says the rest is gone.
	st3, sub := subscribeReq(t, m, lock.SubscribeRequest{Node: "a", LastID: first.ID, HasLast: true})
	if !slices.Equal(ids(sub.Replay), ids(kept)) || !sub.Missed || sub.ID != seen[len(seen)-9].ID {
		t.Fatalf("replayed %v (missed=%v, id %d), want %v, missed, and the id of the newest event let go %d", ids(sub.Replay), sub.Missed, sub.ID, ids(kept), seen[len(seen)-9].ID)
	}
	st3.Close()
}

// testReplayBoundedInBytes: a session's log keeps what fits in
// SessionLogBytes, a replay from further back gets that and says where it
// starts, and a replay from within the log is whole.
func testReplayBoundedInBytes(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.SessionLogBytes = lock.MinSessionLogBytes; c.SessionGrace = 5 * time.Second })
	st, first, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: "w"})
	if err != nil {
		t.Fatal(err)
	}
	text := strings.Repeat("<x>", 100) // escaped to 6 bytes a bracket
	for i := range 60 {
		r := "r" + strconv.Itoa(i)
		mustLock(t, m, lockReq(lock.Pull, r, "a"))
		mustLock(t, m, lockReq(lock.Pull, r, "w"))
		if _, err := m.Unlock(context.Background(), lock.UnlockRequest{Type: lock.Pull, Resource: r, Node: "a", Success: true, Error: text}); err != nil {
			t.Fatal(err)
		}
	}
	seen := expect(t, st, 60)
	if len(seen) != 60 {
		t.Fatalf("stream got %d events, want 60", len(seen))
	}
	st.Close()
	var open []lock.Stream // w's streams, closed before its grace
	resubscribe := func(last uint64) lock.Subscription {
		t.Helper()
		st, sub, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: "w", LastID: last, HasLast: true})
		if err != nil {
			t.Fatal(err)
		}
		open = append(open, st)
		return sub
	}
	sub := resubscribe(0)
	size := 0
	for _, d := range sub.Replay {
		size += d.Event.WireSize()
	}
	n := len(sub.Replay)
	if n == 0 || n >= 60 || size > lock.MinSessionLogBytes || size+seen[0].Event.WireSize() <= lock.MinSessionLogBytes {
		t.Fatalf("replayed %d events of %d bytes, want the newest that fit in %d", n, size, lock.MinSessionLogBytes)
	}
	if !slices.Equal(ids(sub.Replay), ids(seen[60-n:])) {
		t.Fatalf("replayed %v, want the newest %d of %v", ids(sub.Replay), n, ids(seen))
	}
	if !sub.Missed || sub.ID != seen[60-n-1].ID {
		t.Fatalf("subscribed id %d missed=%v, want %d (the newest event let go) and missed", sub.ID, sub.Missed, seen[60-n-1].ID)
	}
	// From the subscribed id, or from within the log, the replay is whole.
	for _, last := range []uint64{sub.ID, seen[60-n+1].ID} {
		again := resubscribe(last)
		if again.Missed || again.ID != last || len(again.Replay) == 0 || again.Replay[0].ID <= last || again.Replay[len(again.Replay)-1].ID != seen[59].ID {
			t.Fatalf("replay after %d: id %d missed=%v %v", last, again.ID, again.Missed, ids(again.Replay))
		}
	}
	// The first subscription's id is older than what the log keeps.
	if again := resubscribe(first.ID); !again.Missed {
		t.Fatal("a replay from before the log's start did not report the gap")
	}
	// A session that ended and began anew cannot replay the old one.
	for _, st := range open {
		st.Close()
	}
	time.Sleep(6 * time.Second)
	synctest.Wait()
	s2, again, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: "w", LastID: seen[59].ID, HasLast: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if !again.Missed || len(again.Replay) != 0 {
		t.Fatalf("replay into a new session: missed=%v %d events, want missed and none", again.Missed, len(again.Replay))
	}
	if n := m.Stats().ReplayGaps; n != 3 {
		t.Fatalf("ReplayGaps = %d, want 3", n)
	}
}
