package locktest

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"testing"
	"testing/synctest"
	"time"

	"github.com/dlock/dlock/lock"
)

// Leases (docs/DESIGN.md, "Leases"): what ends a hold or a queue entry
// whose caller went away. Every test here runs in fake time.

var leaseTests = []test{
	{name: "TTLExpiry", fakeTime: true, run: testTTLExpiry},
	{name: "TTLRenewedByStatus", fakeTime: true, run: testTTLRenewedByStatus},
	{name: "ClaimTimeoutAndMaxHold", fakeTime: true, run: testClaimTimeoutAndMaxHold},
	{name: "ClaimTimeoutOff", fakeTime: true, run: testClaimTimeoutOff},
	{name: "SessionLoss", fakeTime: true, run: testSessionLoss},
	{name: "SessionLeaseWithoutStream", fakeTime: true, run: testSessionLeaseWithoutStream},
	{name: "MassSessionLoss", fakeTime: true, run: testMassSessionLoss},
	{name: "CleanEndIsNotLost", fakeTime: true, run: testCleanEndIsNotLost},
	{name: "GuaranteeHolds", fakeTime: true, run: testGuaranteeHolds},
	{name: "Guaranteed", run: testGuaranteed},
}

// testCleanEndIsNotLost: a session whose streams closed while it held and
// waited for nothing ends as closed, not lost (docs/DESIGN.md, "Sessions
// and events"); one that held something is lost.
func testCleanEndIsNotLost(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.SessionGrace = 5 * time.Second })
	idle := subscribe(t, m, "idle", nil)
	holder := subscribe(t, m, "holder", nil)
	mustLock(t, m, lockReq(lock.Pull, "r", "holder"))
	idle.Close()
	holder.Close()
	time.Sleep(6 * time.Second)
	synctest.Wait()
	if st := m.Stats(); st.SessionsLost != 1 || st.SessionsClosed != 1 || st.Sessions != 0 {
		t.Fatalf("stats %+v: want one session lost (the holder's) and one closed (the idle one's)", st)
	}
}

// testGuaranteeHolds: whatever a backend answers as Guaranteed, the hold
// stands at least that long from the call, through a session's grace, a
// ttl lease and a max hold (docs/DESIGN.md, "Leases"): the key is handed
// on no sooner.
func testGuaranteeHolds(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) {
		c.SessionGrace = 5 * time.Second
		c.LockTTL = 20 * time.Second
		c.MaxHold = 60 * time.Second
		c.ClaimTimeout = 0
	})
	for _, tc := range []struct {
		name  string
		lease lock.Lease
		close bool // the holder's stream closes right after the grant: its grace runs
	}{
		{"session, streaming", lock.LeaseSession, false},
		{"session, in grace", lock.LeaseSession, true},
		{"ttl", lock.LeaseTTL, false},
	} {
		res := "g-" + strconv.Itoa(int(tc.lease)) + strconv.FormatBool(tc.close)
		st := subscribe(t, m, "h", nil)
		r := mustLock(t, m, lock.LockRequest{Type: lock.Pull, Resource: res, Node: "h", Lease: tc.lease})
		mustLock(t, m, lockReq(lock.Pull, res, "w"))
		if tc.close {
			st.Close()
		}
		g := r.Guaranteed
		if g <= 0 {
			t.Fatalf("%s: a grant with nothing guaranteed: %+v", tc.name, r)
		}
		start := time.Now()
		// Halfway, and just before the guarantee runs out, the key is
		// still h's.
		for _, at := range []time.Duration{g / 2, g - time.Nanosecond} {
			time.Sleep(at - time.Since(start))
			synctest.Wait()
			if got := status(t, m, lock.Pull, res, ""); got.Holder != "h" {
				t.Fatalf("%s: handed to %q after %v of a %v guarantee", tc.name, got.Holder, time.Since(start), g)
			}
		}
		if !tc.close {
			st.Close()
		}
		mustUnlock(t, m, lock.Pull, res, "h", true)
	}
	// A guarantee from /status counts from the status call.
	h := subscribe(t, m, "h2", nil)
	mustLock(t, m, lockReq(lock.Pull, "late", "h2"))
	h.Close()
	time.Sleep(3 * time.Second)
	synctest.Wait()
	g := status(t, m, lock.Pull, "late", "h2").Guaranteed
	if g <= 0 || g > 2*time.Second {
		t.Fatalf("3 s into a 5 s grace /status guaranteed %v, want at most the 2 s left", g)
	}
	time.Sleep(g - time.Nanosecond)
	synctest.Wait()
	if got := status(t, m, lock.Pull, "late", ""); got.Holder != "h2" {
		t.Fatalf("released before its guarantee from /status ran out: %+v", got)
	}
}

