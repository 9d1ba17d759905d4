package etcd

import (
	"bytes"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// queues keeps, for each key with waiters, the waiters as the watch saw
// them, each queue with the mod revision of the key's record it is the
// queue of: every change of a key's queue writes the key's record in the
// same transaction, so a queue kept with revision R is the queue etcd had
// at R and at every revision after it until the record changes. A
// transaction that read the record at R (t.recRev) reads its queue here
// instead of in etcd, and its guard of the record's mod revision then
// guards the queue too: a hand-off is its transaction alone
// (docs/DESIGN.md, "One round trip for a warm call").
//
// The watch changes it (apply, and reset after a list), a whole revision
// under one lock, so that a queue is never seen with a revision whose
// changes it has only in part; this server's own commits are written
// through (writeThrough), so that the call after one of them finds the
// queue it left before the watch brings it. A key without waiters has no
// entry: a held lock costs nothing here.
type queues struct {
	kp, qp string // the prefixes of the keys' records and of their queues

	mu sync.RWMutex
	m  map[string]*keptQueue // by the key's "<type>/<res>" as its etcd keys have it
	// watched is the revision the watch has applied every change up to:
	// a commit at or below it is the watch's to apply.
	watched int64
	// touched are the queues the revision being applied changed (apply
	// only; kept between revisions to spare an allocation).
	touched []*keptQueue

	// fromWatch and fromEtcd count the transactions' queue reads served
	// here, or by a read of etcd (dlock_etcd_queue_reads_total).
	fromWatch, fromEtcd atomic.Uint64
}

// keptQueue is one key's waiters, by seq, as of the record at rev. rev is
// -1 for a queue the watch cannot vouch for (a change it could not follow:
// a waiter it never saw made, a queue changed without its record): reads
// go to etcd until the queue empties or the state is listed again. A rev
// above the watch's is a commit of this server written through: the watch
// leaves the queue alone until it passes rev (an emptied queue stays, with
// no waiter, until then, so that a key the watch finds no queue for has
// none at the revision it applies).
type keptQueue struct {
	rev int64
	at  int64 // the revision that last changed ws (apply's touched)
	ws  []seqWait
}

func newQueues(n names) *queues {
	return &queues{kp: n.keys(), qp: n.p + "q/", m: map[string]*keptQueue{}}
}

// recID is the id of the queue of the key whose record is at etcd key key.
func (q *queues) recID(key string) string { return strings.TrimPrefix(key, q.kp) }

// waitOf reads a waiter's etcd key ("P/q/<type>/<res>/<seq>/<node>"): the
// queue's id and the seq. The id is a part of key, not a copy.
func (q *queues) waitOf(key string) (string, uint64, bool) {
	rest, ok := strings.CutPrefix(key, q.qp)
	if !ok {
		return "", 0, false
	}
	i := strings.LastIndexByte(rest, '/')
	if i < 0 {
		return "", 0, false
	}
	j := strings.LastIndexByte(rest[:i], '/')
	if j < 0 {
		return "", 0, false
	}
	seq, err := strconv.ParseUint(rest[j+1:i], 16, 64)
	return rest[:j], seq, err == nil
}

// apply applies one revision's changes (the watch's events, keys[i] the
// key of evs[i], and the key records they changed), under one lock: a
// reader sees the queue of a key either before the revision, with the
// record's revision before, or after it, with rev.
func (q *queues) apply(evs []*clientv3.Event, keys []string, changes []change, rev int64) {
	// The waiters put are decoded before the lock, which the calls' reads
	// of the queues take too.
	var puts []decodedWait
	for i, ev := range evs {
		if ev.Type != mvccpb.DELETE {
			if _, _, ok := q.waitOf(keys[i]); ok {
				if puts == nil {
					puts = make([]decodedWait, len(evs))
				}
				puts[i].ok = jsonUnmarshal(ev.Kv.Value, &puts[i].w) == nil
			}
		}
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	q.watched = max(q.watched, rev)
	// A record left without waiters drops its queue first: the deletes
	// of a success's range delete (one event a waiter, 10,000 of them at
	// worst) then each find no queue, and cost a lookup.
	for i := range changes {
		if c := &changes[i]; c.deleted || c.rec.Queue == 0 {
			q.drop(q.recID(c.key), rev)
		}
	}
	q.touched = q.touched[:0]
	for i, ev := range evs {
		id, seq, ok := q.waitOf(keys[i])
		if !ok {
			continue
		}
		e := q.m[id]
		if e != nil && (e.rev < 0 || e.rev >= rev) {
			continue // not kept right, or written through at rev or later
		}
		if ev.Type == mvccpb.DELETE {
			if e == nil {
				continue
			}
			q.touch(e, rev)
			if !e.remove(seq) {
				e.rev = -1
			}
			continue
		}
		if e == nil {
			e = &keptQueue{}
			q.m[strings.Clone(id)] = e
		}
		q.touch(e, rev)
		if !puts[i].ok {
			e.rev = -1
			continue
		}
		e.put(seqWait{seq, puts[i].w})
	}
	for i := range changes {
		c := &changes[i]
		if c.deleted || c.rec.Queue == 0 {
			q.drop(q.recID(c.key), rev) // a queue put with no waiter counted: not ours
			continue
		}
		id := q.recID(c.key)
		switch e := q.m[id]; {
		case e == nil:
			// Waiters this watch never saw made.
			q.m[strings.Clone(id)] = &keptQueue{rev: -1}
		case e.rev >= rev:
			// Written through as of this revision or a later one.
		case e.rev >= 0 && len(e.ws) == c.rec.Queue:
			e.rev = rev
		default:
			e.rev = -1
		}
	}
	for i, e := range q.touched {
		if e.rev != rev {
			e.rev = -1 // its queue changed, its record did not
		}
		q.touched[i] = nil
	}
}

// decodedWait is a waiter's record as apply decoded it; ok false: not one.
type decodedWait struct {
	w  waitRec
	ok bool
}

// drop forgets the queue of id, left empty at rev, unless it was written
// through at a later revision; q.mu held.
func (q *queues) drop(id string, rev int64) {
	if e := q.m[id]; e != nil && e.rev <= rev {
		delete(q.m, id)
	}
}

// writeThrough applies to the queue of t's key what t, which committed at
// rev, changed in it, so that this server's next call of the key finds
// the queue of the record it finds in the cache (recCache.writeThrough)
// without waiting for the watch. Only when the queue before the commit is
// known: the queue kept is the one of the record t's guard checked, which
// was the record up to rev, or that record counted no waiter. A commit the
// watch has passed is left to it, as the records' cache does.
func (q *queues) writeThrough(t *tx, rev int64) {
	if t.recOp < 0 || (t.readQueue == 0 && t.rec.Queue == 0) {
		return // the queue unchanged; a key without waiters has no entry
	}
	id := t.queueID()
	prefix := []byte(q.qp + id + "/")
	// The changes of the queue, decoded before the lock.
	type qchange struct {
		w     seqWait
		put   bool
		clear bool
	}
	var changes []qchange
	for _, op := range t.ops {
		if !bytes.HasPrefix(op.KeyBytes(), prefix) {
			continue
		}
		if op.IsDelete() && len(op.RangeBytes()) > 0 {
			changes = append(changes, qchange{clear: true}) // a success: the whole queue
			continue
		}
		_, seq, ok := q.waitOf(string(op.KeyBytes()))
		if !ok {
			return
		}
		c := qchange{w: seqWait{seq: seq}, put: op.IsPut()}
		if c.put && jsonUnmarshal(op.ValueBytes(), &c.w.waitRec) != nil {
			return
		}
		changes = append(changes, c)
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if rev <= q.watched {
		return
	}
	e := q.m[id]
	switch {
	case e != nil && e.rev > 0 && e.rev == t.recRev:
	case t.readQueue == 0 && e == nil:
		e = &keptQueue{}
		q.m[strings.Clone(id)] = e
	case t.readQueue == 0 && e.rev < rev:
		clear(e.ws)
		e.ws = e.ws[:0]
	default:
		return // the queue before the commit is not the one kept
	}
	for _, c := range changes {
		switch {
		case c.clear:
			clear(e.ws)
			e.ws = e.ws[:0]
		case c.put:
			e.put(c.w)
		case !e.remove(c.w.seq):
			e.rev = -1
			return
		}
	}
	if len(e.ws) != t.rec.Queue {
		e.rev = -1
		return
	}
	e.rev = rev
}

// touch notes that the revision being applied changes e; q.mu held.
func (q *queues) touch(e *keptQueue, rev int64) {
	if e.at != rev {
		e.at = rev
		q.touched = append(q.touched, e)
	}
}

// put adds or replaces the waiter at w.seq. A new waiter's seq is the
// record's next, above every other, so it is appended.
func (e *keptQueue) put(w seqWait) {
	if n := len(e.ws); n == 0 || e.ws[n-1].seq < w.seq {
		e.ws = append(e.ws, w)
		return
	}
	i, found := e.find(w.seq)
	if found {
		e.ws[i] = w
		return
	}
	e.ws = slices.Insert(e.ws, i, w)
}

// remove takes out the waiter at seq, reporting whether there was one. The
// first waiter, the one a hand-off takes, goes without moving the others.
func (e *keptQueue) remove(seq uint64) bool {
	i, found := e.find(seq)
	switch {
	case !found:
		return false
	case i == 0:
		e.ws[0] = seqWait{} // its node's string is garbage
		e.ws = e.ws[1:]
	default:
		e.ws = slices.Delete(e.ws, i, i+1)
	}
	return true
}

func (e *keptQueue) find(seq uint64) (int, bool) {
	return slices.BinarySearchFunc(e.ws, seq, func(w seqWait, s uint64) int {
		switch {
		case w.seq < s:
			return -1
		case w.seq > s:
			return 1
		}
		return 0
	})
}

// waiter returns the waiter at seq if it is node's.
func (e *keptQueue) waiter(seq uint64, node string) (waitRec, bool) {
	if i, ok := e.find(seq); ok && e.ws[i].Node == node {
		return e.ws[i].waitRec, true
	}
	return waitRec{}, false
}

// of returns the queue of id if it is the queue of the record at rev;
// q.mu held.
func (q *queues) of(id string, rev int64) *keptQueue {
	if e := q.m[id]; e != nil && rev > 0 && e.rev == rev {
		return e
	}
	return nil
}

// served counts a read served here (ok), or left to etcd, and returns ok.
func (q *queues) served(ok bool) bool {
	if ok {
		q.fromWatch.Add(1)
	} else {
		q.fromEtcd.Add(1)
	}
	return ok
}

// head is tx.head served here: up to n waiters (all when n is 0) from the
// front of the queue of id as of the record at rev, leaving out those of
// skip. ok false: the caller reads etcd.
func (q *queues) head(id string, rev int64, n int, skip map[uint64]bool) ([]seqWait, bool) {
	q.mu.RLock()
	defer q.mu.RUnlock()
	e := q.of(id, rev)
	if !q.served(e != nil) {
		return nil, false
	}
	size := len(e.ws)
	if n > 0 {
		size = min(size, n+len(skip))
	}
	out := make([]seqWait, 0, size)
	for _, w := range e.ws {
		if n > 0 && len(out) == n {
			break
		}
		if !skip[w.seq] {
			out = append(out, w)
		}
	}
	return out, true
}

// position is tx.position served here: how many waiters are at seq or
// before it.
func (q *queues) position(id string, rev int64, seq uint64) (int, bool) {
	q.mu.RLock()
	defer q.mu.RUnlock()
	e := q.of(id, rev)
	if !q.served(e != nil) {
		return 0, false
	}
	i, found := e.find(seq)
	if found {
		i++
	}
	return i, true
}

// find is tx.wait served here: the waiter at seq, if it is node's. known
// is false when the queue kept is not the record's at rev: the caller
// reads etcd.
func (q *queues) find(id string, rev int64, seq uint64, node string) (w waitRec, found, known bool) {
	q.mu.RLock()
	defer q.mu.RUnlock()
	e := q.of(id, rev)
	if !q.served(e != nil) {
		return w, false, false
	}
	w, found = e.waiter(seq, node)
	return w, found, true
}

// holds reports whether node waits at seq in the queue of id as kept now,
// true too when the queue kept cannot tell (inspect.go, indexLive).
func (q *queues) holds(id string, seq uint64, node string) bool {
	q.mu.RLock()
	defer q.mu.RUnlock()
	e := q.m[id]
	switch {
	case e == nil:
		return false // no waiter: a key with waiters has an entry
	case e.rev < 0:
		return true
	}
	_, ok := e.waiter(seq, node)
	return ok
}

// stats returns the queue reads served here and by etcd so far.
func (q *queues) stats() (fromWatch, fromEtcd uint64) { return q.fromWatch.Load(), q.fromEtcd.Load() }

// queueList gathers the queues of a list of the state at one revision
// (watcher.list): the records with waiters, then the waiters.
type queueList struct {
	q      *queues
	rev    int64
	counts map[string]int // waiters a record counts, by queue id
	m      map[string]*keptQueue
}

func (q *queues) list(rev int64) *queueList {
	return &queueList{q: q, rev: rev, counts: map[string]int{}, m: map[string]*keptQueue{}}
}

// record notes a key's record at etcd key key, at mod revision mod.
func (l *queueList) record(key string, mod int64, rec *keyRec) {
	if rec.Queue == 0 {
		return
	}
	id := l.q.recID(key)
	l.counts[id] = rec.Queue
	l.m[id] = &keptQueue{rev: mod}
}

// wait adds a waiter, listed in key order: by queue, then seq.
func (l *queueList) wait(kv *mvccpb.KeyValue) {
	id, seq, ok := l.q.waitOf(string(kv.Key))
	if !ok {
		return
	}
	e := l.m[id]
	if e == nil || e.rev < 0 {
		return // no record counts it: no transaction reads it
	}
	var w waitRec
	if jsonUnmarshal(kv.Value, &w) != nil {
		e.rev = -1
		return
	}
	e.put(seqWait{seq, w})
}

// reset replaces every queue with the list's.
func (q *queues) reset(l *queueList) {
	for id, e := range l.m {
		if len(e.ws) != l.counts[id] {
			e.rev = -1
		}
	}
	q.mu.Lock()
	q.m, q.watched = l.m, l.rev
	q.mu.Unlock()
}
