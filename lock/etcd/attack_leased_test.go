package etcd

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
)

// Attacks on the one-leased-request-in-flight rule (group.go, take):
// leased transactions wait for the leased request in flight, which counts
// until answered or for its stall at most.

// leasedPut is a patient leased transaction, as a session put on the home
// lease is (txnHomed; its lane only: the put carries no lease), or a plain
// one, that puts key if it is absent.
func leasedPut(ctx context.Context, g *grouper, key string, leased bool) error {
	cmps := []clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(key), "=", 0)}
	var ok bool
	var err error
	if leased {
		var resp *pb.TxnResponse
		_, resp, err = g.txnHomed(ctx, cmps, key, "v", 0, nil)
		ok = err == nil && resp.Succeeded
	} else {
		_, ok, err = g.commit(ctx, cmps, []clientv3.Op{clientv3.OpPut(key, "v")}, false)
	}
	if err == nil && !ok {
		err = fmt.Errorf("%s: a guard failed", key)
	}
	return err
}

func leasedFlying(g *grouper) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.leasedFlying
}

// TestAttackLeasedHungHoldsOthersOneStall: a leased request etcd does not
// answer holds the next leased transaction back for its stall at most,
// without and with the keepalives' lag (only runner 0 sends), and never
// holds back a transaction that is not leased.
func TestAttackLeasedHungHoldsOthersOneStall(t *testing.T) {
	h := &holdEtcd{marker: "/stuck-", release: make(chan struct{})}
	b := newHeldBackend(t, h)
	f := newFakeLag(b)
	ctx := context.Background()
	stuck := make(chan error, 4)
	for i, lag := range []time.Duration{0, fakeEvery / 4, fakeEvery} {
		f.set(lag)
		held := h.held.Load()
		go func() { stuck <- leasedPut(ctx, b.g, fmt.Sprintf("%s/stuck-%d", b.n.p, i), true) }()
		kit.WaitFor(t, "a leased request etcd does not answer", func() bool { return h.held.Load() == held+1 })
		start := time.Now()
		cctx, cancel := context.WithTimeout(ctx, kit.Patience)
		err := leasedPut(cctx, b.g, fmt.Sprintf("%s/free-%d", b.n.p, i), true)
		cancel()
		if err != nil {
			t.Errorf("lag %v: a leased transaction behind a hung leased request: %v after %v, want done after a stall", lag, err, time.Since(start))
		}
		if lag < fakeEvery/2 {
			start = time.Now()
			cctx, cancel := context.WithTimeout(ctx, kit.Patience)
			err := leasedPut(cctx, b.g, fmt.Sprintf("%s/plain-%d", b.n.p, i), false)
			cancel()
			if err != nil {
				t.Errorf("lag %v: a plain transaction: %v after %v", lag, err, time.Since(start))
			}
		}
	}
	f.set(0)
	close(h.release)
	for range 3 {
		if err := <-stuck; err != nil {
			t.Errorf("a leased transaction etcd answered late: %v", err)
		}
	}
	kit.WaitFor(t, "no leased request in flight", func() bool { return leasedFlying(b.g) == 0 })
}

// TestAttackLeasedQueuedCallEnds: a leased transaction that waits for the
// leased request in flight ends with its caller's context, and is never
// written; a plain transaction that arrives meanwhile does not wait behind
// it.
func TestAttackLeasedQueuedCallEnds(t *testing.T) {
	h := &holdEtcd{marker: "/stuck-", release: make(chan struct{})}
	b := newHeldBackend(t, h)
	ctx := context.Background()
	stuck := make(chan error, 1)
	go func() { stuck <- leasedPut(ctx, b.g, b.n.p+"/stuck-0", true) }()
	kit.WaitFor(t, "a leased request etcd does not answer", func() bool { return h.held.Load() == 1 })
	gone := make(chan error, 1)
	go func() {
		cctx, cancel := context.WithTimeout(ctx, groupStall/2)
		defer cancel()
		gone <- leasedPut(cctx, b.g, b.n.p+"/gone", true)
	}()
	kit.WaitFor(t, "the leased transaction to queue", b.g.queued)
	if err := leasedPut(ctx, b.g, b.n.p+"/plain", false); err != nil {
		t.Fatal(err)
	}
	if b.g.stalled.Load() == 0 && len(gone) == 0 && !b.g.queued() {
		t.Error("the leased transaction left while the leased request before it was in flight, within its stall")
	}
	err := <-gone
	if !errors.Is(err, context.DeadlineExceeded) {
		// It may have gone in a request after all, if the machine was
		// slow: the request before it stalled.
		t.Logf("the queued leased transaction: %v (stalled %d)", err, b.g.stalled.Load())
	}
	close(h.release)
	if err := <-stuck; err != nil {
		t.Fatal(err)
	}
	if errors.Is(err, context.DeadlineExceeded) {
		// Close waits for every request the grouper made: were the
		// transaction in one, it would have been written by then.
		b.Close()
		resp, gerr := b.cli.Get(ctx, b.n.p+"/gone")
		if gerr != nil {
			t.Fatal(gerr)
		}
		if len(resp.Kvs) != 0 {
			t.Fatal("a leased transaction whose caller's context ended while queued was written")
		}
	}
	kit.WaitFor(t, "an empty queue and no leased request in flight", func() bool {
		b.g.mu.Lock()
		defer b.g.mu.Unlock()
		return len(b.g.q) == 0 && b.g.leasedFlying == 0 && b.g.nLeased == 0 && b.g.nUrgent == 0
	})
}

