package etcd_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/etcd"
)

// The timer rules of docs/DESIGN.md ("Leases", "Completion records"), which
// the conformance suite checks in fake time and cannot for this backend:
// its deadlines follow the wall clock and its sessions etcd's lease clock.
// Here they run in real time with short durations. Each test waits for the
// state a rule must reach (a liveness bound, not a timing assertion), and
// checks what must hold once it is reached.

// open returns a backend on a fresh data set of the shared embedded etcd.
func open(t testing.TB, mod func(*etcd.Config)) (*etcd.Backend, string) {
	t.Helper()
	p := etcdtest.Prefix(t)
	return openAt(t, p, mod), p
}

// openAt returns another backend on the data set p: another server.
func openAt(t testing.TB, p string, mod func(*etcd.Config)) *etcd.Backend {
	t.Helper()
	cfg := etcd.DefaultConfig()
	if mod != nil {
		mod(&cfg)
	}
	b, err := etcd.New(t.Context(), etcdtest.Shared(t).Client(t), withPrefix(cfg, p))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

func tryLock(t *testing.T, b lock.Backend, req lock.LockRequest) lock.LockResult {
	t.Helper()
	r, err := b.TryLock(context.Background(), req)
	if err != nil {
		t.Fatalf("TryLock(%v, %s): %v", req.Key(), req.Node, err)
	}
	return r
}

func stat(t *testing.T, b lock.Backend, typ lock.Type, res, node string) lock.Status {
	t.Helper()
	st, err := b.Status(context.Background(), typ, res, node)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// next waits for the next event of a stream.
func next(t *testing.T, st lock.Stream) lock.Delivery {
	t.Helper()
	timeout := time.After(time.Minute)
	for {
		if got := st.Take(nil); len(got) > 0 {
			if len(got) > 1 {
				t.Fatalf("got %d events, want one: %v", len(got), got)
			}
			return got[0]
		}
		select {
		case <-st.Ready():
		case <-st.Done():
			t.Fatal("stream ended")
		case <-timeout:
			t.Fatal("no event after a minute")
		}
	}
}

func subscribe(t *testing.T, b lock.Backend, node string) lock.Stream {
	t.Helper()
	st, _, err := b.Subscribe(t.Context(), lock.SubscribeRequest{Node: node})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(st.Close)
	return st
}

func ttlReq(res, node string) lock.LockRequest {
	return lock.LockRequest{Type: lock.Pull, Resource: res, Node: node, Lease: lock.LeaseTTL}
}

func TestTTLExpiryHandsOn(t *testing.T) {
	b, _ := open(t, func(c *etcd.Config) { c.LockTTL = time.Second })
	a := tryLock(t, b, ttlReq("r", "a"))
	sb := subscribe(t, b, "b")
	if r := tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "b", Lease: lock.LeaseSession}); !r.Queued {
		t.Fatalf("b: %+v, want queued", r)
	}
	d := next(t, sb)
	if d.Event.Name != lock.EventLockAssigned || d.Event.Node != "b" || d.Event.Token <= a.Token {
		t.Fatalf("b got %+v, want lock_assigned with a newer token", d.Event)
	}
	st := stat(t, b, lock.Pull, "r", "")
	if st.Holder != "b" || st.LastCompleted == nil || st.LastCompleted.Error != "lock expired" || st.LastCompleted.Node != "a" {
		t.Fatalf("status %+v %+v, want b holding after a's hold expired", st, st.LastCompleted)
	}
	if _, err := b.Unlock(context.Background(), lock.UnlockRequest{Type: lock.Pull, Resource: "r", Node: "a", Success: true}); !errors.Is(err, lock.ErrNotHolder) {
		t.Fatalf("a late unlock: %v, want ErrNotHolder", err)
	}
	// The timer counts its expiry once its transaction has committed,
	// which the watch may deliver first.
	etcd.Eventually(t, "the expiry to be counted", func() bool { return b.Stats().Expiries >= 1 })
	if n := b.Stats().Expiries; n != 1 {
		t.Fatalf("Expiries = %d, want 1", n)
	}
}

