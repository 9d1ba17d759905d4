package etcd

import (
	"context"
	"fmt"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
)

// Home leases (docs/DESIGN.md, "Home leases"): a session made by a server
// lives on that server's one lease until it needs its own.

// homeCluster opens n backends on one data set, with grace.
func homeCluster(t *testing.T, n int, grace time.Duration) ([]*Backend, *clientv3.Client) {
	t.Helper()
	srv := etcdtest.Shared(t)
	cfg := DefaultConfig()
	cfg.Prefix = etcdtest.Prefix(t)
	cfg.SessionGrace = grace
	var bs []*Backend
	for range n {
		b, err := New(context.Background(), srv.Client(t), cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { b.Close() })
		bs = append(bs, b)
	}
	return bs, srv.Client(t)
}

// sessionOf reads node's session record from etcd, and the lease etcd
// attached it to.
func sessionOf(t *testing.T, cli *clientv3.Client, b *Backend, node string) (rec sessRec, attached int64, ok bool) {
	t.Helper()
	resp, err := cli.Get(t.Context(), b.n.session(node))
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		return sessRec{}, 0, false
	}
	if err := jsonUnmarshal(resp.Kvs[0].Value, &rec); err != nil {
		t.Fatal(err)
	}
	return rec, resp.Kvs[0].Lease, true
}

// leaseExists asks etcd whether it has lease id.
func leaseExists(t *testing.T, cli *clientv3.Client, id int64) bool {
	t.Helper()
	r, err := cli.TimeToLive(t.Context(), clientv3.LeaseID(id))
	if err != nil {
		t.Fatal(err)
	}
	return r.TTL > 0
}

func subscribe(t *testing.T, b *Backend, node string) lock.Stream {
	t.Helper()
	s, _, err := b.Subscribe(t.Context(), lock.SubscribeRequest{Node: node})
	if err != nil {
		t.Fatalf("%s's stream: %v", node, err)
	}
	return s
}

