package etcd

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"

	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
)

// queueReads counts the reads of a data set's queues (P/q/) that a client
// sends to etcd, alone or inside a transaction.
type queueReads struct {
	prefix string
	mu     sync.Mutex
	n      int
}

func (q *queueReads) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	var ranges []*pb.RangeRequest
	switch r := req.(type) {
	case *pb.RangeRequest:
		ranges = append(ranges, r)
	case *pb.TxnRequest:
		var walk func(ops []*pb.RequestOp)
		walk = func(ops []*pb.RequestOp) {
			for _, op := range ops {
				if rr := op.GetRequestRange(); rr != nil {
					ranges = append(ranges, rr)
				}
				if t := op.GetRequestTxn(); t != nil {
					walk(t.Success)
					walk(t.Failure)
				}
			}
		}
		walk(r.Success)
		walk(r.Failure)
	}
	for _, rr := range ranges {
		if strings.HasPrefix(string(rr.Key), q.prefix) {
			q.mu.Lock()
			q.n++
			q.mu.Unlock()
		}
	}
	return invoker(ctx, method, req, reply, cc, opts...)
}

func (q *queueReads) count() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.n
}

// countingBackend opens a backend on prefix p whose client counts its
// reads of the queues.
func countingBackend(t *testing.T, p string, cfg Config) (*Backend, *queueReads) {
	t.Helper()
	reads := &queueReads{prefix: p + "q/"}
	cli := etcdtest.Shared(t).Client(t, grpc.WithChainUnaryInterceptor(reads.intercept))
	cfg.Prefix = p
	b, err := New(t.Context(), cli, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b, reads
}

// caughtUp waits until b's watch has applied every commit of bs.
func caughtUp(t *testing.T, b *Backend, bs ...*Backend) {
	t.Helper()
	for _, o := range append(bs, b) {
		if !b.w.caughtUp(o.lastCommit.Load(), 10*time.Second) {
			t.Fatalf("the watch did not apply revision %d within 10 s", o.lastCommit.Load())
		}
	}
}

func lockAs(t *testing.T, b *Backend, k lock.Key, node string, want string) {
	t.Helper()
	r, err := b.TryLock(t.Context(), lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: node, Lease: lock.LeaseTTL})
	if err != nil || (want == "acquired") != r.Acquired || (want == "queued") != r.Queued {
		t.Fatalf("%s's lock: %+v %v, want %s", node, r, err, want)
	}
}

// TestHandoffReadsNoQueue: a call reads the key's queue kept by the watch,
// not etcd's (docs/DESIGN.md, "One round trip for a warm call"), whether
// the watch has applied the record the call reads or this server's own
// commit wrote the record and the queue through before the watch brought
// them: a hand-off, a waiter's repeated /lock and its /status (its place),
// and a pull's success that adds every waiter it skips to the references
// (the whole queue) send etcd no read of the queue, and answer what etcd
// has.
func TestHandoffReadsNoQueue(t *testing.T) {
	for _, wait := range []bool{true, false} {
		t.Run(fmt.Sprintf("watchCaughtUp=%v", wait), func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.RefCounting = true
			b, reads := countingBackend(t, etcdtest.Prefix(t), cfg)
			ctx := t.Context()
			k := lock.Key{Type: lock.Pull, Resource: "sha256:handoff"}
			// Between the calls: the watch applies this server's commits,
			// or not yet (then the calls find their queue written through).
			between := func() {
				if wait {
					caughtUp(t, b)
				}
			}
			lockAs(t, b, k, "h", "acquired")
			for _, n := range []string{"w1", "w2", "w3"} {
				lockAs(t, b, k, n, "queued")
			}
			between()
			before := reads.count()
			fromWatch, fromEtcd := b.qs.stats()

			res, err := b.Unlock(ctx, lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: "h", Error: "failed"})
			if err != nil || res.NextHolder != "w1" {
				t.Fatalf("the hand-off: %+v %v, want w1 next", res, err)
			}
			between()
			r, err := b.TryLock(ctx, lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: "w3", Lease: lock.LeaseTTL})
			if err != nil || !r.Queued || r.Position != 2 || r.Holder != "w1" {
				t.Fatalf("w3 again: %+v %v, want queued second behind w1", r, err)
			}
			between()
			st, err := b.Status(ctx, k.Type, k.Resource, "w2")
			if err != nil || st.Position != 1 || st.QueueLength != 2 {
				t.Fatalf("w2's status: %+v %v, want first of 2", st, err)
			}
			between()
			if _, err := b.Unlock(ctx, lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: "w1", Success: true}); err != nil {
				t.Fatalf("w1's success: %v", err)
			}
			refs, err := b.RefCount(ctx, k.Resource)
			if err != nil || !slices.Equal(refs.Nodes, []string{"w1", "w2", "w3"}) {
				t.Fatalf("the references after the success: %+v %v, want the holder and both waiters it skipped", refs, err)
			}

			if n := reads.count() - before; n != 0 {
				t.Errorf("%d reads of the queue sent to etcd, want none", n)
			}
			w, e := b.qs.stats()
			// The promotion, w3's place and entry, w2's place and entry,
			// the success's whole queue.
			if w-fromWatch != 6 || e != fromEtcd {
				t.Errorf("queue reads: %d from the watch, %d from etcd; want 6 and 0", w-fromWatch, e-fromEtcd)
			}
			caughtUp(t, b)
			b.qs.mu.RLock()
			kept := len(b.qs.m)
			b.qs.mu.RUnlock()
			if kept != 0 {
				t.Errorf("%d queues kept after the success emptied the only one", kept)
			}
		})
	}
}

