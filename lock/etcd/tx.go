package etcd

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"sort"
	"strconv"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/lock"
)

// tx is one attempt at one change of one resource's keys: linearizable
// reads, each of which adds a comparison, then one etcd transaction that
// applies the change only if nothing read has changed since
// (docs/DESIGN.md, "An etcd backend"). Every change of a key's queue writes
// the key's record too, so the record's mod revision guards the queue.
type tx struct {
	b   *Backend
	ctx context.Context
	k   lock.Key

	rec       keyRec
	recRev    int64 // mod revision of the record, 0 when absent
	readRev   int64 // the revision the record was read at
	readQueue int   // the waiters the record counted when read

	cmps    []clientv3.Cmp
	ops     []clientv3.Op
	guarded map[string]bool
	cache   map[string]*mvccpb.KeyValue // what load read besides the record; nil: absent
	recOp   int                         // the index in ops of the record's write, -1 before it
	recForm cVal                        // that write's record as the cache keeps it (cacherec.go)
	// cached: the reads were served by the watch's cache (recCache), so
	// an answer that writes nothing is confirmed by a transaction of the
	// reads' guards alone before it is given.
	cached bool
	// writeCmps guard a write but not an answer that writes nothing
	// (absent).
	writeCmps []clientv3.Cmp
	x         *trans          // the transition this transaction makes
	removed   map[uint64]bool // the waiters this transaction dequeues, by seq
	// leased: an operation attaches a key to a lease (leasedOp), so the
	// transaction is sent alone (group.go).
	leased bool
}

// errConflict is a read that cannot be made as of the transaction's first
// (etcd compacted it since): the transaction is tried again.
var errConflict = errors.New("etcd backend: conflict")

// run applies fn to k's state until its transaction commits without
// conflict. fn is called again on each attempt and must keep its results
// in variables it resets. Calls for one resource on one server wait for
// each other, so that only servers compete for a key, not requests.
func (b *Backend) run(ctx context.Context, k lock.Key, fn func(t *tx) error, also ...string) (int64, error) {
	// The wait for the stripe ends with the caller's context, at Close,
	// or after stripeTimeout: calls queued behind ones that wait for an
	// etcd out of reach answer, in bounded time, that it is.
	stripe := b.stripes[maphash.String(b.seed, k.Resource)%uint64(len(b.stripes))]
	timer := time.NewTimer(stripeTimeout)
	select {
	case stripe <- struct{}{}:
		timer.Stop()
	case <-ctx.Done():
		timer.Stop()
		return 0, ctx.Err()
	case <-b.ctx.Done():
		timer.Stop()
		return 0, lock.ErrClosed
	case <-timer.C:
		return 0, fmt.Errorf("%w: the calls before this one on its resource took %v", lock.ErrUnavailable, stripeTimeout)
	}
	defer func() { <-stripe }()
	// An etcd that does not answer (a partition drops packets) must not
	// hold a request, and the stripe, for as long as its client waits.
	bctx, cancel := b.bound(ctx)
	defer cancel()
	rev, err := b.attempt(bctx, k, fn, also)
	return rev, b.boundErr(ctx, bctx, err)
}

// stripeTimeout bounds one call's wait for the calls before it on its
// stripe: some callTimeouts of an etcd that does not answer, and far more
// than the longest queue of calls of one resource that etcd does answer.
const stripeTimeout = 2 * callTimeout

// bound returns ctx bounded by callTimeout and ended by Close, for a call's
// work in etcd: a client of an etcd out of reach waits for it as long as
// its context lets it, and a caller's context may never end.
func (b *Backend) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	stop := context.AfterFunc(b.ctx, cancel)
	return ctx, func() { stop(); cancel() }
}

// boundErr is err of a call made with bctx, bound(parent): lock.ErrClosed
// once the backend is closed, lock.ErrUnavailable when the bound ran out
// before parent ended.
func (b *Backend) boundErr(parent, bctx context.Context, err error) error {
	switch {
	case err == nil:
		return nil
	case b.closed.Load():
		return lock.ErrClosed
	case parent.Err() == nil && bctx.Err() != nil:
		return fmt.Errorf("%w: etcd did not answer within %v", lock.ErrUnavailable, callTimeout)
	}
	return err
}

