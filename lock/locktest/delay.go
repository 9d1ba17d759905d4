package locktest

import (
	"context"
	"errors"
	"slices"
	"testing"
	"testing/synctest"
	"time"

	"github.com/dlock/dlock/lock"
)

// LockDelay (docs/DESIGN.md, "Leases"): a hold that ends because its lease
// ran out (a ttl expiry, a lost session) leaves its key reserved for
// Rules.LockDelay, since its holder may still be running; the key is then
// handed on as at any failure. Every test here runs in fake time, so that
// "not before the delay, right after it" is checked to the millisecond.

var delayTests = []test{
	{name: "SessionLoss", fakeTime: true, run: testDelaySessionLoss},
	{name: "TTLExpiry", fakeTime: true, run: testDelayTTLExpiry},
	{name: "NotForOtherEnds", fakeTime: true, run: testDelayNotForOtherEnds},
	{name: "WithoutWaiters", fakeTime: true, run: testDelayWithoutWaiters},
	{name: "MultiNodeDownloadOff", fakeTime: true, run: testDelayMultiNodeOff},
	{name: "Off", fakeTime: true, run: testDelayOff},
}

const lockDelay = 10 * time.Second

// delayEnd is when the delay of the hold whose end st records ends.
func delayEnd(t *testing.T, st lock.Status) time.Time {
	t.Helper()
	if st.LastCompleted == nil {
		t.Fatalf("no completion record: %+v", st)
	}
	return st.LastCompleted.CompletedAt.Add(lockDelay)
}

// untilJustBefore sleeps until a millisecond before at and lets the
// backend's timers run.
func untilJustBefore(at time.Time) {
	time.Sleep(time.Until(at) - time.Millisecond)
	synctest.Wait()
}

// pastIt sleeps the last millisecond and lets the backend's timers run.
func pastIt() {
	time.Sleep(time.Millisecond)
	synctest.Wait()
}

// testDelaySessionLoss: a hold whose session is lost is told at once and
// handed on only after the delay; meanwhile the waiter keeps its place,
// a newcomer queues behind it, and the key reads as free with waiters.
func testDelaySessionLoss(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.SessionGrace = 5 * time.Second; c.LockDelay = lockDelay })
	sa, _, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: "a"})
	if err != nil {
		t.Fatal(err)
	}
	sb := subscribe(t, m, "b", nil)
	sc := subscribe(t, m, "c", nil)
	obs := subscribe(t, m, "", &lock.Key{Type: lock.Pull, Resource: "r"})
	ga := mustLock(t, m, lockReq(lock.Pull, "r", "a")) // session lease: a has a stream
	mustLock(t, m, lockReq(lock.Pull, "r", "b"))
	expect(t, obs, 1)
	sa.Close()
	time.Sleep(5 * time.Second)
	synctest.Wait()
	st := status(t, m, lock.Pull, "r", "b")
	if st.Held || st.Holder != "" || st.QueueLength != 1 || st.Position != 1 ||
		st.LastCompleted == nil || st.LastCompleted.Node != "a" || st.LastCompleted.Error != "session lost" {
		t.Fatalf("after the grace: %+v %+v, want free, b first in line, a's session lost", st, st.LastCompleted)
	}
	end := delayEnd(t, st)
	// The end of the hold is told when it ends, naming no next holder.
	got := expect(t, obs, 1)
	if ev := got[0].Event; len(got) != 1 || ev.Name != lock.EventOperationCompleted || ev.Node != "a" || ev.Success || ev.NextHolder != "" ||
		!ev.CompletedAt.Equal(st.LastCompleted.CompletedAt) {
		t.Fatalf("observer saw %v (%+v), want a's completion alone, with no next holder", names(got), got[0].Event)
	}
	// A newcomer queues behind b, and b asking again keeps its place.
	if r := mustLock(t, m, lockReq(lock.Pull, "r", "c")); !r.Queued || r.Position != 2 || r.Holder != "" {
		t.Fatalf("c in the delay: %+v, want queued second with no holder", r)
	}
	if r := mustLock(t, m, lockReq(lock.Pull, "r", "b")); !r.Queued || r.Position != 1 {
		t.Fatalf("b again in the delay: %+v, want its place kept", r)
	}
	if st := m.Stats(); st.Held != 0 || st.Queued != 2 || st.SessionsLost != 1 {
		t.Fatalf("stats in the delay: %+v", st)
	}
	untilJustBefore(end)
	if st := status(t, m, lock.Pull, "r", ""); st.Held || st.QueueLength != 2 {
		t.Fatalf("a millisecond before the delay's end: %+v, want still free with two waiters", st)
	}
	if got := events(sb); len(got) != 0 {
		t.Fatalf("b was told %v before the delay's end", names(got))
	}
	pastIt()
	st = status(t, m, lock.Pull, "r", "c")
	if st.Holder != "b" || st.Token <= ga.Token || st.QueueLength != 1 || st.Position != 1 {
		t.Fatalf("at the delay's end: %+v, want b holding with a newer token and c next", st)
	}
	if got := expect(t, sb, 1); len(got) != 1 || got[0].Event.Name != lock.EventLockAssigned || got[0].Event.Token != st.Token {
		t.Fatalf("b saw %v, want its lock_assigned", names(got))
	}
	if got := names(expect(t, obs, 1)); !slices.Equal(got, []string{"lock_assigned:b"}) {
		t.Fatalf("observer saw %v at the delay's end, want b's grant alone", got)
	}
	if got := events(sc); len(got) != 0 {
		t.Fatalf("c was told %v though it only moved up", names(got))
	}
	// The hand-off is a hand-off: b confirms it as usual.
	if r := mustLock(t, m, lockReq(lock.Pull, "r", "b")); !r.Acquired || r.Token != st.Token {
		t.Fatalf("b confirms: %+v", r)
	}
}