// TestHomeSessionsGrantNoLease: sessions made by one server live on its
// home lease, one for all of them: opening them grants no lease each, and
// keeps none alive but the one.
func TestHomeSessionsGrantNoLease(t *testing.T) {
	bs, cli := homeCluster(t, 1, 10*time.Second)
	b := bs[0]
	before, err := cli.Leases(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	const n = 20
	for i := range n {
		s := subscribe(t, b, fmt.Sprint("node-", i))
		defer s.Close()
	}
	after, err := cli.Leases(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if grew := len(after.Leases) - len(before.Leases); grew > 1 {
		t.Errorf("%d sessions granted %d leases, want the home lease alone", n, grew)
	}
	home := b.s.homeID()
	for i := range n {
		rec, attached, ok := sessionOf(t, cli, b, fmt.Sprint("node-", i))
		if !ok || rec.Home != home || home == 0 || attached != home || rec.Lease == 0 || rec.Lease == home {
			t.Fatalf("node-%d's session: %+v attached to %x, want its own id on home lease %x", i, rec, attached, home)
		}
		if leaseExists(t, cli, rec.Lease) {
			t.Fatalf("node-%d's reserved lease %x was granted", i, rec.Lease)
		}
	}
	if kept := b.keeper.kept.Load(); kept != 1 {
		t.Errorf("the keeper keeps %d leases for %d idle sessions, want 1", kept, n)
	}
}

// TestHomeSessionEndsAfterItsGrace: a session on the home lease whose last
// stream closed ends a grace later, as a lease no one kept did; a stream
// that comes back first keeps it, with no end waiting.
func TestHomeSessionEndsAfterItsGrace(t *testing.T) {
	bs, cli := homeCluster(t, 1, time.Second)
	b := bs[0]
	s := subscribe(t, b, "back")
	rec, _, _ := sessionOf(t, cli, b, "back")
	s.Close()
	s = subscribe(t, b, "back")
	b.s.mu.Lock()
	ls := b.s.local["back"]
	b.s.mu.Unlock()
	if ls == nil || ls.lease != rec.Lease || ls.streams != 1 || ls.end != nil {
		t.Fatalf("the stream that came back: %+v, want the session %x counted once and no end waiting", ls, rec.Lease)
	}
	s.Close()
	kit.WaitFor(t, "the session to end a grace after its last stream", func() bool {
		_, _, ok := sessionOf(t, cli, b, "back")
		return !ok
	})
	kit.WaitFor(t, "the server to count the session's clean end", func() bool { return b.Stats().SessionsClosed == 1 })
	b.s.mu.Lock()
	defer b.s.mu.Unlock()
	if ls := b.s.local["back"]; ls != nil {
		t.Fatalf("the ended session is still kept here: %+v", ls)
	}
}

// TestHomeSessionMovesOn: a node whose session lives on server A's home
// lease leaves A and opens a stream on server B (A died, or its stream
// broke): B moves the session onto its own home lease before it counts
// the stream, granting nothing, so that A's home lease running out (revoked
// here) ends nothing. A, with no stream of the node, forgets it.
func TestHomeSessionMovesOn(t *testing.T) {
	bs, cli := homeCluster(t, 2, 10*time.Second)
	a, b := bs[0], bs[1]
	sa := subscribe(t, a, "mover")
	rec, _, _ := sessionOf(t, cli, a, "mover")
	if rec.Home != a.s.homeID() {
		t.Fatalf("the session %+v, want it on A's home lease %x", rec, a.s.homeID())
	}
	sa.Close()
	caughtUp(t, b, a)
	sb := subscribe(t, b, "mover")
	defer sb.Close()
	moved, attached, ok := sessionOf(t, cli, a, "mover")
	if !ok || moved.Lease != rec.Lease || moved.Home != b.s.homeID() || attached != moved.Home {
		t.Fatalf("after B's stream: %+v attached to %x, want the same session on B's home lease %x", moved, attached, b.s.homeID())
	}
	if leaseExists(t, cli, rec.Lease) || a.promotions.Load()+b.promotions.Load() != 0 || b.rehomes.Load() != 1 {
		t.Errorf("the move granted the session's lease (%v), promoted %d times, moved %d times: want a move alone",
			leaseExists(t, cli, rec.Lease), a.promotions.Load()+b.promotions.Load(), b.rehomes.Load())
	}
	kit.WaitFor(t, "A to forget the session", func() bool { _, ok := localOf(a, "mover"); return !ok })
	if _, err := cli.Revoke(t.Context(), clientv3.LeaseID(rec.Home)); err != nil {
		t.Fatal(err)
	}
	caughtUp(t, b, a)
	if again, _, ok := sessionOf(t, cli, a, "mover"); !ok || again != moved {
		t.Fatalf("A's home lease gone, the moved session is %+v (exists %v)", again, ok)
	}
	select {
	case <-sb.Done():
		t.Fatal("B's stream ended with A's home lease")
	default:
	}
}

// TestHomeSessionOnTwoServers: a node whose session lives on A's home lease
// opens a second stream on B while its stream on A stays. B moves the
// session onto its home lease; A, seeing its node's session leave with a
// stream still here, gives it its own lease (adopt), which both keep
// alive: neither server's home lease running out ends it.
func TestHomeSessionOnTwoServers(t *testing.T) {
	bs, cli := homeCluster(t, 2, 10*time.Second)
	a, b := bs[0], bs[1]
	sa := subscribe(t, a, "twice")
	defer sa.Close()
	rec, _, _ := sessionOf(t, cli, a, "twice")
	caughtUp(t, b, a)
	sb := subscribe(t, b, "twice")
	defer sb.Close()
	kit.WaitFor(t, "the session on its own lease", func() bool {
		own, attached, ok := sessionOf(t, cli, a, "twice")
		return ok && own == sessRec{Lease: rec.Lease} && attached == rec.Lease
	})
	kit.WaitFor(t, "A and B to keep its lease alive", func() bool {
		return !a.keeper.until(rec.Lease).IsZero() && !b.keeper.until(rec.Lease).IsZero()
	})
	for _, home := range []int64{a.s.homeID(), b.s.homeID()} {
		if _, err := cli.Revoke(t.Context(), clientv3.LeaseID(home)); err != nil {
			t.Fatal(err)
		}
	}
	caughtUp(t, a, b)
	if again, _, ok := sessionOf(t, cli, a, "twice"); !ok || again.Lease != rec.Lease {
		t.Fatalf("both home leases gone, the session is %+v (exists %v)", again, ok)
	}
	for name, s := range map[string]lock.Stream{"A": sa, "B": sb} {
		if streamDone(s) {
			t.Errorf("%s's stream ended with the home leases", name)
		}
	}
}

// TestHomeSessionHoldGetsItsLease: a session-leased hold is taken only with
// the session on its own lease, in the hold's transaction, whichever
// server is asked; the server with the node's stream keeps that lease alive
// from then on, and the hold outlives the home lease.
func TestHomeSessionHoldGetsItsLease(t *testing.T) {
	for _, via := range []int{0, 1} {
		t.Run(fmt.Sprint("via=", via), func(t *testing.T) {
			bs, cli := homeCluster(t, 2, 10*time.Second)
			a := bs[0]
			s := subscribe(t, a, "holder")
			defer s.Close()
			rec, _, _ := sessionOf(t, cli, a, "holder")
			caughtUp(t, bs[via], a)
			r, err := bs[via].TryLock(t.Context(), lock.LockRequest{Type: lock.Pull, Resource: "layer", Node: "holder"})
			if err != nil || !r.Acquired {
				t.Fatalf("the lock: %+v %v", r, err)
			}
			own, attached, ok := sessionOf(t, cli, a, "holder")
			if !ok || own.Home != 0 || attached != rec.Lease || !leaseExists(t, cli, rec.Lease) {
				t.Fatalf("after a session-leased hold: %+v attached to %x, want its own lease %x granted", own, attached, rec.Lease)
			}
			kit.WaitFor(t, "the stream's server to keep the session's lease", func() bool { return !a.keeper.until(rec.Lease).IsZero() })
			if _, err := cli.Revoke(t.Context(), clientv3.LeaseID(rec.Home)); err != nil {
				t.Fatal(err)
			}
			caughtUp(t, a, bs...)
			st, err := a.Status(t.Context(), lock.Pull, "layer", "holder")
			if err != nil || st.Holder != "holder" {
				t.Fatalf("the home lease gone, the hold is %+v %v", st, err)
			}
			if n := a.promotions.Load() + bs[1].promotions.Load(); n != 1 {
				t.Errorf("%d promotions, want 1", n)
			}
		})
	}
}

// TestHomeLeaseLost: a server whose home lease etcd no longer has (cut off
// for a grace, or frozen) loses the sessions on it, as it lost their
// leases before, and grants a new home lease for the next.
func TestHomeLeaseLost(t *testing.T) {
	bs, cli := homeCluster(t, 1, 10*time.Second)
	b := bs[0]
	s := subscribe(t, b, "n1")
	old := b.s.homeID()
	if _, err := cli.Revoke(t.Context(), clientv3.LeaseID(old)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-s.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("the stream of a session on a revoked home lease did not end")
	}
	s.Close()
	s = subscribe(t, b, "n2")
	defer s.Close()
	rec, _, ok := sessionOf(t, cli, b, "n2")
	if !ok || rec.Home == old || rec.Home != b.s.homeID() || !leaseExists(t, cli, rec.Home) {
		t.Fatalf("the next session %+v (exists %v), want it on a new home lease, not %x", rec, ok, old)
	}
}

// TestHomeEndGuarded: the end of a session on the home lease deletes its
// record only while it is that record: a session another server moved onto
// its own home lease since stands.
func TestHomeEndGuarded(t *testing.T) {
	bs, cli := homeCluster(t, 2, 10*time.Second)
	a, b := bs[0], bs[1]
	s := subscribe(t, a, "raced")
	s.Close()
	a.s.mu.Lock()
	ls := a.s.local["raced"]
	if ls == nil || ls.end == nil {
		a.s.mu.Unlock()
		t.Fatalf("after its last stream: %+v, want an end waiting", ls)
	}
	ls.stopEnd() // fired below, late, as if A's watch had not seen B yet
	a.s.mu.Unlock()
	caughtUp(t, b, a)
	sb := subscribe(t, b, "raced")
	defer sb.Close()
	// A's watch tells it of the move, which forgets the end: put the
	// entry back, as if the timer had fired first.
	a.s.mu.Lock()
	a.s.local["raced"] = ls
	a.s.mu.Unlock()
	a.s.endHomed("raced", ls)
	if rec, _, ok := sessionOf(t, cli, a, "raced"); !ok || rec.Home != b.s.homeID() || rec.Lease != ls.lease {
		t.Fatalf("a late end of A's deleted %+v (exists %v), want it on B's home lease %x", rec, ok, b.s.homeID())
	}
}
