package etcd

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/lock"
)

// TryLock grants, queues, skips or refuses, in the order of docs/DESIGN.md
// ("TryLock"), in one transaction.
func (b *Backend) TryLock(ctx context.Context, req lock.LockRequest) (lock.LockResult, error) {
	if err := req.Validate(); err != nil {
		return lock.LockResult{}, err
	}
	if err := b.alive(); err != nil {
		return lock.LockResult{}, err
	}
	k := req.Key()
	var (
		res      lock.LockResult
		newLease int64 // a session lease granted for this call, kept across attempts
		usedNew  bool
		home     int64     // the home lease node's session lives on, as the attempt read it
		ownLease int64     // the session lease this call granted to give a session its own
		ownUntil time.Time // when that grant stands to at least
		promoted int64     // the session lease this attempt gives its session, 0 for none
		granted  bool
		ends     holdEnds // what ends the hold, when res.Acquired
	)
	defer func() {
		if newLease != 0 && !usedNew {
			b.revokeLater(newLease)
		}
	}()
	// sessionLease returns node's session lease, making one (a session
	// already in its grace) when it has none. A session on its server's
	// home lease gets its own here, in the same transaction, guarded by
	// the record's revision (docs/DESIGN.md, "Home leases"): a hold or
	// wait under it must outlive that server while the node moves on.
	sessionLease := func(t *tx, have int64) (int64, error) {
		if have != 0 && home == 0 {
			return have, nil
		}
		if have != 0 {
			// Granted again (grantID keeps it alive) when the call
			// waited for its turn a third of the TTL since.
			if ownLease != have || time.Until(ownUntil) < time.Duration(b.graceTTL)*time.Second*2/3 {
				until, err := b.grantID(t.ctx, have)
				if err != nil {
					return 0, err
				}
				ownLease, ownUntil = have, until
			}
			t.leasedOp(clientv3.OpPut(b.n.session(req.Node), encodeSess(sessRec{Lease: have}), clientv3.WithLease(clientv3.LeaseID(have))))
			promoted, home = have, 0
			return have, nil
		}
		if err := b.roomForSession(); err != nil {
			return 0, err
		}
		if newLease == 0 {
			l, err := b.cli.Grant(t.ctx, b.graceTTL)
			if err != nil {
				return 0, b.etcdErr("granting a session lease", err)
			}
			newLease = int64(l.ID)
		}
		t.leasedOp(clientv3.OpPut(b.n.session(req.Node), encodeSess(sessRec{Lease: newLease}), clientv3.WithLease(clientv3.LeaseID(newLease))))
		usedNew = true
		return newLease, nil
	}
	// A session on this server's home lease gets its own at this call
	// (sessionLease). The grant is a round trip of its own (a raft entry),
	// made here before the call joins its key's transaction: inside, it
	// would hold up the key's stripe and every call combined with this
	// one, one grant after another. A grant the transaction then finds no
	// use for runs out in a grace; a session this server does not keep
	// (the node's stream is on another) is granted inside. The grant waits
	// for admit, as the sessions made and promoted do: a fleet taking its
	// first session-leased locks together is thousands of new leases,
	// whose keepalives come first.
	if req.Lease != lock.LeaseTTL {
		if l := b.s.homed(req.Node); l != 0 {
			if done, err := b.s.admit(ctx); err == nil {
				if until, err := b.grantID(ctx, l); err == nil {
					ownLease, ownUntil = l, until
				}
				done()
			}
		}
	}
	_, err := b.runCombined(ctx, k, req.Node, func(t *tx) error {
		res, usedNew, granted = lock.LockResult{}, false, false
		now := time.Now()
		rec := &t.rec
		sl, h, err := t.session(req.Node)
		if err != nil {
			return err
		}
		home, promoted = h, 0
		// 2. The holder again: the same grant, renewed.
		if rec.Holder == req.Node {
			res = lock.LockResult{Acquired: true, Token: rec.Token, Holder: rec.Holder}
			lease := lock.Lease(rec.Lease)
			if req.Lease != lock.LeaseAuto {
				lease = req.Lease
			}
			changed := rec.Claim != 0
			rec.Claim = 0
			switch lease {
			case lock.LeaseSession:
				if rec.Lease != uint8(lock.LeaseSession) || rec.SLease != sl || sl == 0 {
					l, err := sessionLease(t, sl)
					if err != nil {
						return err
					}
					rec.Lease, rec.SLease, rec.TTL = uint8(lock.LeaseSession), l, 0
					t.index(req.Node, l)
					changed = true
				}
			default:
				rec.Lease, rec.SLease, rec.TTL = uint8(lock.LeaseTTL), 0, now.Add(b.cfg.LockTTL).UnixNano()
				changed = true
			}
			if changed {
				t.put(nil)
			}
			ends = endsOf(rec)
			return nil
		}
		// 3. A waiter again: its place, renewed.
		if sw, ok, err := t.waiting(req.Node); err != nil {
			return err
		} else if ok {
			seq, w := sw.seq, sw.waitRec
			pos, err := t.position(seq)
			if err != nil {
				return err
			}
			res = lock.LockResult{Queued: true, Holder: rec.Holder, Position: pos}
			lease := lock.Lease(w.Lease)
			if req.Lease != lock.LeaseAuto {
				lease = req.Lease
			}
			switch {
			case lease == lock.LeaseSession && (w.Lease != uint8(lock.LeaseSession) || w.SLease != sl || sl == 0):
				l, err := sessionLease(t, sl)
				if err != nil {
					return err
				}
				w.Lease, w.SLease, w.TTL = uint8(lock.LeaseSession), l, 0
				t.index(req.Node, l)
			case lease == lock.LeaseTTL:
				w.Lease, w.SLease, w.TTL = uint8(lock.LeaseTTL), 0, now.Add(b.cfg.LockTTL).UnixNano()
				rec.WaitTTL = minDeadline(rec.WaitTTL, w.TTL)
			default:
				return nil
			}
			t.op(clientv3.OpPut(b.n.wait(k, seq, w.Node), encode(&w)))
			t.put(nil)
			return nil
		}
		// 4. The reference exclusions.
		if err := t.refConflict(); err != nil {
			return err
		}
		// 5. A recent success, with skip_recent.
		if req.SkipRecent && k.Type != lock.Update && !rec.held() && rec.retained(now, b.cfg.CompletedRetention) && rec.Done.OK {
			res = lock.LockResult{Skip: true}
			return nil
		}
		// 6. Held, or reserved by its lock delay (refused as held, naming
		// no holder), and only one node at a time.
		if (rec.held() || rec.delayed()) && !b.cfg.AllowMultiNodeDownload {
			return &lock.HeldError{Holder: rec.Holder}
		}
		// 7. Limits.
		if rec.empty(now, b.cfg.CompletedRetention) && b.cfg.MaxKeys > 0 {
			if n := b.w.keyCount(b.cfg.MaxKeys); n >= b.cfg.MaxKeys {
				b.refusedKeys.Add(1)
				return fmt.Errorf("%w: %d keys have state, at most %d are allowed", lock.ErrTooManyKeys, n, b.cfg.MaxKeys)
			}
		}
		if (rec.held() || rec.delayed()) && b.cfg.MaxQueue > 0 && rec.Queue >= b.cfg.MaxQueue {
			b.refusedQueue.Add(1)
			return fmt.Errorf("%w: %d waiters, at most %d are allowed", lock.ErrQueueFull, rec.Queue, b.cfg.MaxQueue)
		}
		lease := req.Lease
		if lease == lock.LeaseAuto {
			lease = lock.LeaseTTL
			if sl != 0 {
				lease = lock.LeaseSession
			}
		}
		if lease == lock.LeaseSession {
			if sl, err = sessionLease(t, sl); err != nil {
				return err
			}
			t.index(req.Node, sl)
		} else {
			sl = 0
		}
		// 8. Free: granted. Held, or reserved by its lock delay: queued,
		// since the delay protects a holder whose lease ran out but that
		// may still be running (docs/DESIGN.md, "Leases").
		if !rec.held() && !rec.delayed() {
			t.grant(req.Node, lease, sl, now, false)
			t.put(&trans{Assigned: req.Node})
			res = lock.LockResult{Acquired: true, Token: rec.Token, Holder: req.Node}
			ends = endsOf(rec)
			granted = true
			return nil
		}
		w := waitRec{Node: req.Node, Lease: uint8(lease), SLease: sl}
		if lease == lock.LeaseTTL {
			w.TTL = now.Add(b.cfg.LockTTL).UnixNano()
			rec.WaitTTL = minDeadline(rec.WaitTTL, w.TTL)
		}
		seq := rec.Seq
		rec.Seq++
		rec.Queue++
		t.op(clientv3.OpPut(b.n.wait(k, seq, w.Node), encode(&w)))
		t.op(clientv3.OpPut(b.n.queueNode(k, req.Node), fmt.Sprintf("%x", seq)))
		t.put(nil)
		res = lock.LockResult{Queued: true, Holder: rec.Holder, Position: rec.Queue}
		return nil
	}, b.n.session(req.Node), b.n.queueNode(k, req.Node))
	if err != nil {
		return lock.LockResult{}, err
	}
	if promoted != 0 {
		b.promotions.Add(1)
		b.s.promoted(req.Node, promoted)
	}
	if granted {
		b.grants.Add(1)
	}
	if res.Acquired {
		res.Guaranteed = b.guaranteed(ctx, ends)
	}
	return res, nil
}

