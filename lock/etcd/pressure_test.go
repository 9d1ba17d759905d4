package etcd

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
)

// fakeLag replaces b's keepalive lag (keeper.lag) with one the test sets,
// against a period of every, and counts how often the grouper looked.
type fakeLag struct {
	lag    atomic.Int64
	looked atomic.Int64
}

const fakeEvery = 3 * time.Second

func newFakeLag(b *Backend) *fakeLag {
	f := &fakeLag{}
	fn := func(time.Time) (time.Duration, time.Duration) {
		f.looked.Add(1)
		return time.Duration(f.lag.Load()), fakeEvery
	}
	b.g.lag.Store(&fn)
	return f
}

func (f *fakeLag) set(d time.Duration) { f.lag.Store(int64(d)) }

// waitLooks waits until the grouper has looked at the lag n times more:
// it decided n times with the lag as set.
func (f *fakeLag) waitLooks(t *testing.T, n int64) {
	t.Helper()
	from := f.looked.Load()
	kit.WaitFor(t, "the grouper to look at the keepalives' lag", func() bool { return f.looked.Load() >= from+n })
}

func newPlainBackend(t *testing.T) *Backend {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Prefix = etcdtest.Prefix(t)
	b, err := New(context.Background(), etcdtest.Shared(t).Client(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// TestGroupGivesWayToKeepalives: while the server's keepalives wait on
// etcd, the lock path holds its requests back (none from half a period of
// lag, one at a time from an eighth), and sends at full rate again once
// they are answered (docs/DESIGN.md, "Fewer, larger transactions"): etcd
// 3.4 lost every session to a burst of writes it committed faster than it
// applied (docs/BENCHMARKS.md, "Fleet scale on etcd").
func TestGroupGivesWayToKeepalives(t *testing.T) {
	b := newPlainBackend(t)
	f := newFakeLag(b)
	resource := ownStripes(b)
	ctx := context.Background()
	lockKey := func(res, node string) error {
		r, err := b.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: res, Node: node, Lease: lock.LeaseTTL})
		if err == nil && !r.Acquired {
			err = fmt.Errorf("%s on %s not acquired: %+v", node, res, r)
		}
		return err
	}

	// Held: a /lock waits, no request goes.
	f.set(fakeEvery / 2)
	requests := b.g.requests.Load()
	done := make(chan error, 1)
	go func() { done <- lockKey(resource("held"), "h") }()
	kit.WaitFor(t, "the /lock to queue", b.g.queued)
	f.waitLooks(t, 5)
	select {
	case err := <-done:
		t.Fatalf("a /lock returned while the keepalives waited half a period: %v", err)
	default:
	}
	if n := b.g.requests.Load(); n != requests {
		t.Fatalf("%d requests sent while the keepalives waited half a period", n-requests)
	}
	// A transaction of a lease its call granted goes meanwhile: its lease
	// runs out if it waits (a new session's, made before the lag grew).
	g, err := etcdtest.Shared(t).Client(t).Grant(ctx, 5)
	if err != nil {
		t.Fatal(err)
	}
	key := b.n.p + "held-leased"
	if _, _, err := b.g.commit(ctx, nil, []clientv3.Op{clientv3.OpPut(key, "", clientv3.WithLease(g.ID))}, true); err != nil {
		t.Fatalf("a leased transaction while the keepalives waited half a period: %v", err)
	}
	select {
	case err := <-done:
		t.Fatalf("a /lock returned while the keepalives waited half a period: %v", err)
	default:
	}
	// The keepalives are answered again: it goes.
	f.set(0)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if b.g.throttled.Load() == 0 {
		t.Error("the wait is not counted (dlock_etcd_throttled_seconds_total)")
	}

	// Slowed: one request in flight. The first is held before it is sent
	// (hold), and the second does not go meanwhile.
	var held atomic.Int32
	release := make(chan struct{})
	hold := func() {
		held.Add(1)
		<-release
	}
	b.g.hold.Store(&hold)
	f.set(fakeEvery / 4)
	errs := make(chan error, 2)
	go func() { errs <- lockKey(resource("slow-1"), "s1") }()
	kit.WaitFor(t, "the first request to be on its way", func() bool { return held.Load() == 1 })
	go func() { errs <- lockKey(resource("slow-2"), "s2") }()
	kit.WaitFor(t, "the second /lock to queue", b.g.queued)
	f.waitLooks(t, 5) // the other runner looked, and left it
	if n := held.Load(); n != 1 {
		t.Fatalf("%d requests on their way while the keepalives waited an eighth of a period, want 1", n)
	}
	close(release)
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}

	// Free again: two requests in flight at once.
	held.Store(0)
	release = make(chan struct{})
	f.set(0)
	for i := range groupFlight {
		go func() { errs <- lockKey(resource(fmt.Sprintf("free-%d", i)), fmt.Sprintf("f%d", i)) }()
		kit.WaitFor(t, "a request slot to be held", func() bool { return held.Load() == int32(i+1) })
	}
	close(release)
	for range groupFlight {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	b.g.hold.Store(nil)
}

// TestGroupHeldCallEnds: a call held back by the keepalives' lag ends with
// its context, having written nothing.
func TestGroupHeldCallEnds(t *testing.T) {
	b := newPlainBackend(t)
	f := newFakeLag(b)
	res := ownStripes(b)("held")
	r, err := b.TryLock(context.Background(), lock.LockRequest{Type: lock.Pull, Resource: res, Node: "h", Lease: lock.LeaseTTL})
	if err != nil || !r.Acquired {
		t.Fatalf("%+v %v", r, err)
	}
	f.set(fakeEvery)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := b.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: res, Node: "h", Token: r.Token, Success: true})
		done <- err
	}()
	kit.WaitFor(t, "the /unlock to queue", b.g.queued)
	f.waitLooks(t, 3)
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("a held /unlock whose context ended: %v, want context.Canceled", err)
	}
	f.set(0)
	st, err := b.Status(context.Background(), lock.Pull, res, "")
	if err != nil || !st.Held || st.Holder != "h" {
		t.Fatalf("the key of an /unlock that ended held back: %+v, %v; want it held by h still", st, err)
	}
}