// testDelayTTLExpiry: the same for a ttl lease that ran out; the delay's
// end is no expiry, and a late unlock of the old holder stays refused.
func testDelayTTLExpiry(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.LockTTL = 10 * time.Second; c.LockDelay = lockDelay })
	sb := subscribe(t, m, "b", nil)
	subscribe(t, m, "c", nil)
	obs := subscribe(t, m, "", &lock.Key{Type: lock.Update, Resource: "r"})
	ga := mustLock(t, m, lockReq(lock.Update, "r", "a")) // ttl lease: a has no session
	mustLock(t, m, lockReq(lock.Update, "r", "b"))
	time.Sleep(10 * time.Second)
	synctest.Wait()
	st := status(t, m, lock.Update, "r", "")
	if st.Held || st.QueueLength != 1 || st.LastCompleted == nil || st.LastCompleted.Node != "a" || st.LastCompleted.Error != "lock expired" || st.LastCompleted.Success {
		t.Fatalf("after the ttl: %+v %+v, want free with b waiting and a expired", st, st.LastCompleted)
	}
	end := delayEnd(t, st)
	if got := names(expect(t, obs, 2)); !slices.Equal(got, []string{"lock_assigned:a", "operation_completed:a"}) {
		t.Fatalf("observer saw %v, want a's grant and its end", got)
	}
	if _, err := m.Unlock(context.Background(), lock.UnlockRequest{Type: lock.Update, Resource: "r", Node: "a", Success: true}); !errors.Is(err, lock.ErrNotHolder) {
		t.Fatalf("a's unlock in the delay: %v, want ErrNotHolder", err)
	}
	if r := mustLock(t, m, lockReq(lock.Update, "r", "c")); !r.Queued || r.Position != 2 {
		t.Fatalf("c in the delay: %+v, want queued second", r)
	}
	untilJustBefore(end)
	if st := status(t, m, lock.Update, "r", ""); st.Held {
		t.Fatalf("a millisecond before the delay's end: %+v, want free", st)
	}
	pastIt()
	if st := status(t, m, lock.Update, "r", ""); st.Holder != "b" || st.Token <= ga.Token || st.QueueLength != 1 {
		t.Fatalf("at the delay's end: %+v, want b holding and c next", st)
	}
	if got := names(expect(t, sb, 1)); !slices.Equal(got, []string{"lock_assigned:b"}) {
		t.Fatalf("b saw %v", got)
	}
	if got := names(expect(t, obs, 1)); !slices.Equal(got, []string{"lock_assigned:b"}) {
		t.Fatalf("observer saw %v at the delay's end, want b's grant alone", got)
	}
	if n := m.Stats().Expiries; n != 1 {
		t.Fatalf("expiries %d, want 1: the delay's end is none", n)
	}
}