// grant makes node the holder with a new token. The token is above the
// key's last one and above the revision the record was read at, and every
// token is at most the revision of its grant, so tokens increase per key
// even across a record that was dropped and made again (docs/DESIGN.md, "An
// etcd backend").
func (t *tx) grant(node string, lease lock.Lease, slease int64, now time.Time, handoff bool) {
	r := &t.rec
	r.Holder = node
	r.Token = max(r.Token+1, uint64(t.readRev)+1)
	r.Lease, r.SLease, r.TTL = uint8(lease), slease, 0
	if lease == lock.LeaseTTL {
		r.TTL = now.Add(t.b.cfg.LockTTL).UnixNano()
	}
	r.Acquired = now.UnixNano()
	r.Claim, r.MaxHold, r.Delay = 0, 0, 0
	if handoff && t.b.cfg.ClaimTimeout > 0 {
		r.Claim = now.Add(t.b.cfg.ClaimTimeout).UnixNano()
	}
	if t.b.cfg.MaxHold > 0 {
		r.MaxHold = now.Add(t.b.cfg.MaxHold).UnixNano()
	}
}

func minDeadline(a, b int64) int64 {
	if a == 0 || (b != 0 && b < a) {
		return b
	}
	return a
}

// refConflict applies the exclusions of docs/DESIGN.md ("Reference rules")
// to a new lock of the key, reading the sibling keys and the references in
// the same transaction as the change.
func (t *tx) refConflict() error {
	if !t.b.refCounting {
		return nil
	}
	upd := t.b.cfg.UpdateRequiresNoRef
	heldBy := func(typ lock.Type) (bool, error) {
		r, err := t.sibling(typ)
		return r.held(), err
	}
	count := func() (int, error) {
		r, err := t.refs()
		return len(r.Nodes), err
	}
	switch t.k.Type {
	case lock.Delete:
		n, err := count()
		if err != nil {
			return err
		}
		if err := lock.RefPermits(lock.Delete, n, upd); err != nil {
			return err
		}
		for _, typ := range []lock.Type{lock.Pull, lock.Update} {
			if h, err := heldBy(typ); err != nil {
				return err
			} else if h {
				return fmt.Errorf("%w: a pull or update of it is running", lock.ErrInUse)
			}
		}
	case lock.Pull:
		if h, err := heldBy(lock.Delete); err != nil {
			return err
		} else if h {
			return lock.ErrDeleting
		}
		if upd {
			if h, err := heldBy(lock.Update); err != nil {
				return err
			} else if h {
				return lock.ErrUpdating
			}
		}
	case lock.Update:
		if h, err := heldBy(lock.Delete); err != nil {
			return err
		} else if h {
			return lock.ErrDeleting
		}
		if upd {
			n, err := count()
			if err != nil {
				return err
			}
			if err := lock.RefPermits(lock.Update, n, upd); err != nil {
				return err
			}
			if h, err := heldBy(lock.Pull); err != nil {
				return err
			} else if h {
				return fmt.Errorf("%w: a pull of it is running", lock.ErrInUse)
			}
		}
	}
	return nil
}