// callTimeout bounds one call's work in etcd.
const callTimeout = 10 * time.Second

func (b *Backend) attempt(ctx context.Context, k lock.Key, fn func(t *tx) error, also []string) (int64, error) {
	for attempt := 0; ; attempt++ {
		if err := b.alive(); err != nil {
			return 0, err
		}
		if err := ctx.Err(); err != nil {
			return 0, err
		}
		t := &tx{b: b, ctx: ctx, k: k, guarded: map[string]bool{}, recOp: -1}
		if attempt > 0 || !t.loadCached(also...) {
			if err := t.load(also...); err != nil {
				return 0, err
			}
		}
		err := fn(t)
		if errors.Is(err, errConflict) {
			b.conflicts.Add(1)
			continue
		}
		if t.cached && (err != nil || len(t.ops) == 0) {
			// An answer of the cache alone stands only if what it read
			// is still so.
			rev, ok, cerr := t.confirm()
			if cerr != nil {
				return 0, cerr
			}
			if !ok {
				continue
			}
			if err != nil {
				return 0, err
			}
			return rev, nil
		}
		if err != nil {
			return 0, err
		}
		if len(t.ops) == 0 {
			return t.readRev, nil
		}
		rev, ok, err := b.g.commit(ctx, t.commitCmps(), t.ops, t.leased)
		if err != nil {
			return 0, err
		}
		if ok {
			b.committed(rev)
			b.rc.writeThrough(t.ops, rev, t.recOp, t.recForm)
			b.qs.writeThrough(t, rev)
			return rev, nil
		}
		b.conflicts.Add(1)
		if t.cached {
			b.cacheStale.Add(1)
		}
	}
}

// confirm checks, in one transaction of the guards, that every record t
// read from the cache is still as it read it, and returns the revision it
// checked at: an answer that writes nothing is then as linearizable as one
// read from etcd (docs/DESIGN.md, "One round trip for a warm call").
// ok false: something changed, read again.
//
// It may share its request with other transactions (group.go), and then
// checks the state before the request's writes: still after the call began.
//
// The transaction reads the key's record too, counting it only: etcd
// serves a read-only transaction from the member the client reaches, with
// no quorum read, unless one of its reads asks for one, and a transaction
// of comparisons alone has no read (etcdserver's IsTxnSerializable). A
// member behind its leader would then confirm a record changed since, and
// give a refusal or a status that was no longer true when the call began
// (TestAttackConfirmIsLinearizable).
func (t *tx) confirm() (int64, bool, error) {
	rev, ok, err := t.b.g.commit(t.ctx, t.cmps, []clientv3.Op{clientv3.OpGet(t.b.n.key(t.k), clientv3.WithCountOnly())}, false)
	if err != nil {
		return 0, false, err
	}
	if !ok {
		t.b.conflicts.Add(1)
		t.b.cacheStale.Add(1)
		return 0, false, nil
	}
	return rev, true, nil
}

// loadCached reads what load would from the watch's cache, if every key of
// also is of a kind it keeps. A record it has absent is guarded as load
// guards one etcd has absent, P/dropped included: whatever the cache missed,
// a record of the key that existed at the commit fails the first guard, one
// dropped after the read revision the second, and one dropped before it had
// a token below it (docs/DESIGN.md, "An etcd backend", "Tokens").
func (t *tx) loadCached(also ...string) bool {
	c := t.b.rc
	for _, k := range also {
		if !c.holds(k) {
			c.count(false)
			return false
		}
	}
	kk := t.b.n.key(t.k)
	v, e, ok, kvs := c.first(kk, also)
	if !v.ok {
		return false
	}
	var rec keyRec
	if ok {
		var err error
		if rec, err = e.val.record(); err != nil {
			c.count(false)
			return false
		}
	}
	c.count(true)
	t.cached = true
	t.guarded[kk] = true
	if ok {
		t.rec, t.recRev, t.readQueue = rec, e.mod(), rec.Queue
		// The queue is read at this revision (atRead): the record, hence
		// its queue, is unchanged from its mod revision up to it if the
		// record is still so at the commit, which the guard checks.
		t.readRev = max(v.rev, e.mod())
		t.cmps = append(t.cmps, clientv3.Compare(clientv3.ModRevision(kk), "=", e.mod()))
	} else {
		t.readRev = v.rev
		t.absent(kk)
	}
	t.cache = kvs
	return true
}