// testDelayNotForOtherEnds: an unlock, a cancel, a claim timeout and max
// hold hand the key on at once, whatever the delay: the holder is known
// to have stopped, never started, or the operator's bound applies.
func testDelayNotForOtherEnds(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) {
		c.LockDelay = lockDelay
		c.ClaimTimeout = 2 * time.Second
		c.MaxHold = 20 * time.Second
	})
	for _, n := range []string{"a", "b", "c", "x", "y"} {
		subscribe(t, m, n, nil) // session leases: no ttl runs out here
	}
	mustLock(t, m, lockReq(lock.Pull, "unlock", "a"))
	mustLock(t, m, lockReq(lock.Pull, "unlock", "b"))
	if r := mustUnlock(t, m, lock.Pull, "unlock", "a", false); r.NextHolder != "b" {
		t.Fatalf("a failed unlock handed to %q, want b at once", r.NextHolder)
	}
	mustLock(t, m, lockReq(lock.Pull, "cancel", "a"))
	mustLock(t, m, lockReq(lock.Pull, "cancel", "b"))
	if r, err := m.Cancel(context.Background(), lock.Pull, "cancel", "a"); err != nil || !r.Released {
		t.Fatalf("the holder's cancel: %+v %v", r, err)
	}
	if st := status(t, m, lock.Pull, "cancel", ""); st.Holder != "b" {
		t.Fatalf("after the holder's cancel: %+v, want b at once", st)
	}
	mustLock(t, m, lockReq(lock.Pull, "claim", "a"))
	mustLock(t, m, lockReq(lock.Pull, "claim", "b"))
	mustLock(t, m, lockReq(lock.Pull, "claim", "c"))
	mustUnlock(t, m, lock.Pull, "claim", "a", false) // b never confirms
	mustLock(t, m, lockReq(lock.Pull, "hold", "x"))
	mustLock(t, m, lockReq(lock.Pull, "hold", "y"))
	time.Sleep(2 * time.Second)
	synctest.Wait()
	st := status(t, m, lock.Pull, "claim", "")
	if st.Holder != "c" || st.LastCompleted == nil || st.LastCompleted.Node != "b" || st.LastCompleted.Error != "not claimed" {
		t.Fatalf("at the claim timeout: %+v %+v, want c at once", st, st.LastCompleted)
	}
	time.Sleep(18 * time.Second)
	synctest.Wait()
	st = status(t, m, lock.Pull, "hold", "")
	if st.Holder != "y" || st.LastCompleted == nil || st.LastCompleted.Node != "x" || st.LastCompleted.Error != "max hold exceeded" {
		t.Fatalf("at max hold: %+v %+v, want y at once", st, st.LastCompleted)
	}
}

// testDelayWithoutWaiters: a key nobody waits for is reserved too, since
// whoever asks during the delay could run beside the old holder: the first
// to ask waits, first in line, and gets the key at the delay's end. One
// waiter leaving in the delay ends nothing. A delay nobody waited through
// leaves the key free.
func testDelayWithoutWaiters(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.LockTTL = 10 * time.Second; c.LockDelay = lockDelay })
	sc := subscribe(t, m, "c", nil)
	subscribe(t, m, "d", nil)
	mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	mustLock(t, m, lockReq(lock.Pull, "free", "a"))
	time.Sleep(10 * time.Second)
	synctest.Wait()
	st := status(t, m, lock.Pull, "r", "")
	if st.Held || st.QueueLength != 0 || st.LastCompleted == nil || st.LastCompleted.Error != "lock expired" {
		t.Fatalf("after the ttl: %+v %+v, want free with nobody waiting", st, st.LastCompleted)
	}
	end := delayEnd(t, st)
	if r := mustLock(t, m, lockReq(lock.Pull, "r", "d")); !r.Queued || r.Position != 1 || r.Holder != "" {
		t.Fatalf("d in the delay: %+v, want queued first, with no holder", r)
	}
	if r := mustLock(t, m, lockReq(lock.Pull, "r", "c")); !r.Queued || r.Position != 2 {
		t.Fatalf("c in the delay: %+v, want queued second", r)
	}
	if r, err := m.Cancel(context.Background(), lock.Pull, "r", "d"); err != nil || !r.Dequeued {
		t.Fatalf("d leaves: %+v %v", r, err)
	}
	if st := status(t, m, lock.Pull, "r", "c"); st.Held || st.Position != 1 {
		t.Fatalf("after d left: %+v, want c first and the key still free", st)
	}
	untilJustBefore(end)
	if st := status(t, m, lock.Pull, "r", ""); st.Held {
		t.Fatalf("a millisecond before the delay's end: %+v", st)
	}
	if got := events(sc); len(got) != 0 {
		t.Fatalf("c was told %v before the delay's end", names(got))
	}
	pastIt()
	if st := status(t, m, lock.Pull, "r", ""); st.Holder != "c" || st.QueueLength != 0 {
		t.Fatalf("at the delay's end: %+v, want c holding", st)
	}
	if got := names(expect(t, sc, 1)); !slices.Equal(got, []string{"lock_assigned:c"}) {
		t.Fatalf("c saw %v", got)
	}
	// Nobody asked for "free" in its delay: after it, a /lock is granted.
	if r := mustLock(t, m, lockReq(lock.Pull, "free", "d")); !r.Acquired {
		t.Fatalf("after a delay nobody waited through: %+v, want acquired", r)
	}
}

