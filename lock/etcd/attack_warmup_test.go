package etcd

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
)

// heldWatch holds a client's first watch stream back until released, and
// says when it is asked for: a starting backend asks for it right after its
// list (watch.go start).
type heldWatch struct {
	once    sync.Once
	asked   chan struct{}
	release chan struct{}
}

func (h *heldWatch) intercept(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	if strings.HasSuffix(method, "/Watch") {
		first := false
		h.once.Do(func() { first = true })
		if first {
			close(h.asked)
			select {
			case <-h.release:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
	}
	return streamer(ctx, desc, cc, method, opts...)
}

// TestAttackWarmupCompactedPastList: a server starts (lists the state at
// L, then watches from before L to warm its replay logs), and before its
// watch opens, etcd is compacted past changes made after L. Those changes
// are not history: the server must list the state again, as when any other
// watch is compacted past (docs/DESIGN.md, "An etcd backend"), not go on
// from the compaction as if it had applied them. Here they cancel a
// waiter and queue another, and a later write changes the key's record
// without its queue: a server that went on would keep the cancelled
// waiter as the queue of that record, and a hand-off through it would
// pass its guard and give the key to the node that left, losing the one
// that waits.
func TestAttackWarmupCompactedPastList(t *testing.T) {
	srv := etcdtest.StartEmbedded(t)
	p := etcdtest.Prefix(t)
	cfg := DefaultConfig()
	cfg.Prefix = p
	cfg.LockTTL = time.Minute
	ctx := t.Context()
	a, err := New(ctx, srv.Client(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	k := lock.Key{Type: lock.Pull, Resource: "sha256:warm"}
	lockAs(t, a, k, "h", "acquired")
	lockAs(t, a, k, "w1", "queued")

	h := &heldWatch{asked: make(chan struct{}), release: make(chan struct{})}
	cli := srv.Client(t, grpc.WithChainStreamInterceptor(h.intercept))
	type opened struct {
		b   *Backend
		err error
	}
	done := make(chan opened, 1)
	go func() {
		b, err := New(ctx, cli, cfg)
		done <- opened{b, err}
	}()
	select {
	case <-h.asked: // b has listed: h holding, w1 waiting
	case o := <-done:
		t.Fatalf("New returned before its watch opened: %v", o.err)
	}
	// After the list: w1 leaves, w2 queues, then h renews its hold (the
	// record changes, its queue does not); etcd is compacted up to that
	// renewal, so the watch begins there.
	if _, err := a.Cancel(ctx, k.Type, k.Resource, "w1"); err != nil {
		t.Fatal(err)
	}
	lockAs(t, a, k, "w2", "queued")
	lockAs(t, a, k, "h", "acquired")
	renewed := a.lastCommit.Load()
	if _, err := srv.Client(t).Compact(ctx, renewed); err != nil {
		t.Fatal(err)
	}
	close(h.release)
	o := <-done
	if o.err != nil {
		t.Fatal(o.err)
	}
	b := o.b
	t.Cleanup(func() { b.Close() })
	if !b.w.caughtUp(renewed, 10*time.Second) {
		t.Fatalf("b's watch did not reach revision %d", renewed)
	}

	res, err := b.Unlock(ctx, lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: "h", Error: "failed"})
	if err != nil || res.NextHolder != "w2" {
		t.Fatalf("the hand-off through the new server: %+v %v, want w2 next (w1 cancelled)", res, err)
	}
	st, err := a.Status(ctx, k.Type, k.Resource, "")
	if err != nil || st.Holder != "w2" || st.QueueLength != 0 {
		t.Fatalf("after the hand-off: %+v %v, want w2 holding and nobody waiting", st, err)
	}
}