func TestTTLWaiterExpires(t *testing.T) {
	b, _ := open(t, func(c *etcd.Config) { c.LockTTL = time.Second })
	tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "a", Lease: lock.LeaseSession})
	tryLock(t, b, ttlReq("r", "w"))
	etcd.Eventually(t, "the ttl waiter to leave the queue", func() bool { return stat(t, b, lock.Pull, "r", "").QueueLength == 0 })
	if st := stat(t, b, lock.Pull, "r", ""); st.Holder != "a" {
		t.Fatalf("status %+v, want a still holding (a session lease)", st)
	}
}

// TestTTLRenewedByStatus: renewals more often than the ttl keep a hold
// past several ttls.
func TestTTLRenewedByStatus(t *testing.T) {
	b, _ := open(t, func(c *etcd.Config) { c.LockTTL = 2 * time.Second })
	a := tryLock(t, b, ttlReq("r", "a"))
	end := time.Now().Add(5 * time.Second)
	for time.Now().Before(end) {
		stat(t, b, lock.Pull, "r", "a")
		time.Sleep(100 * time.Millisecond)
	}
	if st := stat(t, b, lock.Pull, "r", ""); st.Holder != "a" || st.Token != a.Token {
		t.Fatalf("status %+v, want a's renewed hold", st)
	}
}

func TestClaimTimeout(t *testing.T) {
	b, _ := open(t, func(c *etcd.Config) { c.ClaimTimeout = time.Second })
	tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "a"})
	tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "b"})
	tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "c"})
	tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: "s", Node: "a"})
	tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: "s", Node: "b"})
	for _, res := range []string{"r", "s"} {
		if _, err := b.Unlock(context.Background(), lock.UnlockRequest{Type: lock.Pull, Resource: res, Node: "a", Error: "x"}); err != nil {
			t.Fatal(err)
		}
	}
	// b confirms s but not r.
	tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: "s", Node: "b"})
	etcd.Eventually(t, "r to pass to c", func() bool { return stat(t, b, lock.Pull, "r", "").Holder == "c" })
	if lc := stat(t, b, lock.Pull, "r", "").LastCompleted; lc == nil || lc.Node != "b" || lc.Error != "not claimed" {
		t.Fatalf("record %+v, want b not claimed", lc)
	}
	etcd.Eventually(t, "c's unconfirmed grant of r to end too", func() bool { return !stat(t, b, lock.Pull, "r", "").Held })
	if st := stat(t, b, lock.Pull, "s", ""); st.Holder != "b" {
		t.Fatalf("s: %+v, want b's confirmed grant kept", st)
	}
}

func TestMaxHold(t *testing.T) {
	b, _ := open(t, func(c *etcd.Config) { c.MaxHold = time.Second })
	tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "a"})
	etcd.Eventually(t, "the hold to end", func() bool { return !stat(t, b, lock.Pull, "r", "").Held })
	if lc := stat(t, b, lock.Pull, "r", "").LastCompleted; lc == nil || lc.Error != "max hold exceeded" {
		t.Fatalf("record %+v, want max hold exceeded", lc)
	}
}