// testGuaranteed: a grant and the holder's /status say how long the hold
// is sure to stand, within the bounds of its leases; nobody else's call
// and no queue place get a guarantee.
func testGuaranteed(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) {
		c.SessionGrace = 5 * time.Second
		c.LockTTL = 20 * time.Second
		c.MaxHold = 10 * time.Second
	})
	r := mustLock(t, m, lock.LockRequest{Type: lock.Pull, Resource: "ttl", Node: "a", Lease: lock.LeaseTTL})
	if r.Guaranteed <= 0 || r.Guaranteed > 10*time.Second {
		t.Fatalf("a ttl grant with a 10 s max hold guaranteed %v, want (0, 10s]", r.Guaranteed)
	}
	st := subscribe(t, m, "b", nil)
	defer st.Close()
	r = mustLock(t, m, lock.LockRequest{Type: lock.Pull, Resource: "sess", Node: "b", Lease: lock.LeaseSession})
	if r.Guaranteed <= 0 || r.Guaranteed > 5*time.Second {
		t.Fatalf("a session grant, 5 s grace, guaranteed %v, want (0, 5s]", r.Guaranteed)
	}
	if again := mustLock(t, m, lockReq(lock.Pull, "sess", "b")); again.Guaranteed <= 0 {
		t.Fatalf("the holder's repeated /lock guaranteed nothing: %+v", again)
	}
	if got := status(t, m, lock.Pull, "sess", "b"); got.Guaranteed <= 0 || got.Guaranteed > 5*time.Second {
		t.Fatalf("the holder's /status guaranteed %v", got.Guaranteed)
	}
	if q := mustLock(t, m, lockReq(lock.Pull, "sess", "c")); !q.Queued || q.Guaranteed != 0 {
		t.Fatalf("a queue place: %+v, want queued with no guarantee", q)
	}
	for _, node := range []string{"", "c"} {
		if got := status(t, m, lock.Pull, "sess", node); got.Guaranteed != 0 {
			t.Fatalf("/status by %q, not the holder, guaranteed %v", node, got.Guaranteed)
		}
	}
}

func testTTLExpiry(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.LockTTL = 10 * time.Second })
	obs := subscribe(t, m, "", &lock.Key{Type: lock.Pull, Resource: "r"})
	mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	mustLock(t, m, lockReq(lock.Pull, "r", "b"))
	time.Sleep(6 * time.Second)
	mustLock(t, m, lockReq(lock.Pull, "r", "b")) // b renews its queue entry
	time.Sleep(5 * time.Second)                  // a's hold is 11 s old
	synctest.Wait()
	st := status(t, m, lock.Pull, "r", "")
	if st.Holder != "b" || st.LastCompleted == nil || st.LastCompleted.Error != "lock expired" || st.LastCompleted.Node != "a" || st.LastCompleted.Success {
		t.Fatalf("after the ttl: %+v %+v, want b holding and a expired", st, st.LastCompleted)
	}
	if got := names(expect(t, obs, 3)); !slices.Equal(got, []string{"lock_assigned:a", "lock_assigned:b", "operation_completed:a"}) {
		t.Fatalf("observer saw %v", got)
	}
	// A late unlock after the server released the hold is not taken for
	// work done.
	if _, err := m.Unlock(context.Background(), lock.UnlockRequest{Type: lock.Pull, Resource: "r", Node: "a", Success: true}); !errors.Is(err, lock.ErrNotHolder) {
		t.Fatalf("unlock after expiry: %v, want ErrNotHolder", err)
	}
	// /status with its node id renews b's hold.
	for range 3 {
		time.Sleep(8 * time.Second)
		status(t, m, lock.Pull, "r", "b")
		mustLock(t, m, lockReq(lock.Pull, "r", "b")) // also confirms the hand-off
	}
	if st := status(t, m, lock.Pull, "r", ""); st.Holder != "b" {
		t.Fatalf("renewed hold expired: %+v", st)
	}
	// An expired queue entry is removed.
	mustLock(t, m, lockReq(lock.Pull, "r", "c"))
	time.Sleep(9 * time.Second)
	mustLock(t, m, lockReq(lock.Pull, "r", "b"))
	time.Sleep(2 * time.Second)
	synctest.Wait()
	if st := status(t, m, lock.Pull, "r", "c"); st.QueueLength != 0 || st.Holder != "b" {
		t.Fatalf("expired queue entry kept: %+v", st)
	}
	if n := m.Stats().Expiries; n != 2 {
		t.Fatalf("expiries %d, want 2", n)
	}
}