// Unlock ends the holder's hold with its outcome (docs/DESIGN.md, "Unlock").
func (b *Backend) Unlock(ctx context.Context, req lock.UnlockRequest) (lock.UnlockResult, error) {
	if err := req.Validate(); err != nil {
		return lock.UnlockResult{}, err
	}
	if err := b.alive(); err != nil {
		return lock.UnlockResult{}, err
	}
	errText, cut := lock.TruncateError(req.Error)
	success := req.Success
	var res lock.UnlockResult
	var handed bool
	_, err := b.run(ctx, req.Key(), func(t *tx) error {
		res, handed = lock.UnlockResult{}, false
		rec := &t.rec
		now := time.Now()
		if rec.Holder != req.Node {
			if d := rec.Done; d != nil && d.Unlock && d.Node == req.Node && d.OK == success && (req.Token == 0 || req.Token == d.Token) && rec.retained(now, b.cfg.CompletedRetention) {
				res = lock.UnlockResult{NextHolder: d.Next, Replayed: true}
				return nil
			}
			return fmt.Errorf("%w: %s does not hold %v", lock.ErrNotHolder, req.Node, req.Key())
		}
		if req.Token != 0 && req.Token != rec.Token {
			return fmt.Errorf("%w: %d, the grant's is %d", lock.ErrStaleToken, req.Token, rec.Token)
		}
		next, err := t.end(success, errText, true, false, now)
		if err != nil {
			return err
		}
		res.NextHolder = next
		handed = next != ""
		return nil
	}, b.erased(req.Key())...)
	if err != nil {
		return lock.UnlockResult{}, err
	}
	if cut && !res.Replayed {
		b.truncatedErrors.Add(1)
	}
	if handed {
		b.grants.Add(1)
		b.handoffs.Add(1)
	}
	return res, nil
}

