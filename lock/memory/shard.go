package memory

import (
	"context"
	"log/slog"
	"sync"
	"time"
	"unique"

	"github.com/dlock/dlock/lock"
)

// shard owns the keys of the resources that hash to it. Every field below mu
// is guarded by mu.
type shard struct {
	m *Backend

	mu      sync.Mutex
	keys    keyTable
	free    []*entry // released entries, reused to spare the hot path an allocation
	leases  deadlineHeap
	timer   *time.Timer
	timerAt mono // when timer fires; zero when it is idle
	records recordQueue
	refs    map[string]*refState // nil when reference counting is off
	// tokenFloor is at least the last token of every key the shard forgot
	// (tokens.go): a new key's tokens start above it.
	tokenFloor uint64

	held, queued               int
	grants, handoffs, expiries uint64

	out outbox
	opq []item // operator-only events waiting for the next commit (opfeed.go)

	ids [32]unique.Handle[string] // node ids interned last (intern)
}

// key returns the state of k, nil when k has none.
func (s *shard) key(k lock.Key) *keyState { return s.keys.get(k.Type, k.Resource) }

// addKey adds ks, which has no state in the shard, to the shard's keys.
func (s *shard) addKey(ks *keyState) {
	s.keys.add(ks)
	s.m.keys.Add(1)
}

// removeKey takes ks out of the shard's keys; false if it was not in them.
func (s *shard) removeKey(ks *keyState) bool {
	if !s.keys.remove(ks) {
		return false
	}
	s.m.keys.Add(-1)
	return true
}

// newEntry returns an entry for ks; attach names its node.
func (s *shard) newEntry(ks *keyState) *entry {
	if n := len(s.free); n > 0 {
		e := s.free[n-1]
		s.free[n-1] = nil
		s.free = s.free[:n-1]
		*e = entry{ks: ks, hidx: -1}
		return e
	}
	return &entry{ks: ks, hidx: -1}
}

// recycle keeps a released entry for reuse. Nothing may point to it: it is
// out of its key, the heap and its session.
func (s *shard) recycle(e *entry) {
	if len(s.free) < 256 {
		*e = entry{}
		s.free = append(s.free, e)
	}
}

// intern names e's node, unless it is named already (a lease switch).
// The shard keeps the ids it made last, by a cheap hash of the node id:
// the nodes that lock keys of a shard are mostly few, and a hit spares
// unique.Make its lookup in the process-wide table, some 25 ns where a
// lock and its unlock take 300 (a miss costs a string comparison).
func (s *shard) intern(e *entry, node string) {
	if e.id != (unique.Handle[string]{}) {
		return
	}
	i := (len(node)*31 + int(node[len(node)-1])) % len(s.ids)
	if id := s.ids[i]; id != (unique.Handle[string]{}) && id.Value() == node {
		e.id = id
		return
	}
	e.id = unique.Make(node)
	s.ids[i] = e.id
}

// txn collects what a transition must do after the shard mutex is released:
// make reference changes durable, deliver events, write log lines.
type txn struct {
	now    mono
	notify bool // someone may listen: build events
	items  []item
	saves  []refSave
	logs   []logLine
}

type logLine struct {
	level slog.Level
	msg   string
	key   lock.Key
	node  string
	token uint64
	why   string
}

func (s *shard) begin() txn {
	m := s.m
	return txn{now: m.now(), notify: m.sess.n.Load() > 0 || m.obs.n.Load() > 0 || m.ops.n.Load() > 0}
}

// commit releases the shard mutex, then makes the transition's reference
// changes durable, then lets its events go out, in that order (docs/DESIGN.md, "The outbox").
func (s *shard) commit(ctx context.Context, t txn) error {
	t.items = s.takeOps(t.items)
	var b *batch
	if len(t.items) > 0 {
		b = &batch{items: t.items, ready: len(t.saves) == 0}
		s.out.push(b)
	}
	s.mu.Unlock()
	var err error
	if len(t.saves) > 0 {
		err = s.m.persist(context.WithoutCancel(ctx), t.saves)
		if b != nil {
			s.out.markReady(b)
		}
	}
	if b != nil {
		s.out.drain(s.m.deliver)
	}
	for _, l := range t.logs {
		s.m.log.Log(ctx, l.level, l.msg, "key", l.key.String(), "node", l.node, "token", l.token, "reason", l.why)
	}
	return err
}