func TestSessionLoss(t *testing.T) {
	b, _ := open(t, func(c *etcd.Config) { c.SessionGrace = time.Second })
	sa, _, err := b.Subscribe(t.Context(), lock.SubscribeRequest{Node: "a"})
	if err != nil {
		t.Fatal(err)
	}
	a := tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "a"}) // auto: a has a session
	tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: "q", Node: "h", Lease: lock.LeaseTTL})
	tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: "q", Node: "a"}) // a waits on q
	sb := subscribe(t, b, "b")
	tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "b"})
	if st := b.Stats(); st.Sessions != 2 {
		t.Fatalf("Sessions = %d, want 2", st.Sessions)
	}
	sa.Close()
	d := next(t, sb)
	if d.Event.Name != lock.EventLockAssigned || d.Event.Node != "b" || d.Event.Token <= a.Token {
		t.Fatalf("b got %+v", d.Event)
	}
	if lc := stat(t, b, lock.Pull, "r", "").LastCompleted; lc == nil || lc.Node != "a" || lc.Error != "session lost" {
		t.Fatalf("record %+v, want a's session lost", lc)
	}
	etcd.Eventually(t, "a's queue place to go", func() bool { return stat(t, b, lock.Pull, "q", "").QueueLength == 0 })
	etcd.Eventually(t, "the loss to be counted", func() bool { return b.Stats().SessionsLost == 1 })
	if st := b.Stats(); st.Sessions != 1 {
		t.Fatalf("Sessions = %d, want 1", st.Sessions)
	}
	// A new session of a cannot replay the old one's events.
	_, sub, err := b.Subscribe(t.Context(), lock.SubscribeRequest{Node: "a", LastID: d.ID, HasLast: true})
	if err != nil {
		t.Fatal(err)
	}
	if !sub.Missed || len(sub.Replay) != 0 {
		t.Fatalf("replay into a new session: %+v, want missed and nothing", sub)
	}
}

// TestSessionLeaseWithoutStream: a session lease asked for without a stream
// starts a session in its grace, which ends unless a stream opens.
func TestSessionLeaseWithoutStream(t *testing.T) {
	b, _ := open(t, func(c *etcd.Config) { c.SessionGrace = time.Second })
	tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "a", Lease: lock.LeaseSession})
	if st := b.Stats(); st.Sessions != 1 {
		t.Fatalf("Sessions = %d, want 1", st.Sessions)
	}
	etcd.Eventually(t, "the hold to end with the session", func() bool { return !stat(t, b, lock.Pull, "r", "").Held })
	if lc := stat(t, b, lock.Pull, "r", "").LastCompleted; lc == nil || lc.Error != "session lost" {
		t.Fatalf("record %+v", lc)
	}
}

// TestSessionMovesToAnotherServer: a node whose stream moves to another
// server within the grace keeps its session and its holds.
func TestSessionMovesToAnotherServer(t *testing.T) {
	grace := func(c *etcd.Config) { c.SessionGrace = 2 * time.Second }
	b1, p := open(t, grace)
	b2 := openAt(t, p, grace)
	s1, sub, err := b1.Subscribe(t.Context(), lock.SubscribeRequest{Node: "a"})
	if err != nil {
		t.Fatal(err)
	}
	a := tryLock(t, b1, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "a"})
	s2, sub2, err := b2.Subscribe(t.Context(), lock.SubscribeRequest{Node: "a", LastID: sub.ID, HasLast: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if sub2.Missed || len(sub2.Replay) != 1 || sub2.Replay[0].Event.Token != a.Token {
		t.Fatalf("replay on the other server: %+v, want a's grant", sub2)
	}
	s1.Close()
	b1.Close() // the first server goes away too
	// Well past the grace, b2 keeps the session alive.
	time.Sleep(5 * time.Second)
	if st := stat(t, b2, lock.Pull, "r", ""); st.Holder != "a" || st.Token != a.Token {
		t.Fatalf("status %+v, want a's hold kept", st)
	}
}

func TestMassSessionLoss(t *testing.T) {
	b, _ := open(t, func(c *etcd.Config) { c.SessionGrace = time.Second })
	const n = 60
	var streams []lock.Stream
	for i := range n {
		node := fmt.Sprintf("n%d", i)
		st, _, err := b.Subscribe(t.Context(), lock.SubscribeRequest{Node: node})
		if err != nil {
			t.Fatal(err)
		}
		streams = append(streams, st)
		tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: fmt.Sprintf("r%d", i), Node: node})
		// Each also waits on the next one's key: waiters leave first, so
		// no hold is handed to a leaving session.
		if i > 0 {
			tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: fmt.Sprintf("r%d", i-1), Node: node})
		}
		tryLock(t, b, ttlReq(fmt.Sprintf("r%d", i), "keeper"))
	}
	var wg sync.WaitGroup
	for _, st := range streams {
		wg.Go(st.Close)
	}
	wg.Wait()
	etcd.Eventually(t, "every key to pass to the keeper", func() bool {
		for i := range n {
			if stat(t, b, lock.Pull, fmt.Sprintf("r%d", i), "").Holder != "keeper" {
				return false
			}
		}
		return true
	})
	etcd.Eventually(t, "every loss to be counted", func() bool { return b.Stats().SessionsLost == n })
}