// maxRefusals bounds the waiters one transaction refuses at promotion, so
// that its events' ids fit in a revision's eight (watch.go).
const maxRefusals = 6

// end ends the hold with an outcome: a success of any type but update frees
// the key and tells every waiter, anything else hands it to the first
// eligible waiter (docs/DESIGN.md, "Unlock" steps 4 to 6), unless
// leaseRanOut (a ttl expiry or a lost session) and Config.LockDelay
// reserve the key first: the completion is written and told now, and the
// key's timer hands it on at the delay's end (expireTx; docs/DESIGN.md,
// "Leases"). It returns the next holder, "" if none yet.
func (t *tx) end(success bool, errText string, byUnlock, leaseRanOut bool, now time.Time) (string, error) {
	r := &t.rec
	b := t.b
	d := &done{Node: r.Holder, Token: r.Token, OK: success, Err: errText, At: now.UnixNano(), Unlock: byUnlock}
	x := &trans{Done: d}
	r.Holder, r.Lease, r.SLease, r.TTL, r.Acquired, r.Claim, r.MaxHold = "", 0, 0, 0, 0, 0, 0
	var next string
	if success && t.k.Type != lock.Update {
		var waiters []seqWait
		if b.refCounting && t.k.Type == lock.Pull && r.Queue > 0 {
			var err error
			if waiters, err = t.head(0); err != nil {
				return "", err
			}
		}
		if r.Queue > 0 {
			// Deleting a waiter's queue entry tells it; its index may
			// wait for the sweep (indexes.go).
			t.op(clientv3.OpDelete(b.n.queue(t.k), clientv3.WithPrefix()))
			if b.ix.leaves(r.Queue) {
				x.Left = true
			} else {
				t.op(clientv3.OpDelete(b.n.queueNodes(t.k), clientv3.WithPrefix()))
			}
			x.Skip = true
			r.Queue, r.WaitTTL = 0, 0
		}
		if err := t.completed(d.Node, waiters); err != nil {
			return "", err
		}
	} else if leaseRanOut && b.cfg.LockDelay > 0 {
		r.Delay = now.Add(b.cfg.LockDelay).UnixNano()
	} else {
		var err error
		if next, err = t.promote(x, now); err != nil {
			return "", err
		}
	}
	d.Next = next
	if b.cfg.CompletedRetention > 0 && b.cfg.CompletedMax > 0 {
		r.Done = d
	} else {
		r.Done = nil
	}
	t.put(x)
	return next, nil
}