func (s *shard) logf(t *txn, level slog.Level, msg string, k lock.Key, node string, token uint64, why string) {
	if s.m.log.Enabled(context.Background(), level) {
		t.logs = append(t.logs, logLine{level, msg, k, node, token, why})
	}
}

// grant makes e the holder of ks with a new fencing token.
func (s *shard) grant(t *txn, ks *keyState, e *entry, handoff bool) {
	cfg := &s.m.cfg
	token := s.nextToken(ks, t.now)
	ks.lastToken = token
	ks.holder = e
	e.grantedAt = t.now
	ks.unclaimed = handoff && cfg.ClaimTimeout > 0
	s.schedule(e, t.now) // a ttl lease restarts at the grant
	s.held++
	s.grants++
	msg := "grant"
	if handoff {
		s.handoffs++
		msg = "hand-off"
	}
	if t.notify {
		t.items = append(t.items, item{
			ev:        &lock.Event{Name: lock.EventLockAssigned, Key: ks.key(), Node: e.node(), Token: token},
			to:        []string{e.node()},
			observers: true,
		})
	}
	s.logf(t, slog.LevelDebug, msg, ks.key(), e.node(), token, "")
}

func (s *shard) enqueue(t *txn, ks *keyState, e *entry) {
	if ks.wq == nil {
		ks.wq = &waitQueue{byNode: make(map[string]*entry)}
	}
	ks.wq.push(e)
	ks.wq.byNode[e.node()] = e
	s.queued++
	s.schedule(e, t.now)
	s.opJoined(t, ks, e.node())
}

// dequeue removes a waiter from anywhere in the queue.
func (s *shard) dequeue(ks *keyState, e *entry) {
	ks.wq.remove(e)
	s.forget(ks, e)
}

// forget drops a waiter that is no longer in ks's queue.
func (s *shard) forget(ks *keyState, e *entry) {
	s.opLeft(ks, e.node())
	delete(ks.wq.byNode, e.node())
	s.queued--
	s.leases.remove(e)
	e.detach()
	s.maybeDrop(ks)
	s.recycle(e)
}

// renew switches an entry's lease on a repeated /lock when the request
// names another kind; the caller then schedules it, which renews a ttl
// lease. A switch to a session lease that would open a session beyond the
// limit is refused, and the entry keeps its lease.
func (s *shard) renew(e *entry, want lock.Lease) error {
	switch {
	case want == lock.LeaseTTL && e.sess != nil:
		e.detach()
	case want == lock.LeaseSession && e.sess == nil:
		return s.attach(e, e.node(), want)
	}
	return nil
}

// schedule (re)starts e's ttl lease at now, if it has one, and puts e in
// the heap at its earliest deadline, arming the timer if that deadline
// comes before the timer fires. Every caller means to renew the ttl
// lease: a grant, an enqueue, a repeated /lock, a /status of the node.
func (s *shard) schedule(e *entry, now mono) {
	at := e.deadline(&s.m.cfg, now)
	s.leases.set(e, at)
	if at != 0 && (s.timerAt == 0 || at < s.timerAt) {
		s.arm(at)
	}
}

func (s *shard) arm(at mono) {
	s.timerAt = at
	d := time.Duration(at - s.m.now())
	if s.timer == nil {
		s.timer = time.AfterFunc(d, s.expire)
		return
	}
	s.timer.Reset(d)
}