func TestCompletionRetention(t *testing.T) {
	b, _ := open(t, func(c *etcd.Config) { c.CompletedRetention = time.Second })
	tryLock(t, b, lock.LockRequest{Type: lock.Delete, Resource: "r", Node: "a"})
	if _, err := b.Unlock(context.Background(), lock.UnlockRequest{Type: lock.Delete, Resource: "r", Node: "a", Success: true}); err != nil {
		t.Fatal(err)
	}
	skip := lock.LockRequest{Type: lock.Delete, Resource: "r", Node: "b", SkipRecent: true}
	if r := tryLock(t, b, skip); !r.Skip {
		t.Fatalf("within the retention: %+v, want skip", r)
	}
	etcd.Eventually(t, "the record to be dropped", func() bool { return b.Stats().Keys == 0 })
	if st := stat(t, b, lock.Delete, "r", ""); st.LastCompleted != nil {
		t.Fatalf("record kept: %+v", st.LastCompleted)
	}
	if r := tryLock(t, b, skip); !r.Acquired {
		t.Fatalf("after the retention: %+v, want acquired", r)
	}
}

// TestTimersFireOnce: three servers on one data set run the same deadline;
// it takes effect once.
func TestTimersFireOnce(t *testing.T) {
	ttl := func(c *etcd.Config) { c.LockTTL = time.Second }
	b1, p := open(t, ttl)
	b2, b3 := openAt(t, p, ttl), openAt(t, p, ttl)
	const keys = 20
	for i := range keys {
		res := fmt.Sprintf("r%d", i)
		tryLock(t, b1, ttlReq(res, "a"))
		tryLock(t, b2, lock.LockRequest{Type: lock.Pull, Resource: res, Node: "b", Lease: lock.LeaseSession})
	}
	etcd.Eventually(t, "every hold to pass to b", func() bool {
		for i := range keys {
			if stat(t, b3, lock.Pull, fmt.Sprintf("r%d", i), "").Holder != "b" {
				return false
			}
		}
		return true
	})
	expiries := func() uint64 { return b1.Stats().Expiries + b2.Stats().Expiries + b3.Stats().Expiries }
	// A timer counts its expiry once its transaction has committed, which
	// the watch may deliver first.
	etcd.Eventually(t, "every expiry to be counted", func() bool { return expiries() >= keys })
	if n := expiries(); n != keys {
		t.Fatalf("%d expiries on the three servers, want %d: each deadline once", n, keys)
	}
}

func TestMaxSessionsMakesRoom(t *testing.T) {
	b, _ := open(t, func(c *etcd.Config) { c.MaxSessions = 1; c.SessionGrace = time.Second })
	sa, _, err := b.Subscribe(t.Context(), lock.SubscribeRequest{Node: "a"})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := b.Subscribe(t.Context(), lock.SubscribeRequest{Node: "c"}); !errors.Is(err, lock.ErrTooManySessions) {
		t.Fatalf("a second session: %v, want ErrTooManySessions", err)
	}
	sa.Close()
	etcd.Eventually(t, "a's session to end", func() bool { return b.Stats().Sessions == 0 })
	subscribe(t, b, "c")
}

// TestCompletedMax: past CompletedMax, the oldest records go first.
func TestCompletedMax(t *testing.T) {
	b, _ := open(t, func(c *etcd.Config) { c.CompletedMax = 3 })
	for _, r := range []string{"r1", "r2", "r3", "r4", "r5"} {
		tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: r, Node: "a"})
		if _, err := b.Unlock(context.Background(), lock.UnlockRequest{Type: lock.Pull, Resource: r, Node: "a", Success: true}); err != nil {
			t.Fatal(err)
		}
	}
	etcd.Eventually(t, "three records to be kept", func() bool { return b.Stats().Keys == 3 })
	for _, r := range []string{"r1", "r2"} {
		if st := stat(t, b, lock.Pull, r, ""); st.LastCompleted != nil {
			t.Fatalf("%s: the oldest record kept beyond completed_max: %+v", r, st.LastCompleted)
		}
	}
	for _, r := range []string{"r3", "r4", "r5"} {
		if st := stat(t, b, lock.Pull, r, ""); st.LastCompleted == nil {
			t.Fatalf("%s: a newer record dropped", r)
		}
	}
}