// TestHandoffStaleQueue: the queue the watch keeps is behind etcd's,
// because another server changed it (a waiter cancelled there), as a watch
// that lags leaves it. A hand-off through the lagging server must promote
// the waiter etcd has first, having read the queue from etcd: at once when
// the record it read is newer than the queue kept, after one failed
// commit when the record it read is as old as the queue (its guard fails).
func TestHandoffStaleQueue(t *testing.T) {
	for _, recordToo := range []bool{false, true} {
		t.Run(fmt.Sprintf("recordBehind=%v", recordToo), func(t *testing.T) {
			p := etcdtest.Prefix(t)
			b1, reads := countingBackend(t, p, DefaultConfig())
			b2, _ := countingBackend(t, p, DefaultConfig())
			ctx := t.Context()
			k := lock.Key{Type: lock.Pull, Resource: "sha256:stale"}
			lockAs(t, b1, k, "h", "acquired")
			lockAs(t, b1, k, "w1", "queued")
			lockAs(t, b1, k, "w2", "queued")
			caughtUp(t, b1)
			id, kk := b1.qs.recID(b1.n.key(k)), b1.n.key(k)
			oldQueue, oldRec := keptCopy(b1, id), cachedCopy(b1, kk)
			if oldQueue == nil || len(oldQueue.ws) != 2 || oldQueue.rev != oldRec.mod() {
				t.Fatalf("the kept queue %+v, the record at %d: want w1 and w2 at the record's revision", oldQueue, oldRec.mod())
			}

			if _, err := b2.Cancel(ctx, k.Type, k.Resource, "w1"); err != nil {
				t.Fatalf("w1's cancel on the other server: %v", err)
			}
			caughtUp(t, b1, b2)
			// What a watch that had not yet applied the cancel kept.
			b1.qs.mu.Lock()
			b1.qs.m[id] = oldQueue
			b1.qs.mu.Unlock()
			if recordToo {
				b1.rc.mu.Lock()
				b1.rc.m[kk] = oldRec
				b1.rc.mu.Unlock()
			}
			before, stale := reads.count(), b1.cacheStale.Load()
			_, fromEtcd := b1.qs.stats()

			res, err := b1.Unlock(ctx, lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: "h", Error: "failed"})
			if err != nil || res.NextHolder != "w2" {
				t.Fatalf("the hand-off: %+v %v, want w2 next (w1 cancelled)", res, err)
			}
			st, err := b2.Status(ctx, k.Type, k.Resource, "")
			if err != nil || st.Holder != "w2" || st.QueueLength != 0 {
				t.Fatalf("the status after: %+v %v, want w2 holding, nobody waiting", st, err)
			}
			if reads.count() == before {
				t.Error("the hand-off read no queue from etcd: it decided on the stale queue")
			}
			if _, e := b1.qs.stats(); e == fromEtcd {
				t.Error("no queue read counted as etcd's")
			}
			if got := b1.cacheStale.Load() - stale; recordToo != (got > 0) {
				t.Errorf("%d first attempts misled by the cache; want some exactly when the record was behind too", got)
			}
		})
	}
}