// release ends ks's hold. Success of any type but update clears the queue and
// tells each waiter; anything else hands the key to the next eligible waiter
// (docs/DESIGN.md, "Unlock"), unless leaseRanOut (a ttl expiry or a lost
// session) and Config.LockDelay reserve the key for the delay first
// (docs/DESIGN.md, "Leases"): the completion is recorded and told now, the
// hand-off comes when the delay ends (endDelay).
// It returns the node the key went to, "" if it became free or reserved.
func (s *shard) release(t *txn, ks *keyState, success bool, errMsg string, viaUnlock, leaseRanOut bool) string {
	h, token := ks.holder, ks.lastToken // a hand-off below issues the next token
	ks.holder, ks.unclaimed = nil, false
	s.held--
	s.leases.remove(h)
	h.detach()
	k := ks.key()
	next := ""
	var done *lock.Event
	if t.notify {
		done = &lock.Event{Name: lock.EventOperationCompleted, Key: k, Node: h.node(), Success: success, Error: errMsg, CompletedAt: s.m.wall(t.now)}
	}
	if success && k.Type != lock.Update {
		var waiters []*entry
		if q := ks.wq; q != nil {
			q.compact()
			waiters = q.q
			clear(q.byNode)
		}
		var to []string
		if t.notify {
			to = make([]string, 0, len(waiters))
		}
		for _, w := range waiters {
			s.queued--
			s.leases.remove(w)
			w.detach()
			if t.notify {
				to = append(to, w.node())
			}
		}
		if s.refs != nil {
			s.refsCompleted(t, h, waiters)
		}
		for _, w := range waiters {
			s.recycle(w)
		}
		if q := ks.wq; q != nil {
			clear(waiters)
			q.q = waiters[:0]
		}
		// The opposite operation must never be skipped as "just done".
		// Other types have no opposite (docs/DESIGN.md, "Other types").
		switch k.Type {
		case lock.Delete:
			s.eraseRecord(lock.Key{Type: lock.Pull, Resource: k.Resource})
			s.eraseRecord(lock.Key{Type: lock.Update, Resource: k.Resource})
		case lock.Pull:
			s.eraseRecord(lock.Key{Type: lock.Delete, Resource: k.Resource})
		}
		if done != nil {
			t.items = append(t.items, item{ev: done, to: to, observers: true})
		}
	} else {
		if leaseRanOut && s.m.cfg.LockDelay > 0 {
			s.startDelay(t, ks)
		} else {
			next = s.promote(t, ks)
		}
		if done != nil {
			done.NextHolder = next
			t.items = append(t.items, item{ev: done, observers: true})
		}
	}
	s.record(ks, record{
		Completion: lock.Completion{Node: h.node(), Token: token, Success: success, Error: errMsg, CompletedAt: s.m.wall(t.now)},
		at:         t.now,
		viaUnlock:  viaUnlock,
		next:       next,
	})
	s.maybeDrop(ks)
	s.recycle(h)
	return next
}

// startDelay reserves ks, just freed because its holder's lease ran out,
// for Config.LockDelay: its waiters keep their places and a node that asks
// meanwhile joins them (TryLock), since the old holder may still be
// running (docs/DESIGN.md, "Leases"). The delay's end is a deadline in
// the shard's heap, served by the shard's one timer like every lease, so
// that it costs no goroutine and nothing under the mutex waits for it.
func (s *shard) startDelay(t *txn, ks *keyState) {
	if ks.wq == nil {
		// A key nobody waited for is reserved too: whoever asks in the
		// delay must wait for its end.
		ks.wq = &waitQueue{byNode: make(map[string]*entry)}
	}
	d := s.newEntry(ks)
	ks.wq.delay = d
	at := t.now.add(s.m.cfg.LockDelay)
	s.leases.set(d, at)
	if s.timerAt == 0 || at < s.timerAt {
		s.arm(at)
	}
}

// endDelay ends ks's lock delay, its entry already out of the heap, and
// hands the key to the first eligible waiter exactly as release would
// have: lock_assigned goes out now, the completion went out at the hold's
// end. A key nobody waits for becomes free, or is forgotten.
func (s *shard) endDelay(t *txn, ks *keyState) {
	d := ks.wq.delay
	ks.wq.delay = nil
	s.recycle(d)
	next := s.promote(t, ks)
	s.logf(t, slog.LevelDebug, "lock delay over", ks.key(), next, ks.lastToken, "")
	if next == "" {
		s.maybeDrop(ks)
	}
}