// TestStreamsEndWhenEtcdIsGone: a server that cannot reach etcd ends its
// streams, so that their nodes move to a server that can keep their
// sessions alive.
func TestStreamsEndWhenEtcdIsGone(t *testing.T) {
	srv := etcdtest.StartEmbedded(t)
	cfg := etcd.DefaultConfig()
	cfg.SessionGrace = 3 * time.Second
	b, err := etcd.New(t.Context(), srv.Client(t), withPrefix(cfg, etcdtest.Prefix(t)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	st := subscribe(t, b, "a")
	srv.Close()
	select {
	case <-st.Done():
	case <-time.After(time.Minute):
		t.Fatal("the stream stayed open a minute after etcd went away")
	}
	if _, err := b.TryLock(context.Background(), ttlReq("r", "a")); !errors.Is(err, lock.ErrUnavailable) {
		t.Fatalf("TryLock without etcd: %v, want ErrUnavailable", err)
	}
}

// TestResumeOnNewServer: a node resumes, with its last event id, on a
// server that started after the events it missed: the server read them from
// etcd's history when it started.
func TestResumeOnNewServer(t *testing.T) {
	b1, p := open(t, func(c *etcd.Config) { c.SessionGrace = time.Hour })
	st, sub, err := b1.Subscribe(t.Context(), lock.SubscribeRequest{Node: "n"})
	if err != nil {
		t.Fatal(err)
	}
	tryLock(t, b1, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "h"})
	tryLock(t, b1, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "n"})
	tryLock(t, b1, lock.LockRequest{Type: lock.Pull, Resource: "s", Node: "h"})
	tryLock(t, b1, lock.LockRequest{Type: lock.Pull, Resource: "s", Node: "n"})
	st.Close()
	for _, res := range []string{"r", "s"} {
		if _, err := b1.Unlock(context.Background(), lock.UnlockRequest{Type: lock.Pull, Resource: res, Node: "h", Success: res == "s", Error: map[bool]string{true: "", false: "x"}[res == "s"]}); err != nil {
			t.Fatal(err)
		}
	}
	b2 := openAt(t, p, func(c *etcd.Config) { c.SessionGrace = time.Hour })
	st2, sub2, err := b2.Subscribe(t.Context(), lock.SubscribeRequest{Node: "n", LastID: sub.ID, HasLast: true})
	if err != nil {
		t.Fatal(err)
	}
	defer st2.Close()
	if sub2.Missed || sub2.ID != sub.ID || len(sub2.Replay) != 2 ||
		sub2.Replay[0].Event.Name != lock.EventLockAssigned || sub2.Replay[1].Event.Name != lock.EventOperationCompleted {
		t.Fatalf("replay on a server started after the events: %+v", sub2)
	}
	// The same events, with the same ids, as the first server kept.
	_, sub1, err := b1.Subscribe(t.Context(), lock.SubscribeRequest{Node: "n", LastID: sub.ID, HasLast: true})
	if err != nil {
		t.Fatal(err)
	}
	for i := range sub1.Replay {
		if sub1.Replay[i].ID != sub2.Replay[i].ID || sub1.Replay[i].Event.Name != sub2.Replay[i].Event.Name {
			t.Fatalf("server 1 replays %v, server 2 %v", sub1.Replay, sub2.Replay)
		}
	}
}

// The lock delay (docs/DESIGN.md, "Leases"), which the conformance suite
// checks in fake time. A delay of an hour shows what holds during one: a
// test that needed it to end would fail its bounded wait. Short delays show
// that each hand-off comes after the delay, measured on the records'
// times, whichever server's timer ends it.