// keptCopy is a copy of b's kept queue id.
func keptCopy(b *Backend, id string) *keptQueue {
	b.qs.mu.RLock()
	defer b.qs.mu.RUnlock()
	e := b.qs.m[id]
	if e == nil {
		return nil
	}
	return &keptQueue{rev: e.rev, at: e.at, ws: slices.Clone(e.ws)}
}

// cachedCopy is b's cache entry of key.
func cachedCopy(b *Backend, key string) cEntry {
	b.rc.mu.RLock()
	defer b.rc.mu.RUnlock()
	return b.rc.m[key]
}

// revision is the watch's events of one revision, for queues.apply.
type revision struct {
	n       names
	evs     []*clientv3.Event
	keys    []string
	changes []change
}

func (r *revision) waiter(k lock.Key, seq uint64, node string, del bool) {
	key := r.n.wait(k, seq, node)
	ev := &clientv3.Event{Type: mvccpb.PUT, Kv: &mvccpb.KeyValue{Key: []byte(key), Value: []byte(encode(waitRec{Node: node, Lease: uint8(lock.LeaseTTL), TTL: 1}))}}
	if del {
		ev = &clientv3.Event{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: []byte(key)}}
	}
	r.evs = append(r.evs, ev)
	r.keys = append(r.keys, key)
}

func (r *revision) record(k lock.Key, queue int) {
	key := r.n.key(k)
	r.evs = append(r.evs, &clientv3.Event{Type: mvccpb.PUT, Kv: &mvccpb.KeyValue{Key: []byte(key)}})
	r.keys = append(r.keys, key)
	r.changes = append(r.changes, change{k: k, key: key, rec: keyRec{Queue: queue}})
}

// TestQueuesApply: the kept queue of a key follows its changes a revision
// at a time, is dropped when its record counts no waiter (a success's
// 10,000 deletes then find nothing to do), and is never offered as the
// queue of a revision it did not follow: a queue changed without its
// record, or counting other than the record, is left to etcd.
func TestQueuesApply(t *testing.T) {
	n := names{p: "/p/"}
	k := lock.Key{Type: lock.Pull, Resource: "sha256:q"}
	q := newQueues(n)
	id := q.recID(n.key(k))
	apply := func(rev int64, fill func(r *revision)) {
		r := &revision{n: n}
		fill(r)
		q.apply(r.evs, r.keys, r.changes, rev)
	}
	nodes := func(rev int64) []string {
		ws, ok := q.head(id, rev, 0, nil)
		if !ok {
			return nil
		}
		var out []string
		for _, w := range ws {
			out = append(out, w.Node)
		}
		return out
	}
	const many = 10000
	apply(10, func(r *revision) {
		for i := range uint64(many) {
			r.waiter(k, i, fmt.Sprint("n", i), false)
		}
		r.record(k, many)
	})
	if ws, ok := q.head(id, 10, 3, map[uint64]bool{0: true}); !ok || len(ws) != 3 || ws[0].Node != "n1" || ws[2].Node != "n3" {
		t.Fatalf("the head at 10 without seq 0: %+v %v", ws, ok)
	}
	if pos, ok := q.position(id, 10, 41); !ok || pos != 42 {
		t.Fatalf("the place of seq 41: %d %v", pos, ok)
	}
	if _, found, known := q.find(id, 10, 41, "someone else"); found || !known {
		t.Fatalf("the waiter at seq 41 as another node's: found %v, known %v", found, known)
	}
	if w, found, known := q.find(id, 10, 41, "n41"); !found || !known || w.Node != "n41" {
		t.Fatalf("the waiter at seq 41: %+v, found %v, known %v", w, found, known)
	}
	if _, found, known := q.find(id, 10, uint64(many), "n0"); found || !known {
		t.Fatalf("a seq past the queue: found %v, known %v", found, known)
	}
	if _, _, known := q.find(id, 9, 41, "n41"); known {
		t.Fatal("the queue at 10 answered for the record at 9")
	}
	if _, ok := q.head(id, 9, 1, nil); ok {
		t.Fatal("the queue at 10 served as the one of the record at 9")
	}
	// A hand-off: the first waiter out.
	apply(11, func(r *revision) { r.waiter(k, 0, "n0", true); r.record(k, many-1) })
	if got := nodes(11); len(got) != many-1 || got[0] != "n1" {
		t.Fatalf("after the hand-off: %d waiters, first %v", len(got), got[:1])
	}
	// A success: every waiter out, one revision.
	apply(12, func(r *revision) {
		r.record(k, 0)
		for i := range uint64(many) {
			if i > 0 {
				r.waiter(k, i, fmt.Sprint("n", i), true)
			}
		}
	})
	if len(q.m) != 0 {
		t.Fatalf("%d queues kept after the success", len(q.m))
	}
	// Queued again; then a queue changed without its record.
	apply(13, func(r *revision) { r.waiter(k, 0, "a", false); r.record(k, 1) })
	if got := nodes(13); !slices.Equal(got, []string{"a"}) {
		t.Fatalf("at 13: %v", got)
	}
	apply(14, func(r *revision) { r.waiter(k, 1, "b", false) })
	apply(15, func(r *revision) { r.record(k, 2) })
	if _, ok := q.head(id, 15, 0, nil); ok {
		t.Fatal("a queue that changed without its record served")
	}
	// A record that counts other than the waiters seen.
	apply(16, func(r *revision) { r.record(k, 0) })
	apply(17, func(r *revision) { r.waiter(k, 0, "a", false); r.record(k, 2) })
	if _, ok := q.head(id, 17, 0, nil); ok {
		t.Fatal("a queue of one served for a record counting two")
	}
	// Emptied, it is followed again from scratch.
	apply(18, func(r *revision) { r.waiter(k, 0, "a", true); r.record(k, 0) })
	apply(19, func(r *revision) { r.waiter(k, 5, "c", false); r.record(k, 1) })
	if got := nodes(19); !slices.Equal(got, []string{"c"}) {
		t.Fatalf("at 19: %v", got)
	}
}