// testTTLRenewedByStatus: a /status naming the node renews its ttl hold
// and its ttl queue entry on the key, with no /lock; one without the node
// renews nothing.
func testTTLRenewedByStatus(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.LockTTL = 10 * time.Second })
	mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	mustLock(t, m, lockReq(lock.Pull, "r", "b"))
	for range 4 {
		time.Sleep(8 * time.Second)
		status(t, m, lock.Pull, "r", "a")
		status(t, m, lock.Pull, "r", "b")
		status(t, m, lock.Pull, "r", "")
	}
	synctest.Wait()
	if st := status(t, m, lock.Pull, "r", "b"); st.Holder != "a" || st.Position != 1 {
		t.Fatalf("after 32 s renewed by status alone: %+v, want a holding and b waiting", st)
	}
	time.Sleep(5 * time.Second)
	status(t, m, lock.Pull, "r", "b") // b's entry lasts until 47 s, a's hold until 42 s
	time.Sleep(6 * time.Second)
	synctest.Wait()
	st := status(t, m, lock.Pull, "r", "")
	if st.Holder != "b" || st.LastCompleted == nil || st.LastCompleted.Node != "a" || st.LastCompleted.Error != "lock expired" {
		t.Fatalf("a status without a node renewed a's hold: %+v %+v", st, st.LastCompleted)
	}
}

func testClaimTimeoutAndMaxHold(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.ClaimTimeout = 2 * time.Second; c.MaxHold = 20 * time.Second })
	mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	mustLock(t, m, lockReq(lock.Pull, "r", "b"))
	mustLock(t, m, lockReq(lock.Pull, "r", "c"))
	mustUnlock(t, m, lock.Pull, "r", "a", false)
	time.Sleep(3 * time.Second) // b never confirms
	synctest.Wait()
	st := status(t, m, lock.Pull, "r", "")
	if st.Holder != "c" || st.LastCompleted == nil || st.LastCompleted.Node != "b" || st.LastCompleted.Error != "not claimed" {
		t.Fatalf("unclaimed hand-off: %+v %+v", st, st.LastCompleted)
	}
	mustLock(t, m, lockReq(lock.Pull, "r", "c")) // c confirms
	for range 3 {
		time.Sleep(5 * time.Second)
		mustLock(t, m, lockReq(lock.Pull, "r", "c"))
	}
	time.Sleep(5 * time.Second)
	synctest.Wait()
	st = status(t, m, lock.Pull, "r", "")
	if st.Held || st.LastCompleted == nil || st.LastCompleted.Node != "c" || st.LastCompleted.Error != "max hold exceeded" {
		t.Fatalf("max hold: %+v %+v", st, st.LastCompleted)
	}
	// A direct grant needs no confirmation.
	mustLock(t, m, lockReq(lock.Pull, "d", "x"))
	time.Sleep(3 * time.Second)
	synctest.Wait()
	if st := status(t, m, lock.Pull, "d", ""); st.Holder != "x" {
		t.Fatalf("a direct grant ended by the claim timeout: %+v", st)
	}
}

// testClaimTimeoutOff: with ClaimTimeout 0 a hand-off grant stands
// unconfirmed, kept by its lease alone.
func testClaimTimeoutOff(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.ClaimTimeout = 0 })
	subscribe(t, m, "b", nil) // b's lease is its session
	mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	mustLock(t, m, lockReq(lock.Pull, "r", "b"))
	mustUnlock(t, m, lock.Pull, "r", "a", false)
	time.Sleep(10 * time.Minute)
	synctest.Wait()
	if st := status(t, m, lock.Pull, "r", ""); st.Holder != "b" {
		t.Fatalf("an unconfirmed hand-off ended with the claim timeout off: %+v %+v", st, st.LastCompleted)
	}
}

func testSessionLoss(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.SessionGrace = 5 * time.Second })
	sa, _, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: "a"})
	if err != nil {
		t.Fatal(err)
	}
	sb := subscribe(t, m, "b", nil)
	mustLock(t, m, lockReq(lock.Pull, "r", "a")) // session lease: a has a stream
	mustLock(t, m, lockReq(lock.Pull, "r", "b"))
	mustLock(t, m, lockReq(lock.Pull, "q", "b"))
	mustLock(t, m, lockReq(lock.Pull, "q", "a")) // a waits on q
	sa.Close()
	time.Sleep(4 * time.Second)
	synctest.Wait()
	if st := status(t, m, lock.Pull, "r", ""); st.Holder != "a" {
		t.Fatalf("hold released within the grace: %+v", st)
	}
	// A reconnect within the grace keeps everything.
	sa2, _, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: "a"})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(10 * time.Second)
	synctest.Wait()
	if st := status(t, m, lock.Pull, "r", ""); st.Holder != "a" {
		t.Fatalf("hold lost despite the reconnect: %+v", st)
	}
	sa2.Close()
	time.Sleep(6 * time.Second)
	synctest.Wait()
	st := status(t, m, lock.Pull, "r", "")
	if st.Holder != "b" || st.LastCompleted == nil || st.LastCompleted.Error != "session lost" || st.LastCompleted.Node != "a" {
		t.Fatalf("after the grace: %+v %+v, want b holding", st, st.LastCompleted)
	}
	if st := status(t, m, lock.Pull, "q", ""); st.QueueLength != 0 {
		t.Fatalf("lost session's queue entry kept: %+v", st)
	}
	if got := names(expect(t, sb, 2)); !slices.Equal(got, []string{"lock_assigned:b", "lock_assigned:b"}) {
		t.Fatalf("b saw %v", got)
	}
	if s := m.Stats(); s.SessionsLost != 1 || s.Sessions != 1 {
		t.Fatalf("stats %+v", s)
	}
}