// promote hands the key to the first eligible waiter; a delete or update
// waiter the references now refuse leaves the queue and is told so.
func (t *tx) promote(x *trans, now time.Time) (string, error) {
	r := &t.rec
	if r.Queue > 0 {
		ws, err := t.head(maxRefusals + 1)
		if err != nil {
			return "", err
		}
		if len(ws) == 0 {
			return "", fmt.Errorf("etcd backend: %v counts %d waiters and has none", t.k, r.Queue)
		}
		for _, w := range ws {
			refused := false
			if t.k.Type == lock.Delete || t.k.Type == lock.Update {
				switch err := t.refConflict(); {
				case errors.Is(err, lock.ErrInUse), errors.Is(err, lock.ErrDeleting), errors.Is(err, lock.ErrUpdating):
					refused = true
				case err != nil:
					return "", err // a failed read refuses nobody
				}
			}
			if refused && len(x.Refused) == maxRefusals {
				// The key stays free with waiters; its timer promotes
				// the next one at once (keyRec.deadline).
				return "", nil
			}
			t.dequeue(w.seq, w.Node)
			r.Queue--
			if r.Queue == 0 {
				r.WaitTTL = 0
			}
			if refused {
				x.Refused = append(x.Refused, w.Node)
				x.At = now.UnixNano()
				continue
			}
			t.grant(w.Node, lock.Lease(w.Lease), w.SLease, now, true)
			x.Assigned = w.Node
			return w.Node, nil
		}
	}
	return "", nil
}

// erased names the records a success of k reads to erase their completion
// records (a pull erases the delete's, a delete the pull's and the
// update's), so that an unlock reads them with its own.
func (b *Backend) erased(k lock.Key) []string {
	var also []string
	for _, typ := range erasedBy(k.Type) {
		also = append(also, b.n.key(lock.Key{Type: typ, Resource: k.Resource}))
	}
	return also
}

func erasedBy(t lock.Type) []lock.Type {
	switch t {
	case lock.Pull:
		return []lock.Type{lock.Delete}
	case lock.Delete:
		return []lock.Type{lock.Pull, lock.Update}
	}
	return nil
}

// completed applies a success of a pull or delete to the references and to
// the sibling keys' completion records (docs/DESIGN.md, "Reference rules"
// and "Completion records").
func (t *tx) completed(holder string, waiters []seqWait) error {
	b := t.b
	for _, typ := range erasedBy(t.k.Type) {
		sk := lock.Key{Type: typ, Resource: t.k.Resource}
		v, _, err := t.get(b.n.key(sk))
		if err != nil {
			return err
		}
		if v == nil {
			continue
		}
		s, err := decodeKey(v)
		if err != nil {
			return err
		}
		if s.Done == nil {
			continue
		}
		s.Done, s.X = nil, nil
		t.op(clientv3.OpPut(b.n.key(sk), encode(&s)))
	}
	if !b.refCounting {
		return nil
	}
	switch lock.RefEffectOf(t.k.Type, true) {
	case lock.RefAddNode:
		rr, err := t.refs()
		if err != nil {
			return err
		}
		nodes := append(rr.Nodes, holder)
		for _, w := range waiters {
			nodes = append(nodes, w.Node)
		}
		slices.Sort(nodes)
		nodes = slices.Compact(nodes)
		t.op(clientv3.OpPut(b.n.ref(t.k.Resource), encode(refRec{Nodes: nodes})))
	case lock.RefClear:
		if _, err := t.refs(); err != nil {
			return err
		}
		t.op(clientv3.OpDelete(b.n.ref(t.k.Resource)))
	}
	return nil
}