// TestQueuesWriteThrough: this server's commits are written through to
// the kept queue only when the queue before the commit is the one kept (of
// the record the commit's guard checked, or none at all), and the watch
// then leaves the queue alone until it passes them: it never sets a queue
// back to an older revision, nor applies a revision twice.
func TestQueuesWriteThrough(t *testing.T) {
	n := names{p: "/p/"}
	k := lock.Key{Type: lock.Pull, Resource: "sha256:q"}
	b := &Backend{n: n, qs: newQueues(n)}
	q := b.qs
	id := q.recID(n.key(k))
	apply := func(rev int64, fill func(r *revision)) {
		r := &revision{n: n}
		fill(r)
		q.apply(r.evs, r.keys, r.changes, rev)
	}
	// commit writes through a transaction that read the record at recRev
	// counting read waiters and left it counting queue.
	commit := func(rev, recRev int64, read, queue int, ops ...clientv3.Op) {
		tx := &tx{b: b, k: k, recRev: recRev, readQueue: read, rec: keyRec{Queue: queue}, recOp: len(ops), ops: append(ops, clientv3.OpPut(n.key(k), "{}"))}
		q.writeThrough(tx, rev)
	}
	put := func(seq uint64, node string) clientv3.Op {
		return clientv3.OpPut(n.wait(k, seq, node), encode(waitRec{Node: node, Lease: uint8(lock.LeaseTTL), TTL: 1}))
	}
	del := func(seq uint64, node string) clientv3.Op { return clientv3.OpDelete(n.wait(k, seq, node)) }
	kept := func() (int64, []string) {
		q.mu.RLock()
		defer q.mu.RUnlock()
		e := q.m[id]
		if e == nil {
			return 0, nil
		}
		var out []string
		for _, w := range e.ws {
			out = append(out, w.Node)
		}
		return e.rev, out
	}
	want := func(what string, rev int64, nodes ...string) {
		t.Helper()
		if r, got := kept(); r != rev || !slices.Equal(got, nodes) {
			t.Fatalf("%s: the queue at %d is %v; want %v at %d", what, r, got, nodes, rev)
		}
	}

	apply(10, func(r *revision) { r.waiter(k, 0, "a", false); r.waiter(k, 1, "b", false); r.record(k, 2) })
	commit(12, 10, 2, 1, del(0, "a")) // a hand-off to a
	want("the hand-off written through", 12, "b")
	commit(13, 12, 1, 2, put(2, "c")) // c queues
	want("c's place written through", 13, "b", "c")
	apply(12, func(r *revision) { r.waiter(k, 0, "a", true); r.record(k, 1) })
	apply(13, func(r *revision) { r.waiter(k, 2, "c", false); r.record(k, 2) })
	want("the watch passing what was written through", 13, "b", "c")
	commit(14, 11, 2, 3, put(3, "d")) // a guard of a record the queue kept is not of
	want("a commit from a record not kept", 13, "b", "c")
	commit(13, 12, 1, 2, put(2, "c"))
	want("a commit the watch has passed", 13, "b", "c")
	commit(15, 13, 2, 0, clientv3.OpDelete(n.queue(k), clientv3.WithPrefix())) // a success
	want("an emptied queue, until the watch passes it", 15)
	if _, ok := q.head(id, 15, 0, nil); !ok {
		t.Fatal("the emptied queue not served")
	}
	apply(15, func(r *revision) { r.record(k, 0); r.waiter(k, 1, "b", true); r.waiter(k, 2, "c", true) })
	q.mu.RLock()
	left := len(q.m)
	q.mu.RUnlock()
	if left != 0 {
		t.Fatalf("%d queues kept once the watch passed the success", left)
	}
	commit(16, 15, 0, 0) // a holder's renewal: no queue, nothing kept
	want("a key without waiters", 0)
	commit(17, 16, 0, 1, put(4, "e")) // a queue from none: whatever is kept
	want("a queue begun by this server", 17, "e")
	apply(16, func(r *revision) { r.record(k, 0) })
	want("the watch behind a queue begun", 17, "e")
}