// promote grants ks to the first waiter that may have it. With server-side
// reference counting a delete or update waiter is checked again: one refused
// now leaves the queue and is told why.
func (s *shard) promote(t *txn, ks *keyState) string {
	for {
		if ks.wq == nil {
			return ""
		}
		e := ks.wq.pop()
		if e == nil {
			return ""
		}
		if s.refs != nil && (ks.typ == lock.Delete || ks.typ == lock.Update) {
			if err := s.refConflict(ks.key()); err != nil {
				node := e.node()
				s.forget(ks, e)
				if t.notify {
					t.items = append(t.items, item{
						ev: &lock.Event{Name: lock.EventOperationCompleted, Key: ks.key(), Node: node, Error: "in_use", CompletedAt: s.m.wall(t.now)},
						to: []string{node},
					})
				}
				continue
			}
		}
		delete(ks.wq.byNode, e.node())
		s.queued--
		s.grant(t, ks, e, true)
		return e.node()
	}
}

// expire is the shard timer's callback: it ends every lease whose deadline
// has passed and re-arms the timer for the next one. A mass of deadlines is
// ended endStep at a time, the mutex released between steps.
func (s *shard) expire() {
	m := s.m
	m.closeMu.RLock()
	defer m.closeMu.RUnlock()
	for more := true; more && !m.closed.Load(); {
		s.mu.Lock()
		t := s.begin()
		s.timerAt = 0
		for n := 0; len(s.leases) > 0 && s.leases[0].at <= t.now && n < endStep; n++ {
			e := s.leases[0]
			s.leases.remove(e)
			ks := e.ks
			if ks.wq != nil && ks.wq.delay == e {
				s.endDelay(&t, ks) // no lease ended: not an expiry
				continue
			}
			s.expiries++
			if ks.holder != e {
				s.logf(&t, slog.LevelInfo, "queue entry expired", ks.key(), e.node(), 0, "lock expired")
				s.dequeue(ks, e)
				continue
			}
			why := "lock expired"
			switch cfg := &m.cfg; {
			case cfg.MaxHold > 0 && e.grantedAt.add(cfg.MaxHold) <= t.now:
				why = "max hold exceeded"
			case ks.unclaimed && e.grantedAt.add(cfg.ClaimTimeout) <= t.now:
				why = "not claimed"
			}
			s.logf(&t, slog.LevelInfo, "hold expired", ks.key(), e.node(), ks.lastToken, why)
			// Only a ttl lease that ran out is delayed: a hand-off not
			// claimed was never started, and max hold is the operator's
			// bound, which a delay would stretch.
			s.release(&t, ks, false, why, false, why == "lock expired")
		}
		more = len(s.leases) > 0 && s.leases[0].at <= t.now
		if !more && len(s.leases) > 0 {
			s.arm(s.leases[0].at)
		}
		_ = s.commit(context.Background(), t)
	}
}

// dropSessions ends what lost sessions held or waited for on keys of this
// shard, endStep entries under the mutex at a time. Every waiter goes
// before any hold is released, so that no hold is handed to a waiter that
// is leaving too. An entry is found through its node (one entry per node
// and key), never by a scan of the queue.
func (s *shard) dropSessions(drops []sessionDrop) {
	for _, holds := range [...]bool{false, true} {
		for i := 0; i < len(drops); i += endStep {
			s.mu.Lock()
			t := s.begin()
			for _, d := range drops[i:min(i+endStep, len(drops))] {
				ks := s.key(d.key)
				switch {
				case ks == nil:
				case !holds:
					if e := ks.waiter(d.sess.node); e != nil && e.sess == d.sess {
						s.dequeue(ks, e)
					}
				case ks.holder != nil && ks.holder.sess == d.sess:
					h := ks.holder
					s.logf(&t, slog.LevelInfo, "session lost", d.key, h.node(), ks.lastToken, "session lost")
					s.release(&t, ks, false, "session lost", false, true)
				}
			}
			_ = s.commit(context.Background(), t)
		}
	}
}

