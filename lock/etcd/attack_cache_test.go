package etcd

import (
	"context"
	"errors"
	"sync"
	"testing"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/server/v3/etcdserver/txn"
	"google.golang.org/grpc"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
)

// txnLog records every transaction a client sends, as etcd receives it.
type txnLog struct {
	mu   sync.Mutex
	txns []*pb.TxnRequest
}

func (l *txnLog) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if r, ok := req.(*pb.TxnRequest); ok {
		l.mu.Lock()
		l.txns = append(l.txns, r)
		l.mu.Unlock()
	}
	return invoker(ctx, method, req, reply, cc, opts...)
}

// serializable returns the transactions etcd serves from the member's
// own state, without agreeing with a quorum first: read-only ones whose
// reads (none at all counts) are all serializable (etcdserver's Txn).
func (l *txnLog) serializable() []*pb.TxnRequest {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []*pb.TxnRequest
	for _, r := range l.txns {
		if txn.IsTxnReadonly(r) && txn.IsTxnSerializable(r) {
			out = append(out, r)
		}
	}
	return out
}

// TestAttackConfirmIsLinearizable: an answer that writes nothing, read
// from the cache, is given only after tx.confirm's transaction of the
// guards, which docs/DESIGN.md ("One round trip for a warm call") says
// etcd serves with a quorum read. etcd serves a read-only transaction
// whose reads are all serializable from the member it reaches, with no
// quorum read, and a transaction of comparisons alone has no read: it
// counts as serializable. A member behind its leader (partitioned away,
// or slow to apply) then confirms a record that was already changed, and
// the answer (in_use, not_holder, a status) was never true while the call
// ran. The test checks every transaction the backend sends as etcd's own
// server classifies it.
func TestAttackConfirmIsLinearizable(t *testing.T) {
	srv := etcdtest.Shared(t)
	log := &txnLog{}
	cli := srv.Client(t, grpc.WithChainUnaryInterceptor(log.intercept))
	cfg := DefaultConfig()
	cfg.Prefix = etcdtest.Prefix(t)
	ctx := context.Background()
	b, err := New(ctx, cli, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	k := lock.Key{Type: lock.Pull, Resource: "sha256:confirm"}
	got, err := b.TryLock(ctx, lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: "holder", Lease: lock.LeaseTTL})
	if err != nil || !got.Acquired {
		t.Fatalf("holder: %+v %v", got, err)
	}
	kit.WaitFor(t, "the cache to hold the record", func() bool {
		_, ok := b.rc.get(b.n.key(k))
		return ok
	})
	hits, _ := b.rc.stats()
	// Answers that write nothing, each from the cache: a refusal, a
	// status, a holder's repeat that changes nothing, a no-op cancel.
	if _, err := b.TryLock(ctx, lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: "other", Lease: lock.LeaseTTL}); err != nil {
		var he *lock.HeldError
		if !errors.As(err, &he) {
			t.Fatalf("other: %v", err)
		}
	}
	if _, err := b.Unlock(ctx, lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: "nobody", Success: true}); !errors.Is(err, lock.ErrNotHolder) {
		t.Fatalf("nobody's unlock: %v", err)
	}
	if st, err := b.Status(ctx, k.Type, k.Resource, ""); err != nil || st.Holder != "holder" {
		t.Fatalf("status: %+v %v", st, err)
	}
	if _, err := b.Cancel(ctx, k.Type, k.Resource, "nobody"); err != nil {
		t.Fatalf("cancel: %v", err)
	}
	if h, _ := b.rc.stats(); h == hits {
		t.Fatal("no call was served by the cache: the test tests nothing")
	}
	if s := log.serializable(); len(s) > 0 {
		t.Fatalf("%d transactions etcd serves without a quorum read, the first: %v", len(s), s[0])
	}
}

// TestAttackCacheReadsOnce: one transaction that reads a record twice from
// the cache must decide on what it guards. The cache can go back in time:
// a relist after a compacted watch (watch.go list → recCache.reset) puts
// back the state of its list's revision, and a commit this server made
// after that revision and wrote through before the reset is forgotten
// until the watch brings it again. A transaction that read the record
// before the reset guards the newer version; one that reads it again after
// it, through the cache, decides on the older one and still commits. Here
// a delete's promotion reads the references once per waiter it considers
// (tx.promote → tx.refConflict): the first read says the resource is
// referenced, the second, after the reset, says it is not, and the
// transaction would grant the delete of a referenced resource under guards
// that hold.
func TestAttackCacheReadsOnce(t *testing.T) {
	srv := etcdtest.Shared(t)
	cfg := DefaultConfig()
	cfg.Prefix = etcdtest.Prefix(t)
	cfg.RefCounting = true
	ctx := context.Background()
	b, err := New(ctx, srv.Client(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	const res = "sha256:reads-once"
	// The list a relist would read: the state before the reference.
	kit.WaitFor(t, "the cache to be live", func() bool { return b.rc.begin().ok })
	b.rc.mu.Lock()
	listRev, listed := b.rc.rev, make(map[string]cEntry, len(b.rc.m))
	for key, e := range b.rc.m {
		listed[key] = e
	}
	b.rc.mu.Unlock()
	if _, err := b.RefAdd(ctx, res, "user"); err != nil {
		t.Fatal(err)
	}
	ref := b.n.ref(res)
	if _, ok := b.rc.get(ref); !ok {
		t.Fatal("the reference was not written through")
	}

	k := lock.Key{Type: lock.Delete, Resource: res}
	tr := &tx{b: b, ctx: ctx, k: k, guarded: map[string]bool{}, recOp: -1}
	if !tr.loadCached() {
		t.Fatal("the cache did not serve the transaction")
	}
	if err := tr.refConflict(); !errors.Is(err, lock.ErrInUse) {
		t.Fatalf("a delete of a referenced resource: %v, want in_use", err)
	}
	// The relist's reset lands between the two reads.
	b.rc.reset(listRev, listed, nil)
	err = tr.refConflict()
	if !errors.Is(err, lock.ErrInUse) {
		resp, cerr := b.cli.Txn(ctx).If(tr.cmps...).Commit()
		t.Fatalf("read again in the same transaction: %v, want in_use as read first; its guards hold in etcd: %v %v",
			err, cerr == nil && resp.Succeeded, cerr)
	}
}