// testDelayMultiNodeOff: with multi-node download off nobody queues, and
// a key in its delay is refused like a held one, naming no holder.
func testDelayMultiNodeOff(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) {
		c.AllowMultiNodeDownload = false
		c.LockTTL = 10 * time.Second
		c.LockDelay = lockDelay
	})
	mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	time.Sleep(10 * time.Second)
	synctest.Wait()
	st := status(t, m, lock.Pull, "r", "")
	end := delayEnd(t, st)
	_, err := m.TryLock(context.Background(), lockReq(lock.Pull, "r", "b"))
	var he *lock.HeldError
	if !errors.Is(err, lock.ErrLockHeld) || !errors.As(err, &he) || he.Holder != "" {
		t.Fatalf("b in the delay: %v, want ErrLockHeld naming no holder", err)
	}
	if st := status(t, m, lock.Pull, "r", ""); st.QueueLength != 0 {
		t.Fatalf("b was queued: %+v", st)
	}
	untilJustBefore(end)
	if _, err := m.TryLock(context.Background(), lockReq(lock.Pull, "r", "b")); !errors.Is(err, lock.ErrLockHeld) {
		t.Fatalf("b a millisecond before the delay's end: %v, want ErrLockHeld", err)
	}
	pastIt()
	if r := mustLock(t, m, lockReq(lock.Pull, "r", "b")); !r.Acquired {
		t.Fatalf("b after the delay: %+v, want acquired", r)
	}
}

// testDelayOff: with LockDelay 0 a ttl expiry and a session loss hand the
// key on at the very moment the lease runs out.
func testDelayOff(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.LockTTL = 10 * time.Second; c.SessionGrace = 5 * time.Second; c.LockDelay = 0 })
	sa, _, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: "a"})
	if err != nil {
		t.Fatal(err)
	}
	subscribe(t, m, "b", nil)
	mustLock(t, m, lockReq(lock.Pull, "session", "a"))
	mustLock(t, m, lock.LockRequest{Type: lock.Pull, Resource: "ttl", Node: "a", Lease: lock.LeaseTTL})
	mustLock(t, m, lockReq(lock.Pull, "session", "b"))
	mustLock(t, m, lockReq(lock.Pull, "ttl", "b"))
	sa.Close()
	time.Sleep(5 * time.Second)
	synctest.Wait()
	if st := status(t, m, lock.Pull, "session", ""); st.Holder != "b" || st.LastCompleted == nil || st.LastCompleted.Error != "session lost" {
		t.Fatalf("at the grace's end: %+v, want b at once", st)
	}
	time.Sleep(5 * time.Second)
	synctest.Wait()
	if st := status(t, m, lock.Pull, "ttl", ""); st.Holder != "b" || st.LastCompleted == nil || st.LastCompleted.Error != "lock expired" {
		t.Fatalf("at the ttl's end: %+v, want b at once", st)
	}
}