// BenchmarkQueuesSuccess is the watch's work for a success that removes
// 10,000 waiters in one revision (the revision that queued them is not
// timed): the queue is dropped once, each delete is a lookup.
func BenchmarkQueuesSuccess(b *testing.B) {
	n := names{p: "/p/"}
	k := lock.Key{Type: lock.Pull, Resource: "sha256:q"}
	fill, success := &revision{n: n}, &revision{n: n}
	const many = 10000
	for i := range uint64(many) {
		fill.waiter(k, i, fmt.Sprint("n", i), false)
		success.waiter(k, i, fmt.Sprint("n", i), true)
	}
	fill.record(k, many)
	success.record(k, 0)
	q := newQueues(n)
	for b.Loop() {
		b.StopTimer()
		q.apply(fill.evs, fill.keys, fill.changes, 10)
		b.StartTimer()
		q.apply(success.evs, success.keys, success.changes, 11)
	}
}

// BenchmarkQueuesMemory reports the live heap the kept queues take (the
// queues alone: docs/DESIGN.md, "What a server keeps"), for waiters of
// 64-hex-digit digests with 10-character node ids: a waiter of a long
// queue (100 keys of 100 waiters), and a key with one waiter (10,000 keys).
func BenchmarkQueuesMemory(b *testing.B) {
	n := names{p: "/dlock/"}
	measure := func(keys, each int) float64 {
		q := newQueues(n)
		runtime.GC()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		for i := range keys {
			k := lock.Key{Type: lock.Pull, Resource: fmt.Sprintf("sha256:%064x", i)}
			// One revision at a time, as the watch applies them: each
			// waiter's key and value are garbage after it.
			for j := range uint64(each) {
				r := &revision{n: n}
				r.waiter(k, j, fmt.Sprintf("node-%05d", (i*each+int(j))%100000), false)
				r.record(k, int(j)+1)
				q.apply(r.evs, r.keys, r.changes, int64(i*each)+int64(j)+1)
			}
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		runtime.KeepAlive(q)
		return float64(int64(after.HeapAlloc) - int64(before.HeapAlloc))
	}
	for b.Loop() {
		b.ReportMetric(measure(100, 100)/10000, "B/waiter")
		b.ReportMetric(measure(10000, 1)/10000, "B/key-with-1-waiter")
	}
}
