package etcd

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"sync"
	"time"

	"github.com/dlock/dlock/lock"
)

// Calls of one key on one server are combined: while a transaction for the
// key is in flight, the calls that arrive wait, and the next transaction
// applies as many of them as fit, in their order, one after the other on
// the same record, and commits them at once. Ten thousand nodes that queue
// for one layer through one server then take some 300 transactions, not ten
// thousand one after the other (docs/DESIGN.md, "An etcd backend"). Each
// call's answer is what it would have been alone at that point of the
// order. A batch makes at most one transition (an event's id is its
// revision and its index in one transition), and has each node at most
// once; a call that would break either waits for the next batch.

// batchMax bounds the calls of one transaction; batchOps its operations,
// under etcd's 128.
const (
	batchMax = 48
	batchOps = 110
)

// call is one call waiting to be combined.
type call struct {
	fn   func(t *tx) error
	also []string
	node string

	ready chan struct{} // closed when done, or when it is to lead
	lead  bool          // it leads the key's next batches
	done  bool
	taken bool // in a batch being applied
	rev   int64
	err   error
}

type keyCalls struct {
	calls   []*call
	running bool
}

type combiner struct {
	mu sync.Mutex
	q  map[lock.Key]*keyCalls
}

// runCombined is run for a call that may share its transaction with other
// calls of the key made by other nodes.
func (b *Backend) runCombined(ctx context.Context, k lock.Key, node string, fn func(t *tx) error, also ...string) (int64, error) {
	c := &call{fn: fn, also: also, node: node, ready: make(chan struct{})}
	cb := &b.comb
	cb.mu.Lock()
	if cb.q == nil {
		cb.q = map[lock.Key]*keyCalls{}
	}
	kc := cb.q[k]
	if kc == nil {
		kc = &keyCalls{}
		cb.q[k] = kc
	}
	kc.calls = append(kc.calls, c)
	if !kc.running {
		kc.running, c.lead = true, true
	}
	leads := c.lead
	cb.mu.Unlock()
	if !leads {
		select {
		case <-c.ready:
		case <-ctx.Done():
			cb.mu.Lock()
			if !c.taken && !c.lead && !c.done {
				kc.calls = removeCall(kc.calls, c)
				cb.mu.Unlock()
				return 0, ctx.Err()
			}
			cb.mu.Unlock()
			<-c.ready // taken (bounded by callTimeout) or to lead
		}
	}
	cb.mu.Lock()
	lead := c.lead && !c.done
	cb.mu.Unlock()
	if lead {
		b.leadBatches(k, kc, c)
	}
	return c.rev, c.err
}

func removeCall(l []*call, c *call) []*call {
	for i, d := range l {
		if d == c {
			return append(l[:i:i], l[i+1:]...)
		}
	}
	return l
}

// leadBatches applies the key's waiting calls until me is done, then hands
// the lead to the next waiting call.
func (b *Backend) leadBatches(k lock.Key, kc *keyCalls, me *call) {
	cb := &b.comb
	for {
		cb.mu.Lock()
		var batch []*call
		nodes := map[string]bool{}
		rest := kc.calls[:0:0]
		for _, c := range kc.calls {
			if len(batch) < batchMax && !nodes[c.node] {
				nodes[c.node] = true
				c.taken = true
				batch = append(batch, c)
				continue
			}
			rest = append(rest, c)
		}
		kc.calls = rest
		cb.mu.Unlock()

		deferred := b.applyBatch(k, batch)

		cb.mu.Lock()
		kc.calls = append(deferred, kc.calls...)
		for _, c := range batch {
			c.taken = false
		}
		for _, c := range batch {
			if c.done && c != me {
				close(c.ready)
			}
		}
		if !me.done {
			cb.mu.Unlock()
			continue
		}
		if len(kc.calls) > 0 {
			next := kc.calls[0]
			next.lead = true
			close(next.ready)
		} else {
			kc.running = false
			delete(cb.q, k)
		}
		cb.mu.Unlock()
		return
	}
}

