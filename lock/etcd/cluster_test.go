package etcd_test

import (
	"fmt"
	"sync"
	"testing"

	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/etcd"
)

// TestWaiterAsksWhileHandedOnElsewhere: a waiter asks again on one server
// (a repeat /lock, which reads its queue place) while another server ends
// the hold and takes the waiter out of the queue, by a hand-off or by a
// success. The repeat must see either the place or the grant, never an
// error: a transaction's reads are of one revision (tx.go).
func TestWaiterAsksWhileHandedOnElsewhere(t *testing.T) {
	srv := etcdtest.Shared(t)
	p := etcdtest.Prefix(t)
	open := func() *etcd.Backend {
		b, err := etcd.New(t.Context(), srv.Client(t), withPrefix(etcd.DefaultConfig(), p))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { b.Close() })
		return b
	}
	b1, b2 := open(), open()
	ctx := t.Context()
	for i := range 40 {
		res := fmt.Sprint("r", i)
		if r, err := b1.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: res, Node: "h", Lease: lock.LeaseTTL}); err != nil || !r.Acquired {
			t.Fatalf("h: %+v %v", r, err)
		}
		for _, n := range []string{"w", "v"} {
			if r, err := b2.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: res, Node: n, Lease: lock.LeaseTTL}); err != nil || !r.Queued {
				t.Fatalf("%s: %+v %v", n, r, err)
			}
		}
		var wg sync.WaitGroup
		wg.Go(func() {
			if _, err := b1.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: res, Node: "h", Success: i%2 == 0}); err != nil {
				t.Errorf("unlock: %v", err)
			}
		})
		for _, n := range []string{"w", "v"} {
			wg.Go(func() {
				for range 3 {
					if _, err := b2.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: res, Node: n}); err != nil {
						t.Errorf("%s asks again: %v", n, err)
						return
					}
					st, err := b2.Status(ctx, lock.Pull, res, n)
					if err != nil {
						t.Errorf("%s's status: %v", n, err)
						return
					}
					if st.Position > st.QueueLength || (st.Position > 0 && st.Holder == n) {
						t.Errorf("%s's status %+v: a position not in the queue", n, st)
						return
					}
				}
			})
		}
		wg.Wait()
		if t.Failed() {
			return
		}
	}
}