// load reads the key's record, and with it, at the same revision, the
// other records the call will read (a session, a queue index), so that most
// calls read once.
func (t *tx) load(also ...string) error {
	kk := t.b.n.key(t.k)
	ops := make([]clientv3.Op, 0, 1+len(also))
	ops = append(ops, clientv3.OpGet(kk))
	for _, k := range also {
		ops = append(ops, clientv3.OpGet(k))
	}
	resp, err := t.b.cli.Txn(t.ctx).Then(ops...).Commit()
	if err != nil {
		return t.b.etcdErr("reading a key", err)
	}
	t.readRev = resp.Header.Revision
	t.cache = make(map[string]*mvccpb.KeyValue, len(also))
	for i, k := range also {
		var kv *mvccpb.KeyValue
		if kvs := resp.Responses[1+i].GetResponseRange().GetKvs(); len(kvs) > 0 {
			kv = kvs[0]
		}
		t.cache[k] = kv
	}
	t.guarded[kk] = true
	kvs := resp.Responses[0].GetResponseRange().GetKvs()
	if len(kvs) == 0 {
		t.absent(kk)
		return nil
	}
	kv := kvs[0]
	t.recRev = kv.ModRevision
	t.cmps = append(t.cmps, clientv3.Compare(clientv3.ModRevision(kk), "=", kv.ModRevision))
	t.rec, err = decodeKey(kv.Value)
	t.readQueue = t.rec.Queue
	return err
}

// absent guards the transaction with the key's record absent at t.readRev
// and, for a write, with no record dropped since: a record made and
// dropped in between could have had a token above the read's revision,
// which a grant here must be above (grant; docs/DESIGN.md, "Tokens"). An
// answer that writes nothing needs only the absence (confirm): P/dropped
// is one key for the data set, and a drop of any other key would fail it.
func (t *tx) absent(kk string) {
	t.cmps = append(t.cmps, clientv3.Compare(clientv3.CreateRevision(kk), "=", 0))
	t.writeCmps = append(t.writeCmps, clientv3.Compare(clientv3.ModRevision(t.b.n.dropped()), "<", t.readRev+1))
}

// commitCmps are the guards of the transaction's write.
func (t *tx) commitCmps() []clientv3.Cmp {
	return append(t.cmps[:len(t.cmps):len(t.cmps)], t.writeCmps...)
}

// get reads another record and guards the transaction with it.
func (t *tx) get(key string) ([]byte, int64, error) {
	kv, cached := t.cache[key]
	if !cached && t.cached && t.b.rc.holds(key) {
		// Kept for the rest of the transaction: its guard is of this
		// read, and the cache may go back in time before the next one (a
		// relist's reset forgets what this server wrote through after
		// the list's revision), so a second read of the cache could
		// decide on an older record than the guard checks (docs/DESIGN.md,
		// "One round trip for a warm call"; TestAttackCacheReadsOnce).
		// A read from etcd is at t.readRev, the same each time.
		kv, cached = t.b.rc.kv(key), true
		t.cache[key] = kv
	}
	if !cached {
		resp, err := t.b.cli.Get(t.ctx, key, clientv3.WithRev(t.readRev))
		if err != nil {
			return nil, 0, t.readErr("reading", err)
		}
		if len(resp.Kvs) > 0 {
			kv = resp.Kvs[0]
		}
	}
	if !t.guarded[key] {
		t.guarded[key] = true
		if kv == nil {
			t.cmps = append(t.cmps, clientv3.Compare(clientv3.CreateRevision(key), "=", 0))
		} else {
			t.cmps = append(t.cmps, clientv3.Compare(clientv3.ModRevision(key), "=", kv.ModRevision))
		}
	}
	if kv == nil {
		return nil, 0, nil
	}
	return kv.Value, kv.ModRevision, nil
}