// applyBatch applies calls in one transaction, tried again on conflict,
// and returns the calls that must wait for the next batch.
func (b *Backend) applyBatch(k lock.Key, calls []*call) []*call {
	finish := func(c *call, rev int64, err error) {
		c.rev, c.err, c.done = rev, err, true
	}
	stripe := b.stripes[maphash.String(b.seed, k.Resource)%uint64(len(b.stripes))]
	timer := time.NewTimer(stripeTimeout)
	var err error
	select {
	case stripe <- struct{}{}:
	case <-b.ctx.Done():
		err = lock.ErrClosed
	case <-timer.C:
		err = fmt.Errorf("%w: the calls before these on their resource took %v", lock.ErrUnavailable, stripeTimeout)
	}
	timer.Stop()
	if err != nil {
		for _, c := range calls {
			finish(c, 0, err)
		}
		return nil
	}
	defer func() { <-stripe }()
	ctx, cancel := context.WithTimeout(b.ctx, callTimeout)
	defer cancel()
	var also []string
	for _, c := range calls {
		also = append(also, c.also...)
	}
	for attempt := 0; ; attempt++ {
		if err := b.alive(); err != nil {
			for _, c := range calls {
				finish(c, 0, err)
			}
			return nil
		}
		t := &tx{b: b, ctx: ctx, k: k, guarded: map[string]bool{}, recOp: -1}
		if attempt > 0 || !t.loadCached(also...) {
			if err := t.load(also...); err != nil {
				err = b.batchErr(ctx, err)
				for _, c := range calls {
					finish(c, 0, err)
				}
				return nil
			}
		}
		type outcome struct {
			c   *call
			err error
		}
		var applied []outcome
		var deferred []*call
		conflict := false
		for _, c := range calls {
			snap := t.snapshot()
			err := c.fn(t)
			switch {
			case errors.Is(err, errConflict):
				conflict = true
			case err != nil:
				t.restore(snap)
				applied = append(applied, outcome{c, err})
			case snap.x != nil && t.x != snap.x, len(t.ops) > batchOps && snap.ops > 0:
				// A second transition, or too many operations: the
				// next batch. The first call that writes always fits.
				t.restore(snap)
				deferred = append(deferred, c)
			default:
				applied = append(applied, outcome{c, nil})
			}
		}
		if conflict {
			b.conflicts.Add(1)
			continue
		}
		rev := t.readRev
		if t.cached && len(t.ops) == 0 {
			// Answers of the cache alone (tx.confirm); with writes, the
			// commit's guards check the same.
			r, ok, err := t.confirm()
			if err != nil {
				err = b.batchErr(ctx, err)
				for _, o := range applied {
					finish(o.c, 0, err)
				}
				return deferred
			}
			if !ok {
				continue
			}
			rev = r
		}
		if len(t.ops) > 0 {
			r, ok, err := b.g.commit(ctx, t.commitCmps(), t.ops, t.leased)
			if err != nil {
				err = b.batchErr(ctx, err)
				for _, o := range applied {
					finish(o.c, 0, err)
				}
				return deferred
			}
			if !ok {
				b.conflicts.Add(1)
				if t.cached {
					b.cacheStale.Add(1)
				}
				continue
			}
			rev = r
			b.committed(rev)
			b.rc.writeThrough(t.ops, rev, t.recOp, t.recForm)
			b.qs.writeThrough(t, rev)
		}
		for _, o := range applied {
			finish(o.c, rev, o.err)
		}
		return deferred
	}
}

func (b *Backend) batchErr(ctx context.Context, err error) error {
	if ctx.Err() != nil && b.ctx.Err() == nil {
		return fmt.Errorf("%w: etcd did not answer within %v", lock.ErrUnavailable, callTimeout)
	}
	return err
}

// txSnap is what a call changed in a transaction, to undo a call that
// failed or must wait for the next batch.
type txSnap struct {
	rec    keyRec
	x      *trans
	ops    int
	recOp  int
	leased bool
}

func (t *tx) snapshot() txSnap {
	return txSnap{rec: t.rec, x: t.x, ops: len(t.ops), recOp: t.recOp, leased: t.leased}
}

func (t *tx) restore(s txSnap) {
	t.rec, t.x, t.recOp, t.leased = s.rec, s.x, s.recOp, s.leased
	t.ops = t.ops[:s.ops]
	if t.recOp >= 0 {
		t.rec.X = t.x
		t.put(nil) // the record's write as it was before the call
	}
}