// collect waits, at most a minute, for n events of a stream, and returns
// them with any that came with them: the later ends of the hand-offs the
// tests make (a claim timeout) may follow at any time.
func collect(t *testing.T, st lock.Stream, n int) []lock.Delivery {
	t.Helper()
	timeout := time.After(time.Minute)
	var got []lock.Delivery
	for len(got) < n {
		select {
		case <-st.Ready():
			got = st.Take(got)
		case <-st.Done():
			t.Fatalf("stream ended after %d of %d events", len(got), n)
		case <-timeout:
			t.Fatalf("%d of %d events after a minute: %v", len(got), n, got)
		}
	}
	return got
}

func observe(t *testing.T, b lock.Backend, k lock.Key) lock.Stream {
	t.Helper()
	st, _, err := b.Subscribe(t.Context(), lock.SubscribeRequest{Observe: &k})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(st.Close)
	return st
}

func eventNames(ds []lock.Delivery) []string {
	var out []string
	for _, d := range ds {
		out = append(out, d.Event.Name+":"+d.Event.Node)
	}
	return out
}

// expired waits for the hold of res to have ended with reason, and returns
// the key's status then.
func expired(t *testing.T, b lock.Backend, res, reason string) lock.Status {
	t.Helper()
	var st lock.Status
	etcd.Eventually(t, "the hold of "+res+" to end: "+reason, func() bool {
		st = stat(t, b, lock.Pull, res, "")
		return st.LastCompleted != nil && st.LastCompleted.Error == reason
	})
	return st
}

// TestLockDelayReserves: in the delay after a ttl expiry the key is free
// with its waiter in place, a newcomer queues behind it, a key nobody
// waited for is reserved too, and the end of the hold has been told.
func TestLockDelayReserves(t *testing.T) {
	b, _ := open(t, func(c *etcd.Config) { c.LockTTL = time.Second; c.LockDelay = time.Hour })
	obs := observe(t, b, lock.Key{Type: lock.Pull, Resource: "r"})
	sb := subscribe(t, b, "b")
	tryLock(t, b, ttlReq("r", "a"))
	tryLock(t, b, ttlReq("solo", "a"))
	if r := tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "b", Lease: lock.LeaseSession}); !r.Queued {
		t.Fatalf("b: %+v, want queued", r)
	}
	st := expired(t, b, "r", "lock expired")
	if st.Held || st.Holder != "" || st.QueueLength != 1 || st.LastCompleted.Node != "a" {
		t.Fatalf("in the delay: %+v %+v, want free with b waiting", st, st.LastCompleted)
	}
	got := collect(t, obs, 2)
	if names := eventNames(got); names[0] != "lock_assigned:a" || names[1] != "operation_completed:a" || got[1].Event.NextHolder != "" {
		t.Fatalf("observer saw %v (%+v), want a's grant and its end with no next holder", names, got[1].Event)
	}
	if r := tryLock(t, b, ttlReq("r", "c")); !r.Queued || r.Position != 2 || r.Holder != "" {
		t.Fatalf("c in the delay: %+v, want queued second with no holder", r)
	}
	if r := tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "b"}); !r.Queued || r.Position != 1 {
		t.Fatalf("b again in the delay: %+v, want its place kept", r)
	}
	if st := stat(t, b, lock.Pull, "r", "c"); st.Held || st.QueueLength != 2 || st.Position != 2 {
		t.Fatalf("status in the delay: %+v", st)
	}
	expired(t, b, "solo", "lock expired")
	if r := tryLock(t, b, ttlReq("solo", "d")); !r.Queued || r.Position != 1 {
		t.Fatalf("d on a key nobody waited for, in its delay: %+v, want queued first", r)
	}
	etcd.Eventually(t, "the watch to count the delayed keys", func() bool {
		s := b.Stats()
		return s.Keys == 2 && s.Held == 0 && s.Queued == 3
	})
	if got := sb.Take(nil); len(got) != 0 {
		t.Fatalf("b was told %v in the delay", eventNames(got))
	}
}