// readErr is an error of a read at the record's revision: one that etcd
// compacted since is a conflict, read again.
func (t *tx) readErr(what string, err error) error {
	if errors.Is(err, rpctypes.ErrCompacted) {
		return errConflict
	}
	return t.b.etcdErr(what, err)
}

// sibling reads another type's record of the same resource.
func (t *tx) sibling(typ lock.Type) (keyRec, error) {
	v, _, err := t.get(t.b.n.key(lock.Key{Type: typ, Resource: t.k.Resource}))
	if err != nil {
		return keyRec{}, err
	}
	return decodeKey(v)
}

// refs reads the resource's references.
func (t *tx) refs() (refRec, error) {
	v, _, err := t.get(t.b.n.ref(t.k.Resource))
	var r refRec
	if err != nil || v == nil {
		return r, err
	}
	if err := jsonUnmarshal(v, &r); err != nil {
		return r, err
	}
	return r, nil
}

// session reads a node's session: its lease, 0 when it has none, and the
// home lease it lives on while its own is not granted (sessRec).
func (t *tx) session(node string) (lease, home int64, err error) {
	v, _, err := t.get(t.b.n.session(node))
	if err != nil || v == nil {
		return 0, 0, err
	}
	s, err := decodeSess(v)
	if err != nil {
		return 0, 0, err
	}
	return s.Lease, s.Home, nil
}

// atRead reads the queue as of the revision the key's record was read at.
// The record's mod revision guards the queue (every change of one writes
// the record too), but only for the commit: a read of the queue at a later
// revision could see a waiter that another server took out since, and
// fail, or answer, on a queue that never was with that record. Read at the
// record's revision, the queue and the record are one state; the commit
// then fails if either changed since.
//
// The watch's queues (queues.go) serve these reads first: a queue it
// keeps with the record's mod revision t.recRev is the queue etcd had at
// every revision from t.recRev until the record changed, so it is the one
// a read at t.readRev returns whenever the guard holds, and the guard
// fails the transaction when it does not. The record may have come from
// the cache or from etcd: the revision, not the source, is what ties the
// two.
func (t *tx) atRead() clientv3.OpOption { return clientv3.WithRev(t.readRev) }

// queueID is the key's queue among the watch's (queues.go).
func (t *tx) queueID() string { return t.b.qs.recID(t.b.n.key(t.k)) }

// waiting returns node's place in the queue. An index whose queue entry is
// gone is stale, not a place: a success with many waiters leaves their
// indexes to a sweep (indexes.go).
func (t *tx) waiting(node string) (seqWait, bool, error) {
	if t.rec.Queue == 0 {
		return seqWait{}, false, nil
	}
	v, _, err := t.get(t.b.n.queueNode(t.k, node))
	if err != nil || v == nil {
		return seqWait{}, false, err
	}
	seq, err := indexSeq(v)
	if err != nil {
		return seqWait{}, false, err
	}
	w, ok, err := t.wait(seq, node)
	return seqWait{seq, w}, ok, err
}

// indexSeq reads the seq a queue index holds.
func indexSeq(v []byte) (uint64, error) {
	seq, err := strconv.ParseUint(string(v), 16, 64)
	if err != nil {
		return 0, fmt.Errorf("etcd backend: a queue index that is not ours: %w", err)
	}
	return seq, nil
}

// wait reads node's queue entry at seq; ok false when there is none. The
// queue is read at the record's revision, which the transaction's guard
// holds to: every change of a queue writes its key's record.
func (t *tx) wait(seq uint64, node string) (w waitRec, ok bool, err error) {
	if w, found, known := t.b.qs.find(t.queueID(), t.recRev, seq, node); known {
		return w, found, nil
	}
	resp, err := t.b.cli.Get(t.ctx, t.b.n.wait(t.k, seq, node), t.atRead())
	if err != nil {
		return w, false, t.readErr("reading the queue", err)
	}
	if len(resp.Kvs) == 0 {
		return w, false, nil
	}
	return w, true, jsonUnmarshal(resp.Kvs[0].Value, &w)
}

