package etcd

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"google.golang.org/grpc"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
)

// Attacks on grouped requests (group.go; docs/DESIGN.md, "Fewer, larger
// transactions") that need the grouper's insides.

// holdEtcd is an etcd that does not answer some requests: a client
// interceptor holds each transaction that writes a key containing marker
// until release is closed or its context ends, as an etcd member that is
// frozen, or behind a path that drops packets, holds every request sent
// to it. The rest go through.
type holdEtcd struct {
	marker  string
	release chan struct{}
	held    atomic.Int32 // requests held now
}

func (h *holdEtcd) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if r, ok := req.(*pb.TxnRequest); ok && writesMarked(r, h.marker) {
		h.held.Add(1)
		defer h.held.Add(-1)
		select {
		case <-h.release:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return invoker(ctx, method, req, reply, cc, opts...)
}

func writesMarked(r *pb.TxnRequest, marker string) bool {
	for _, op := range r.Success {
		if p := op.GetRequestPut(); p != nil && strings.Contains(string(p.Key), marker) {
			return true
		}
		if t := op.GetRequestTxn(); t != nil && writesMarked(t, marker) {
			return true
		}
	}
	return false
}

// newHeldBackend is a backend on the shared etcd through a client that h
// intercepts.
func newHeldBackend(t *testing.T, h *holdEtcd) *Backend {
	t.Helper()
	cli := etcdtest.Shared(t).Client(t, grpc.WithChainUnaryInterceptor(h.intercept))
	cfg := DefaultConfig()
	cfg.Prefix = etcdtest.Prefix(t)
	b, err := New(context.Background(), cli, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// ownStripes returns a function that names resources of b's stripes no
// other resource it named has: calls of one stripe wait for each other
// before they reach the grouper (tx.go, run).
func ownStripes(b *Backend) func(name string) string {
	used := map[uint64]bool{}
	return func(name string) string {
		for i := 0; ; i++ {
			r := fmt.Sprintf("%s-%d", name, i)
			if s := maphash.String(b.seed, r) % uint64(len(b.stripes)); !used[s] {
				used[s] = true
				return r
			}
		}
	}
}

// TestAttackGroupHungRequest: requests that etcd does not answer (a member
// frozen, or behind a path that drops packets, holds every request the
// client sends it, until the request's deadline) must hold back only the
// transactions they carry. Before requests were grouped, every call had a
// request of its own, and one sent to such a member held that call alone;
// with at most groupFlight requests in flight, two sent to it held every
// call of every key on the server for callTimeout, answered 503 (with one
// of two endpoints black-holed, 15 of 16 concurrent calls of different
// keys failed, where 8 did before).
func TestAttackGroupHungRequest(t *testing.T) {
	h := &holdEtcd{marker: "/stuck-", release: make(chan struct{})}
	b := newHeldBackend(t, h)
	resource := ownStripes(b)
	ctx := context.Background()

	type result struct {
		r   lock.LockResult
		err error
	}
	results := make(chan result, groupFlight)
	for i := range groupFlight {
		// One at a time, so that each has a request of its own.
		res := resource(fmt.Sprintf("stuck-%d", i))
		go func() {
			r, err := b.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: res, Node: "s", Lease: lock.LeaseTTL})
			results <- result{r, err}
		}()
		kit.WaitFor(t, "a request etcd does not answer", func() bool { return h.held.Load() == int32(i+1) })
	}

	// A call of another key, bounded well under callTimeout, after which
	// etcd's silence would end the held requests anyway.
	cctx, cancel := context.WithTimeout(ctx, callTimeout/2)
	defer cancel()
	r, err := b.TryLock(cctx, lock.LockRequest{Type: lock.Pull, Resource: resource("free"), Node: "f", Lease: lock.LeaseTTL})
	if err != nil || !r.Acquired {
		t.Errorf("a call of another key, while %d requests wait for etcd: %+v %v; it waited behind them", groupFlight, r, err)
	}
	if n := h.held.Load(); n != groupFlight {
		t.Fatalf("%d requests held when the call returned, want %d: the test proved nothing", n, groupFlight)
	}
	if b.g.stalled.Load() == 0 {
		t.Errorf("no request counted as stalled (dlock_etcd_stalled_requests_total)")
	}

	// etcd answers the held requests, late: their calls are granted.
	close(h.release)
	for range groupFlight {
		if res := <-results; res.err != nil || !res.r.Acquired {
			t.Errorf("a call whose request etcd answered late: %+v %v", res.r, res.err)
		}
	}
}

// TestAttackGroupCloseWhileHung: Close ends the calls whose requests etcd
// has not answered, and leaves no goroutine behind (goleak, TestMain).
func TestAttackGroupCloseWhileHung(t *testing.T) {
	h := &holdEtcd{marker: "/stuck-", release: make(chan struct{})}
	defer close(h.release)
	b := newHeldBackend(t, h)
	resource := ownStripes(b)
	errs := make(chan error, 2*groupFlight)
	for i := range 2 * groupFlight {
		res := resource(fmt.Sprintf("stuck-%d", i))
		go func() {
			_, err := b.TryLock(context.Background(), lock.LockRequest{Type: lock.Pull, Resource: res, Node: "s", Lease: lock.LeaseTTL})
			errs <- err
		}()
	}
	kit.WaitFor(t, "requests etcd does not answer", func() bool { return h.held.Load() >= 1 })
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	for range 2 * groupFlight {
		if err := <-errs; !errors.Is(err, lock.ErrClosed) {
			t.Errorf("a call in flight at Close: %v, want %v", err, lock.ErrClosed)
		}
	}
}

// TestAttackGroupResumeMidRevision: a node granted two keys in one grouped
// request gets two events of one revision; a stream that saw only the
// first resumes on another server with exactly the second, and one that
// saw both with none, neither told it missed anything (docs/DESIGN.md,
// "Events are derived, not stored").
func TestAttackGroupResumeMidRevision(t *testing.T) {
	srv := etcdtest.Shared(t)
	cfg := DefaultConfig()
	cfg.Prefix = etcdtest.Prefix(t)
	ctx := context.Background()
	a, err := New(ctx, srv.Client(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := New(ctx, srv.Client(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	resource := ownStripes(a)
	st, _, err := a.Subscribe(ctx, lock.SubscribeRequest{Node: "n"})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	// n's session gets its own lease first (docs/DESIGN.md, "Home
	// leases"): two calls that both gave it one would not share a
	// revision, the second's guard failing on the first's put.
	if r, err := a.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: resource("own"), Node: "n", Lease: lock.LeaseSession}); err != nil || !r.Acquired {
		t.Fatalf("n's first hold: %+v %v", r, err)
	}
	for got := 0; got < 1; {
		select {
		case <-st.Ready():
			got = len(st.Take(nil))
		case <-time.After(10 * time.Second):
			t.Fatal("n's stream was not told of its first hold")
		}
	}

	// Both request slots held by a call each, so that n's two calls wait
	// together and leave in one request.
	var held atomic.Int32
	release := make(chan struct{})
	hold := func() {
		held.Add(1)
		<-release
	}
	a.g.hold.Store(&hold)
	done := make(chan error, groupFlight+2)
	lockKey := func(res, node string, lease lock.Lease) {
		r, err := a.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: res, Node: node, Lease: lease})
		if err == nil && !r.Acquired {
			err = fmt.Errorf("%s on %s: %+v", node, res, r)
		}
		done <- err
	}
	// The plugs hold with TTL leases: a plug's first session-leased hold
	// would give its session a lease, and such calls go one request at a
	// time (grouper.take).
	for i := range groupFlight {
		go lockKey(resource("plug"), fmt.Sprint("plug", i), lock.LeaseTTL)
		kit.WaitFor(t, "a request slot to be held", func() bool { return held.Load() == int32(i+1) })
	}
	go lockKey(resource("k1"), "n", lock.LeaseSession)
	go lockKey(resource("k2"), "n", lock.LeaseSession)
	kit.WaitFor(t, "n's calls to wait for a request", func() bool {
		a.g.mu.Lock()
		defer a.g.mu.Unlock()
		return len(a.g.q) == 2
	})
	a.g.hold.Store(nil)
	close(release)
	for range groupFlight + 2 {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	var got []lock.Delivery
	deadline := time.After(10 * time.Second)
	for len(got) < 2 {
		select {
		case <-st.Ready():
			got = st.Take(got)
		case <-deadline:
			t.Fatalf("n's stream has %d events, want 2", len(got))
		}
	}
	if len(got) != 2 || idRev(got[0].ID) != idRev(got[1].ID) || got[0].ID >= got[1].ID {
		t.Fatalf("n's events %+v: want two of one revision, increasing", got)
	}
	st.Close()
	kit.WaitFor(t, "b's watch to reach the grants", func() bool { return b.w.caughtUp(idRev(got[1].ID), 100*time.Millisecond) })
	for i, want := range [][]lock.Delivery{got[1:], nil} {
		st2, sub, err := b.Subscribe(ctx, lock.SubscribeRequest{Node: "n", LastID: got[i].ID, HasLast: true})
		if err != nil {
			t.Fatal(err)
		}
		st2.Close()
		if sub.Missed || sub.ID != got[i].ID || len(sub.Replay) != len(want) || (len(want) == 1 && sub.Replay[0].ID != want[0].ID) {
			t.Errorf("resumed after %d on the other server: missed=%v id=%d replay=%+v; want %+v", got[i].ID, sub.Missed, sub.ID, sub.Replay, want)
		}
	}
}