// TestLockDelayMultiNodeOff: with multi-node download off a key in its
// delay is refused like a held one, naming no holder, and nobody queues.
func TestLockDelayMultiNodeOff(t *testing.T) {
	b, _ := open(t, func(c *etcd.Config) {
		c.AllowMultiNodeDownload = false
		c.LockTTL = time.Second
		c.LockDelay = time.Hour
	})
	tryLock(t, b, ttlReq("r", "a"))
	expired(t, b, "r", "lock expired")
	_, err := b.TryLock(context.Background(), ttlReq("r", "b"))
	var he *lock.HeldError
	if !errors.Is(err, lock.ErrLockHeld) || !errors.As(err, &he) || he.Holder != "" {
		t.Fatalf("b in the delay: %v, want ErrLockHeld naming no holder", err)
	}
	if st := stat(t, b, lock.Pull, "r", ""); st.QueueLength != 0 {
		t.Fatalf("b was queued: %+v", st)
	}
}

// TestLockDelayTTLHandsOn: after a ttl expiry the waiter is granted once
// the delay has passed, not before: its grant is the delay or more after
// the completion. The delay's end is no expiry.
func TestLockDelayTTLHandsOn(t *testing.T) {
	const delay = 2 * time.Second
	b, _ := open(t, func(c *etcd.Config) { c.LockTTL = time.Second; c.LockDelay = delay })
	obs := observe(t, b, lock.Key{Type: lock.Pull, Resource: "r"})
	sb := subscribe(t, b, "b")
	a := tryLock(t, b, ttlReq("r", "a"))
	tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "b", Lease: lock.LeaseSession})
	d := next(t, sb)
	if d.Event.Name != lock.EventLockAssigned || d.Event.Token <= a.Token {
		t.Fatalf("b got %+v, want lock_assigned with a newer token", d.Event)
	}
	st := stat(t, b, lock.Pull, "r", "")
	lc := st.LastCompleted
	if st.Holder != "b" || lc == nil || lc.Node != "a" || lc.Error != "lock expired" {
		t.Fatalf("status %+v %+v, want b holding after a expired", st, lc)
	}
	if gap := st.AcquiredAt.Sub(lc.CompletedAt); gap < delay {
		t.Fatalf("b was granted %v after a's hold ended, within the %v delay", gap, delay)
	}
	got := collect(t, obs, 3)
	if names := eventNames(got); names[0] != "lock_assigned:a" || names[1] != "operation_completed:a" || names[2] != "lock_assigned:b" ||
		!got[1].Event.CompletedAt.Equal(lc.CompletedAt) {
		t.Fatalf("observer saw %v, want a's end told when it ended, then b's grant", names)
	}
	etcd.Eventually(t, "the expiry to be counted", func() bool { return b.Stats().Expiries >= 1 })
	if n := b.Stats().Expiries; n != 1 {
		t.Fatalf("Expiries = %d, want 1: the delay's end is none", n)
	}
}

// TestLockDelaySessionLossOnAnotherServer: a session lost while its
// server is gone: another server ends the hold, and its timer the delay.
func TestLockDelaySessionLossOnAnotherServer(t *testing.T) {
	const delay = 2 * time.Second
	cfg := func(c *etcd.Config) { c.SessionGrace = time.Second; c.LockDelay = delay }
	b1, p := open(t, cfg)
	b2 := openAt(t, p, cfg)
	sa, _, err := b1.Subscribe(t.Context(), lock.SubscribeRequest{Node: "a"})
	if err != nil {
		t.Fatal(err)
	}
	a := tryLock(t, b1, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "a"}) // auto: a has a session
	sw := subscribe(t, b2, "w")
	tryLock(t, b2, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "w"})
	sa.Close()
	b1.Close()
	d := next(t, sw)
	if d.Event.Name != lock.EventLockAssigned || d.Event.Token <= a.Token {
		t.Fatalf("w got %+v", d.Event)
	}
	st := stat(t, b2, lock.Pull, "r", "")
	lc := st.LastCompleted
	if st.Holder != "w" || lc == nil || lc.Node != "a" || lc.Error != "session lost" {
		t.Fatalf("status %+v %+v, want w holding after a's session was lost", st, lc)
	}
	if gap := st.AcquiredAt.Sub(lc.CompletedAt); gap < delay {
		t.Fatalf("w was granted %v after a's hold ended, within the %v delay", gap, delay)
	}
}