func testSessionLeaseWithoutStream(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.SessionGrace = 5 * time.Second })
	mustLock(t, m, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "a", Lease: lock.LeaseSession})
	time.Sleep(6 * time.Second)
	synctest.Wait()
	if st := status(t, m, lock.Pull, "r", ""); st.Held {
		t.Fatalf("a session that never streamed kept its hold: %+v", st)
	}
	// Without a session, the default lease is ttl: it outlives the grace.
	mustLock(t, m, lockReq(lock.Pull, "r", "b"))
	time.Sleep(30 * time.Second)
	synctest.Wait()
	if st := status(t, m, lock.Pull, "r", ""); st.Holder != "b" {
		t.Fatalf("ttl hold lost: %+v", st)
	}
}

// testMassSessionLoss: hundreds of sessions lost at once, holders and
// waiters on shared keys: every waiter of theirs leaves, every hold passes
// to the first live waiter in FIFO order, and no lost waiter is ever
// granted on the way.
func testMassSessionLoss(t *testing.T, s *suite) {
	const n = 700
	m := s.open(t, func(c *Config) { c.SessionGrace = 5 * time.Second })
	subscribe(t, m, "A", nil)
	sb := subscribe(t, m, "B", nil)
	obs := subscribe(t, m, "", &lock.Key{Type: lock.Pull, Resource: "K"})
	lost := make([]lock.Stream, n)
	node := func(i int) string { return "L" + strconv.Itoa(i) }
	for i := range lost {
		lost[i] = subscribe(t, m, node(i), nil)
	}
	// K: held by L0; waiters L1…L299, A, L300…L499, B.
	mustLock(t, m, lockReq(lock.Pull, "K", node(0)))
	for i := 1; i < 500; i++ {
		if i == 300 {
			mustLock(t, m, lockReq(lock.Pull, "K", "A"))
		}
		mustLock(t, m, lockReq(lock.Pull, "K", node(i)))
	}
	mustLock(t, m, lockReq(lock.Pull, "K", "B"))
	// Keys held by L500… with A waiting, and B waiting behind lost waiters.
	for i := 500; i < n; i++ {
		k := "own" + strconv.Itoa(i)
		mustLock(t, m, lockReq(lock.Update, k, node(i)))
		mustLock(t, m, lockReq(lock.Update, k, node((i+1-500)%200+500)))
		mustLock(t, m, lockReq(lock.Update, k, "A"))
	}
	if got := names(expect(t, obs, 1)); !slices.Equal(got, []string{"lock_assigned:" + node(0)}) {
		t.Fatalf("K's observer saw %v before the loss", got)
	}
	if got := events(sb); len(got) != 0 {
		t.Fatalf("B was told %v while it waited", names(got))
	}
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
	if st := status(t, m, lock.Pull, "K", node(1)); st.Position != 1 {
		t.Fatalf("a session whose stream came back was ended early: %+v", st)
	}
	time.Sleep(3 * time.Second)
	synctest.Wait()
	if st := status(t, m, lock.Pull, "K", "B"); st.Holder != "A" || st.QueueLength != 1 || st.Position != 1 {
		t.Fatalf("K after the loss: %+v, want A holding and B next", st)
	}
	if got := names(expect(t, obs, 2)); !slices.Equal(got, []string{"lock_assigned:A", "operation_completed:" + node(0)}) {
		t.Fatalf("K's observer saw %v, want A's grant and L0's completion only", got)
	}
	for i := 500; i < n; i++ {
		if st := status(t, m, lock.Update, "own"+strconv.Itoa(i), ""); st.Holder != "A" || st.QueueLength != 0 {
			t.Fatalf("own%d: %+v, want A holding alone", i, st)
		}
	}
	if st := m.Stats(); st.SessionsLost != n || st.Sessions != 2 || st.Queued != 1 || st.Held != 1+n-500 {
		t.Fatalf("stats %+v", st)
	}
	if len(events(sb)) != 0 {
		t.Fatal("B was told something though it only moved up")
	}
}