// record retains ks's completion record (docs/DESIGN.md, "Completion records"), dropping the shard's oldest records
// beyond its share of CompletedMax and those past CompletedRetention.
//
// The queue holds one entry per key: a key completed again keeps its place
// and moves to the back only when it reaches the front, so a busy key costs
// no queue work per completion.
func (s *shard) record(ks *keyState, r record) {
	cfg := &s.m.cfg
	if s.m.recordCap == 0 {
		ks.hasRec = false
		return
	}
	if ks.rec == nil {
		ks.rec = new(record)
	}
	ks.hasRec, *ks.rec = true, r
	// A refused waiter may have let maybeDrop forget ks in this transition.
	if s.key(ks.key()) == nil {
		s.addKey(ks)
	}
	q := &s.records
	if !ks.inQueue {
		ks.inQueue = true
		q.push(recordRef{ks: ks, at: r.at})
	}
	for spins := q.len(); q.len() > 0; spins-- {
		old := *q.front()
		if q.len() <= s.m.recordCap && time.Duration(r.at-old.at) < cfg.CompletedRetention {
			break
		}
		q.pop()
		o := old.ks
		if o.hasRec && o.rec.at > old.at && time.Duration(r.at-o.rec.at) < cfg.CompletedRetention && spins > 0 {
			q.push(recordRef{ks: o, at: o.rec.at}) // completed again since: not the oldest
			continue
		}
		o.inQueue = false
		if o.hasRec {
			o.hasRec = false
			s.maybeDrop(o)
		}
	}
}

func (s *shard) eraseRecord(k lock.Key) {
	if ks := s.key(k); ks != nil && ks.hasRec {
		ks.hasRec = false
		s.maybeDrop(ks)
	}
}

// maybeDrop forgets a key that has nothing left to say. A key in its lock
// delay still has: its entry in the heap, and a reservation a node that
// asks must wait for. Its next token still goes forward: the shard keeps
// its last token as a floor (docs/DESIGN.md, "Fencing tokens").
func (s *shard) maybeDrop(ks *keyState) {
	if ks.holder == nil && ks.qlen() == 0 && !ks.hasRec && !ks.delayed() {
		if s.removeKey(ks) {
			s.forgetToken(ks)
		}
	}
}

type recordRef struct {
	ks *keyState // possibly forgotten since: then its record is gone too
	at mono      // when ks's record was written, as far as the queue knows
}

// recordQueue is a FIFO of completion records that reuses its backing array.
type recordQueue struct {
	buf  []recordRef
	head int
}

func (q *recordQueue) len() int          { return len(q.buf) - q.head }
func (q *recordQueue) front() *recordRef { return &q.buf[q.head] }

func (q *recordQueue) push(r recordRef) {
	if q.head > 0 && q.head >= len(q.buf)/2 {
		n := copy(q.buf, q.buf[q.head:])
		clear(q.buf[n:])
		q.buf = q.buf[:n]
		q.head = 0
	}
	q.buf = append(q.buf, r)
}

func (q *recordQueue) pop() {
	q.buf[q.head] = recordRef{}
	q.head++
}

// attach resolves the lease of node's entry e, names e's node, and, for a
// session lease, links e into the node's session so that the session's end
// can find it. Called under the shard mutex (lock order: shard, session
// table, session, grace heap). A session lease that would open a session
// beyond Config.MaxSessions is refused, and e is left as it was.
func (s *shard) attach(e *entry, node string, want lock.Lease) error {
	m := s.m
	if want == lock.LeaseTTL || (want == lock.LeaseAuto && m.sess.n.Load() == 0) {
		s.intern(e, node)
		return nil
	}
	m.sess.mu.Lock()
	ss := m.sess.m[node]
	if ss == nil {
		if want == lock.LeaseAuto {
			m.sess.mu.Unlock()
			s.intern(e, node)
			return nil
		}
		if err := m.sessionRoom(); err != nil {
			m.sess.mu.Unlock()
			return err
		}
		// A session lease asked for without a stream starts the session in
		// grace: a stream must open before it runs out.
		ss = m.newSessionLocked(node)
		ss.startGrace(m)
	}
	ss.mu.Lock()
	ss.link(e)
	if ss.id == (unique.Handle[string]{}) {
		ss.id = unique.Make(ss.node)
	}
	e.sess, e.id = ss, ss.id
	ss.mu.Unlock()
	m.sess.mu.Unlock()
	return nil
}