// position is the 1-based place of the waiter at seq.
func (t *tx) position(seq uint64) (int, error) {
	if pos, ok := t.b.qs.position(t.queueID(), t.recRev, seq); ok {
		return pos, nil
	}
	resp, err := t.b.cli.Get(t.ctx, t.b.n.queue(t.k), clientv3.WithRange(t.b.n.waitSeq(t.k, seq+1)), clientv3.WithCountOnly(), t.atRead())
	if err != nil {
		return 0, t.readErr("counting the queue", err)
	}
	return int(resp.Count), nil
}

// seqWait is a waiter with its seq.
type seqWait struct {
	seq uint64
	waitRec
}

// head reads up to n waiters from the front of the queue; all of them when
// n is 0.
func (t *tx) head(n int) ([]seqWait, error) {
	if t.rec.Queue == 0 {
		return nil, nil
	}
	if ws, ok := t.b.qs.head(t.queueID(), t.recRev, n, t.removed); ok {
		return ws, nil
	}
	opts := []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend), t.atRead()}
	if n > 0 {
		opts = append(opts, clientv3.WithLimit(int64(n+len(t.removed))))
	}
	resp, err := t.b.cli.Get(t.ctx, t.b.n.queue(t.k), opts...)
	if err != nil {
		return nil, t.readErr("reading the queue", err)
	}
	out := make([]seqWait, 0, len(resp.Kvs))
	prefix := len(t.b.n.queue(t.k))
	for _, kv := range resp.Kvs {
		if len(kv.Key) < prefix+16 {
			return nil, fmt.Errorf("etcd backend: a queue entry that is not ours: %q", kv.Key)
		}
		seq, err := strconv.ParseUint(string(kv.Key[prefix:prefix+16]), 16, 64)
		if err != nil {
			return nil, fmt.Errorf("etcd backend: a queue entry that is not ours: %w", err)
		}
		if t.removed[seq] {
			// Dequeued by this transaction already (a ttl waiter that
			// expired): the read does not see its own writes.
			continue
		}
		var w waitRec
		if err := jsonUnmarshal(kv.Value, &w); err != nil {
			return nil, err
		}
		out = append(out, seqWait{seq, w})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].seq < out[j].seq })
	if n > 0 && len(out) > n {
		out = out[:n]
	}
	return out, nil
}

// put writes the key's record with the transition x (nil: no event).
func (t *tx) put(x *trans) {
	if x != nil {
		t.x = x
	}
	t.rec.X = t.x // a batch's transition stays when a later call of it writes the record
	val := encode(&t.rec)
	op := clientv3.OpPut(t.b.n.key(t.k), val)
	// Made now, from the record the JSON was made of: the write-through
	// then need not read the JSON back.
	t.recForm = writtenForm(&t.rec, []byte(val))
	if t.recOp >= 0 {
		t.ops[t.recOp] = op // one write of a key per transaction
		return
	}
	t.recOp = len(t.ops)
	t.ops = append(t.ops, op)
}

func (t *tx) op(op clientv3.Op) { t.ops = append(t.ops, op) }

// leasedOp is op for an operation made WithLease.
func (t *tx) leasedOp(op clientv3.Op) {
	t.leased = true
	t.op(op)
}

// dequeue removes the waiter at seq (the record's count is the caller's).
func (t *tx) dequeue(seq uint64, node string) {
	if t.removed == nil {
		t.removed = map[uint64]bool{}
	}
	t.removed[seq] = true
	t.op(clientv3.OpDelete(t.b.n.wait(t.k, seq, node)))
	t.op(clientv3.OpDelete(t.b.n.queueNode(t.k, node)))
}

// index notes a session-leased hold or wait of node, so that the end of the
// session finds it (session.go).
func (t *tx) index(node string, slease int64) {
	if slease != 0 {
		t.op(clientv3.OpPut(t.b.n.nodeKey(node, t.k), strconv.FormatInt(slease, 16)))
	}
}