// TestLockDelayNotForOtherEnds: with a delay of an hour, an unlock, a
// cancel, a claim timeout and max hold still hand the key on at once.
func TestLockDelayNotForOtherEnds(t *testing.T) {
	b, _ := open(t, func(c *etcd.Config) {
		c.LockDelay = time.Hour
		c.ClaimTimeout = time.Second
		c.MaxHold = 2 * time.Second
	})
	req := func(res, node string) lock.LockRequest {
		return lock.LockRequest{Type: lock.Pull, Resource: res, Node: node}
	}
	tryLock(t, b, req("unlock", "a"))
	tryLock(t, b, req("unlock", "b"))
	if r, err := b.Unlock(context.Background(), lock.UnlockRequest{Type: lock.Pull, Resource: "unlock", Node: "a", Error: "x"}); err != nil || r.NextHolder != "b" {
		t.Fatalf("a failed unlock: %+v %v, want b next at once", r, err)
	}
	tryLock(t, b, req("cancel", "a"))
	tryLock(t, b, req("cancel", "b"))
	if r, err := b.Cancel(context.Background(), lock.Pull, "cancel", "a"); err != nil || !r.Released {
		t.Fatalf("the holder's cancel: %+v %v", r, err)
	}
	if st := stat(t, b, lock.Pull, "cancel", ""); st.Holder != "b" {
		t.Fatalf("after the holder's cancel: %+v, want b at once", st)
	}
	claim := observe(t, b, lock.Key{Type: lock.Pull, Resource: "claim"})
	tryLock(t, b, req("claim", "a"))
	tryLock(t, b, req("claim", "b"))
	tryLock(t, b, req("claim", "c"))
	if _, err := b.Unlock(context.Background(), lock.UnlockRequest{Type: lock.Pull, Resource: "claim", Node: "a", Error: "x"}); err != nil {
		t.Fatal(err)
	}
	// b never confirms: at its claim timeout the key goes to c.
	got := collect(t, claim, 5)
	if names := eventNames(got); names[3] != "lock_assigned:c" || names[4] != "operation_completed:b" || got[4].Event.Error != "not claimed" {
		t.Fatalf("claim's observer saw %v, want c granted at b's claim timeout", names)
	}
	hold := observe(t, b, lock.Key{Type: lock.Pull, Resource: "hold"})
	tryLock(t, b, req("hold", "x"))
	tryLock(t, b, req("hold", "y"))
	got = collect(t, hold, 3)
	if names := eventNames(got); names[1] != "lock_assigned:y" || names[2] != "operation_completed:x" || got[2].Event.Error != "max hold exceeded" {
		t.Fatalf("hold's observer saw %v, want y granted at x's max hold", names)
	}
}

// TestLockDelayEndsFree: a delay nobody waited through leaves nothing: with
// no completion record kept, the key's record goes at the delay's end, and
// the next /lock is granted.
func TestLockDelayEndsFree(t *testing.T) {
	b, _ := open(t, func(c *etcd.Config) { c.LockTTL = time.Second; c.LockDelay = time.Second; c.CompletedRetention = 0 })
	tryLock(t, b, ttlReq("r", "a"))
	// The key is counted while held and in its delay, and no longer once
	// the watch has seen its record go.
	etcd.Eventually(t, "the expiry, with the key still counted", func() bool { s := b.Stats(); return s.Expiries == 1 && s.Keys == 1 })
	etcd.Eventually(t, "the key's record to go after its delay", func() bool { return b.Stats().Keys == 0 })
	if r := tryLock(t, b, ttlReq("r", "b")); !r.Acquired {
		t.Fatalf("after the delay: %+v, want acquired", r)
	}
}