// Cancel takes node out of the queue, or releases its hold as a failure
// (docs/DESIGN.md, "Cancel").
func (b *Backend) Cancel(ctx context.Context, typ lock.Type, resource, node string) (lock.CancelResult, error) {
	k := lock.Key{Type: typ, Resource: resource}
	if err := (lock.UnlockRequest{Type: typ, Resource: resource, Node: node}).Validate(); err != nil {
		return lock.CancelResult{}, err
	}
	if err := b.alive(); err != nil {
		return lock.CancelResult{}, err
	}
	var res lock.CancelResult
	var next string
	_, err := b.run(ctx, k, func(t *tx) error {
		res, next = lock.CancelResult{}, ""
		if t.rec.Holder == node {
			n, err := t.end(false, "cancelled", false, false, time.Now())
			next = n
			res.Released = true
			return err
		}
		w, ok, err := t.waiting(node)
		if err != nil || !ok {
			return err
		}
		t.dequeue(w.seq, node)
		t.rec.Queue--
		if t.rec.Queue == 0 {
			t.rec.WaitTTL = 0
		}
		t.put(nil)
		res.Dequeued = true
		return nil
	}, b.n.queueNode(k, node))
	if err != nil {
		return lock.CancelResult{}, err
	}
	if next != "" {
		b.grants.Add(1)
		b.handoffs.Add(1)
	}
	return res, nil
}

// Status describes a key; with node, it renews node's ttl lease on it
// (docs/DESIGN.md, "Status").
func (b *Backend) Status(ctx context.Context, typ lock.Type, resource, node string) (lock.Status, error) {
	k := lock.Key{Type: typ, Resource: resource}
	if err := lock.ValidateKey(typ, resource, "-"); err != nil {
		return lock.Status{}, err
	}
	if node != "" {
		if err := lock.ValidateNode(node); err != nil {
			return lock.Status{}, err
		}
	}
	if err := b.alive(); err != nil {
		return lock.Status{}, err
	}
	var st lock.Status
	var ends holdEnds
	var held bool // node holds the key
	var also []string
	if node != "" {
		also = append(also, b.n.queueNode(k, node))
	}
	_, err := b.run(ctx, k, func(t *tx) error {
		now := time.Now()
		rec := &t.rec
		if rec.bare() {
			// The key is absent, its record not yet dropped by its
			// timer: it answers as an absent key, with no token
			// (docs/DESIGN.md, "Status"), as in the memory engine, which
			// forgets the key in the transition that empties it. It
			// used to show its last token until the timer acted, and
			// none after, so the answer hung on a race with the timer
			// (TestDifferentialErasedRecord).
			st = lock.Status{Key: k}
			return nil
		}
		st = lock.Status{Key: k, Held: rec.held(), Holder: rec.Holder, Token: rec.Token, QueueLength: rec.Queue}
		if rec.held() {
			st.AcquiredAt = time.Unix(0, rec.Acquired)
		}
		if rec.retained(now, b.cfg.CompletedRetention) {
			d := rec.Done
			st.LastCompleted = &lock.Completion{Node: d.Node, Token: d.Token, Success: d.OK, Error: d.Err, CompletedAt: time.Unix(0, d.At)}
		}
		if node == "" {
			return nil
		}
		if rec.Holder == node {
			if rec.Lease == uint8(lock.LeaseTTL) {
				rec.TTL = now.Add(b.cfg.LockTTL).UnixNano()
				t.put(nil)
			}
			ends, held = endsOf(rec), true
			return nil
		}
		sw, ok, err := t.waiting(node)
		if err != nil || !ok {
			return err
		}
		seq, w := sw.seq, sw.waitRec
		if st.Position, err = t.position(seq); err != nil {
			return err
		}
		if w.Lease == uint8(lock.LeaseTTL) {
			w.TTL = now.Add(b.cfg.LockTTL).UnixNano()
			rec.WaitTTL = minDeadline(rec.WaitTTL, w.TTL)
			t.op(clientv3.OpPut(b.n.wait(k, seq, w.Node), encode(&w)))
			t.put(nil)
		}
		return nil
	}, also...)
	if err != nil {
		return lock.Status{}, err
	}
	if held {
		st.Guaranteed = b.guaranteed(ctx, ends)
	}
	return st, nil
}