// TestSessionLeaseRanOut: a new session whose lease runs out before etcd
// writes its record (etcd a TTL behind: seen with 3,000 sessions opening
// on a loaded machine) is refused as unavailable, which its client tries
// again, not with etcd's own error; and the node's next try makes it.
func TestSessionLeaseRanOut(t *testing.T) {
	b := newPlainBackend(t)
	ctx := context.Background()
	cli := etcdtest.Shared(t).Client(t)
	before := map[clientv3.LeaseID]bool{}
	ls, err := cli.Leases(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range ls.Leases {
		before[l.ID] = true
	}
	// Before each request: every lease granted since the test began runs
	// out, as it would in an etcd a TTL behind.
	var revoked atomic.Int32
	hold := func() {
		ls, err := cli.Leases(ctx)
		if err != nil {
			t.Error(err)
			return
		}
		for _, l := range ls.Leases {
			if !before[l.ID] {
				if _, err := cli.Revoke(ctx, l.ID); err == nil {
					revoked.Add(1)
				}
			}
		}
	}
	b.g.hold.Store(&hold)
	_, _, err = b.Subscribe(ctx, lock.SubscribeRequest{Node: "late"})
	b.g.hold.Store(nil)
	if !errors.Is(err, lock.ErrUnavailable) || revoked.Load() == 0 {
		t.Fatalf("a session whose lease ran out: %v (%d leases revoked), want unavailable", err, revoked.Load())
	}
	s, _, err := b.Subscribe(ctx, lock.SubscribeRequest{Node: "late"})
	if err != nil {
		t.Fatalf("the next try: %v", err)
	}
	s.Close()
}

// TestGroupLeasedTogether: transactions that put keys with leases their
// calls granted share a request with each other; when one of the leases
// is gone, etcd refuses the whole request, and each is sent again alone:
// only the one of the missing lease fails.
func TestGroupLeasedTogether(t *testing.T) {
	b := newPlainBackend(t)
	ctx := context.Background()
	cli := etcdtest.Shared(t).Client(t)
	grant := func() clientv3.LeaseID {
		g, err := cli.Grant(ctx, 5)
		if err != nil {
			t.Fatal(err)
		}
		return g.ID
	}
	put := func(wg *sync.WaitGroup, key string, lease clientv3.LeaseID, errs *[]error, i int) {
		defer wg.Done()
		_, resp, err := b.g.txn(ctx, []clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(key), "=", 0)},
			[]clientv3.Op{clientv3.OpPut(key, "v", clientv3.WithLease(lease))}, []clientv3.Op{clientv3.OpGet(key)}, true)
		if err == nil && !resp.GetSucceeded() {
			err = fmt.Errorf("%s: a guard failed", key)
		}
		(*errs)[i] = err
	}
	// run puts keys with leases, all queued while both request slots are
	// held, so that they leave together.
	run := func(name string, leases []clientv3.LeaseID) []error {
		var held atomic.Int32
		release := make(chan struct{})
		hold := func() {
			held.Add(1)
			<-release
		}
		b.g.hold.Store(&hold)
		defer b.g.hold.Store(nil)
		var plugs sync.WaitGroup
		for i := range groupFlight {
			plugs.Add(1)
			go func() {
				defer plugs.Done()
				if _, _, err := b.g.commit(ctx, nil, []clientv3.Op{clientv3.OpPut(b.n.p+name+fmt.Sprintf("/plug-%d", i), "")}, false); err != nil {
					t.Error(err)
				}
			}()
			kit.WaitFor(t, "a request slot to be held", func() bool { return held.Load() == int32(i+1) })
		}
		errs := make([]error, len(leases))
		var wg sync.WaitGroup
		for i, l := range leases {
			wg.Add(1)
			go put(&wg, fmt.Sprintf("%s%s/%d", b.n.p, name, i), l, &errs, i)
		}
		kit.WaitFor(t, "the leased transactions to queue", func() bool {
			b.g.mu.Lock()
			defer b.g.mu.Unlock()
			return len(b.g.q) == len(leases)
		})
		b.g.hold.Store(nil)
		close(release)
		plugs.Wait()
		wg.Wait()
		return errs
	}

	grouped, singles := b.g.grouped.Load(), b.g.singles.Load()
	leases := []clientv3.LeaseID{grant(), grant(), grant()}
	for i, err := range run("together", leases) {
		if err != nil {
			t.Fatalf("leased transaction %d: %v", i, err)
		}
	}
	if b.g.grouped.Load() == grouped {
		t.Fatal("the leased transactions did not share a request")
	}
	if b.g.singles.Load() != singles {
		t.Fatal("leased transactions were sent again alone, with every lease there")
	}
	var rev int64
	for i := range leases {
		r, err := cli.Get(ctx, fmt.Sprintf("%stogether/%d", b.n.p, i))
		if err != nil || len(r.Kvs) != 1 || r.Kvs[0].Lease != int64(leases[i]) {
			t.Fatalf("key %d: %+v %v", i, r, err)
		}
		if rev != 0 && r.Kvs[0].ModRevision != rev {
			t.Fatalf("key %d written at revision %d, the one before at %d: not one request", i, r.Kvs[0].ModRevision, rev)
		}
		rev = r.Kvs[0].ModRevision
	}

	gone := grant()
	if _, err := cli.Revoke(ctx, gone); err != nil {
		t.Fatal(err)
	}
	leases = []clientv3.LeaseID{grant(), gone, grant()}
	errs := run("gone", leases)
	for i, err := range errs {
		switch {
		case i == 1 && err == nil:
			t.Fatal("the transaction of a revoked lease succeeded")
		case i == 1 && !errors.Is(err, rpctypes.ErrLeaseNotFound):
			t.Logf("the transaction of a revoked lease: %v", err)
		case i != 1 && err != nil:
			t.Fatalf("leased transaction %d, its lease there: %v", i, err)
		}
	}
	if got := b.g.singles.Load() - singles; got != uint64(len(leases)) {
		t.Fatalf("%d leased transactions sent again alone, want %d", got, len(leases))
	}
	if r, err := cli.Get(ctx, fmt.Sprintf("%sgone/1", b.n.p)); err != nil || len(r.Kvs) != 0 {
		t.Fatalf("the key of the revoked lease: %+v %v", r, err)
	}
}