// TestAttackLeasedCloseWhileQueued: Close with a leased request in flight
// that etcd does not answer and leased transactions queued behind it ends
// them all with ErrClosed, promptly (and leaves no goroutine: goleak).
func TestAttackLeasedCloseWhileQueued(t *testing.T) {
	h := &holdEtcd{marker: "/stuck-", release: make(chan struct{})}
	defer close(h.release)
	b := newHeldBackend(t, h)
	ctx := context.Background()
	const n = 6
	errs := make(chan error, n)
	go func() { errs <- leasedPut(ctx, b.g, b.n.p+"/stuck-0", true) }()
	kit.WaitFor(t, "a leased request etcd does not answer", func() bool { return h.held.Load() == 1 })
	for i := 1; i < n; i++ {
		go func() { errs <- leasedPut(ctx, b.g, fmt.Sprintf("%s/stuck-%d", b.n.p, i), true) }()
	}
	kit.WaitFor(t, "leased transactions to queue", b.g.queued)
	start := time.Now()
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	for range n {
		select {
		case err := <-errs:
			if !errors.Is(err, lock.ErrClosed) {
				t.Errorf("a leased transaction at Close: %v, want %v", err, lock.ErrClosed)
			}
		case <-time.After(kit.Patience):
			t.Fatalf("a leased transaction still waits %v after Close", kit.Patience)
		}
	}
	t.Logf("Close and its calls took %v", time.Since(start))
}

// TestAttackGroupQueuedAfterClose: a transaction that reaches the grouper
// after Close (its call began before) ends with ErrClosed, though its
// caller's context never ends: the runners that end the queue's
// transactions at Close have left. TestAttackLeasedCloseWhileQueued lost
// this race in CI, when a goroutine of its own queued after Close.
func TestAttackGroupQueuedAfterClose(t *testing.T) {
	b := newHeldBackend(t, &holdEtcd{marker: "/never-", release: make(chan struct{})})
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	for _, leased := range []bool{true, false} {
		errc := make(chan error, 1)
		go func() { errc <- leasedPut(context.Background(), b.g, b.n.p+"/late", leased) }()
		select {
		case err := <-errc:
			if !errors.Is(err, lock.ErrClosed) {
				t.Errorf("leased %v, queued after Close: %v, want %v", leased, err, lock.ErrClosed)
			}
		case <-time.After(kit.Patience):
			t.Fatalf("leased %v, queued after Close: still waits %v later", leased, kit.Patience)
		}
	}
	if b.g.queued() {
		t.Error("a transaction queued after Close stays in the queue")
	}
}

// TestAttackLeasedStress: leased and plain transactions, some with short
// contexts, while the keepalives' lag moves between none, slow and held
// and some requests are held before they are sent: every call returns
// (its outcome or its context's error), the leased ones never much later
// than the lag allows, and leasedFlying is back to 0 with an empty queue.
func TestAttackLeasedStress(t *testing.T) {
	// etcd answers some transactions late, some after their stall.
	slow := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if _, ok := req.(*pb.TxnRequest); ok && rand.IntN(8) == 0 {
			select {
			case <-time.After(rand.N(3 * groupStall)):
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	cfg := DefaultConfig()
	cfg.Prefix = etcdtest.Prefix(t)
	b, err := New(context.Background(), etcdtest.Shared(t).Client(t, grpc.WithChainUnaryInterceptor(slow)), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	f := newFakeLag(b)
	hold := func() {
		if rand.IntN(4) == 0 {
			time.Sleep(rand.N(3 * time.Millisecond))
		}
	}
	b.g.hold.Store(&hold)
	defer b.g.hold.Store(nil)
	stop := make(chan struct{})
	var lagger sync.WaitGroup
	lagger.Add(1)
	go func() {
		defer lagger.Done()
		lags := []time.Duration{0, 0, fakeEvery / 4, fakeEvery}
		for {
			select {
			case <-stop:
				f.set(0)
				return
			case <-time.After(rand.N(40 * time.Millisecond)):
				f.set(lags[rand.IntN(len(lags))])
			}
		}
	}()
	const workers, each = 16, 25
	var worst atomic.Int64 // the longest wait of a leased transaction
	var wg sync.WaitGroup
	var failed atomic.Int32
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				time.Sleep(rand.N(20 * time.Millisecond))
				leased := rand.IntN(2) == 0
				d := 5 * time.Second
				if rand.IntN(5) == 0 {
					d = rand.N(30 * time.Millisecond)
				}
				ctx, cancel := context.WithTimeout(context.Background(), d)
				start := time.Now()
				err := leasedPut(ctx, b.g, fmt.Sprintf("%s/s-%d-%d", b.n.p, w, i), leased)
				took := time.Since(start)
				cancel()
				if err != nil && !errors.Is(err, context.DeadlineExceeded) {
					failed.Add(1)
					t.Errorf("worker %d, %d (leased %v): %v after %v", w, i, leased, err, took)
				}
				if err != nil && took > d+kit.Patience {
					t.Errorf("worker %d, %d: returned %v after its deadline of %v", w, i, took-d, d)
				}
				if leased && err == nil {
					for {
						old := worst.Load()
						if int64(took) <= old || worst.CompareAndSwap(old, int64(took)) {
							break
						}
					}
				}
			}
		}()
	}
	wg.Wait()
	close(stop)
	lagger.Wait()
	t.Logf("worst leased wait %v; requests %d, txns %d, stalled %d", time.Duration(worst.Load()), b.g.requests.Load(), b.g.txns.Load(), b.g.stalled.Load())
	if time.Duration(worst.Load()) > kit.Patience {
		t.Errorf("a leased transaction waited %v", time.Duration(worst.Load()))
	}
	kit.WaitFor(t, "an empty queue and no leased request in flight", func() bool {
		b.g.mu.Lock()
		defer b.g.mu.Unlock()
		return len(b.g.q) == 0 && b.g.leasedFlying == 0 && b.g.nLeased == 0 && b.g.nUrgent == 0
	})
}
