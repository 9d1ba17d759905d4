package etcd

import (
	"context"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/lock"
)

type kvLike = *mvccpb.KeyValue

// timers runs the deadlines of every key (ttl leases, claim timeouts, max
// hold, lock delays, completion retention, waiters of a free key), as this server's
// watch knows them. Every server runs them: each firing is a transaction
// guarded by the record it read, so the first one to act wins and the
// others find nothing left to do — a deadline fires once in the cluster
// (docs/DESIGN.md, "An etcd backend").
func (b *Backend) timers() {
	defer b.wg.Done()
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		if k, at, ok := b.w.oldestPastCap(); ok {
			rev, err := b.dropDone(k, at)
			if err != nil && b.ctx.Err() == nil {
				b.log.Warn("etcd backend: dropping a completion record past the cap", "key", k.String(), "err", err)
			}
			b.w.forgetDone(k, at)
			// Count again only once the watch has seen the drop, or the
			// next look would drop one more.
			b.w.caughtUp(rev, 5*time.Second)
			continue
		}
		k, at, ok := b.w.next()
		wait := time.Hour
		if ok {
			wait = time.Until(time.Unix(0, at))
		}
		if !ok || wait > 0 {
			t.Reset(wait)
			select {
			case <-b.ctx.Done():
				return
			case <-b.w.wake:
				continue
			case <-t.C:
				continue
			}
		}
		wrote, err := b.expire(k)
		if err != nil && b.ctx.Err() == nil {
			b.log.Warn("etcd backend: a timer failed", "key", k.String(), "err", err)
		}
		if err != nil || !wrote {
			// Nothing to do yet (another server did it, or this clock
			// is behind the one that set the deadline), or etcd did not
			// answer: look again a little later rather than spin. A
			// write by anyone sets the key's deadline anew.
			b.w.postpone(k, time.Now().Add(time.Second).UnixNano())
		}
	}
}

// maxExpiredWaiters bounds the ttl waiters one timer transaction removes:
// each takes two of the 128 operations etcd allows a transaction (its queue
// key and its index), and the same transaction may still end the hold and
// promote a waiter (refusals included). A transaction past the limit is
// refused by etcd, every time, and the queue places would never end
// (docs/DESIGN.md, "Leases"); the rest go in the next firings.
const maxExpiredWaiters = 48

// expire applies whatever deadlines of k have passed, and reports whether
// it changed anything.
func (b *Backend) expire(k lock.Key) (bool, error) {
	ctx, cancel := context.WithTimeout(b.ctx, 30*time.Second)
	defer cancel()
	var expired, grants uint64
	var wrote bool
	_, err := b.run(ctx, k, func(t *tx) error {
		err := b.expireTx(t, &expired, &grants)
		wrote = err == nil && len(t.ops) > 0
		return err
	})
	if err == nil {
		b.expiries.Add(expired)
		b.grants.Add(grants)
		b.handoffs.Add(grants)
	}
	return wrote, err
}

func (b *Backend) expireTx(t *tx, expiredOut, grantsOut *uint64) error {
	k := t.k
	var expired, grants uint64
	defer func() { *expiredOut, *grantsOut = expired, grants }()
	{
		now := time.Now()
		nowNs := now.UnixNano()
		r := &t.rec
		// promote hands the free key to its first eligible waiter.
		promote := func() error {
			x := &trans{}
			next, err := t.promote(x, now)
			if err != nil {
				return err
			}
			if next != "" {
				grants++
			}
			t.put(x)
			return nil
		}
		if t.recRev == 0 {
			return nil
		}
		changed := false
		// Waiters whose ttl lease ran out leave first, so that no hold is
		// handed to one of them.
		if r.Queue > 0 && r.WaitTTL != 0 && r.WaitTTL <= nowNs {
			ws, err := t.head(0)
			if err != nil {
				return err
			}
			r.WaitTTL = 0
			removed := 0
			for _, w := range ws {
				if w.Lease == uint8(lock.LeaseTTL) && w.TTL <= nowNs && removed < maxExpiredWaiters {
					removed++
					t.dequeue(w.seq, w.Node)
					r.Queue--
					expired++
					continue
				}
				if w.Lease == uint8(lock.LeaseTTL) {
					// Past maxExpiredWaiters, an expired waiter keeps
					// the deadline due: the timer fires again at once.
					r.WaitTTL = minDeadline(r.WaitTTL, w.TTL)
				}
			}
			changed = true
		}
		if r.held() {
			reason := ""
			switch {
			case r.MaxHold != 0 && r.MaxHold <= nowNs:
				reason = "max hold exceeded"
			case r.Claim != 0 && r.Claim <= nowNs:
				reason = "not claimed"
			case r.Lease == uint8(lock.LeaseTTL) && r.TTL <= nowNs:
				reason = "lock expired"
			}
			if reason != "" {
				// Only a ttl lease that ran out is delayed: a hand-off
				// not claimed was never started, and max hold is the
				// operator's bound, which a delay would stretch.
				next, err := t.end(false, reason, false, reason == "lock expired", now)
				if err != nil {
					return err
				}
				expired++
				if next != "" {
					grants++
				}
				return nil
			}
		} else if r.delayed() {
			if r.Delay <= nowNs {
				// The delay is over: the key is handed on as the end of
				// the hold would have, or left free.
				r.Delay = 0
				changed = true
				if r.Queue > 0 {
					return promote()
				}
			}
		} else if r.Queue > 0 {
			return promote()
		}
		if r.Done != nil && !r.retained(now, b.cfg.CompletedRetention) {
			r.Done = nil
			changed = true
		}
		if !r.held() && r.Queue == 0 && r.Done == nil && !r.delayed() && t.recOp < 0 && len(t.ops) == 0 {
			t.op(clientv3.OpDelete(b.n.key(k)))
			t.op(clientv3.OpPut(b.n.dropped(), ""))
			return nil
		}
		if changed {
			t.put(nil)
		}
		return nil
	}
}

// dropDone drops k's completion record of time at, the oldest while more
// than Config.CompletedMax are kept in the cluster (docs/DESIGN.md,
// "Completion records"). Every server counts them from its watch, so the
// cap holds within what the servers have not seen yet.
func (b *Backend) dropDone(k lock.Key, at int64) (int64, error) {
	ctx, cancel := context.WithTimeout(b.ctx, 30*time.Second)
	defer cancel()
	return b.run(ctx, k, func(t *tx) error {
		r := &t.rec
		if r.Done == nil || r.Done.At != at {
			return nil
		}
		r.Done = nil
		if !r.held() && r.Queue == 0 && !r.delayed() {
			t.op(clientv3.OpDelete(b.n.key(k)))
			t.op(clientv3.OpPut(b.n.dropped(), ""))
			return nil
		}
		t.put(nil)
		return nil
	})
}
