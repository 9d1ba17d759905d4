package etcd

import (
	"strings"
	"sync"
	"sync/atomic"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// recCache is what the watch saw last of the records a call reads by key:
// the keys' records (P/k/), the sessions (P/s/), the queue indexes (P/qn/)
// and the references (P/r/), each with its mod revision. A call's first
// attempt reads them here instead of in etcd, and guards its transaction
// with the revisions it read, as it does a read from etcd: a record that
// changed since makes the transaction fail and the call read etcd again.
// So a warm call is one round trip, its write (docs/DESIGN.md, "An etcd
// backend", "One round trip for a warm call"). The cache never decides
// anything on its own: a stale entry costs a retry, never a wrong answer.
//
// It is filled by the watch's list, kept by every change the watch applies,
// and written through by this server's own commits, so that a call right
// after one of this server finds what that one wrote before the watch
// brings it back.
type recCache struct {
	n names

	mu sync.RWMutex
	m  map[string]cEntry
	// gone holds the marks (cEntry.plain) of keys whose entry a
	// write-through or a delete took out while the watch still had the
	// key plainly held: the watch's view outlives the cache's entry until
	// the watch applies that change itself.
	gone map[string]struct{}
	// queues groups the queue indexes' entries by their key's P/qn/
	// prefix, which a success clears with one prefix delete.
	queues map[string]map[string]struct{}
	rev    int64 // every entry is as of a revision etcd reached, at most this
	live   bool  // a list filled it: entries may be used
	// watched is the revision the watch has applied every change up to:
	// a commit at or below it is the watch's to apply.
	watched int64

	// hits and misses count first attempts served here, or not: atomics,
	// so that counting takes no lock every call would contend on.
	hits, misses atomic.Uint64
}

// cEntry is one record as of its mod revision. modp is that revision and,
// in plainMark, the watch's mark of a key held and nothing more, which the
// watch's table of keys keeps here rather than in a set of its own
// (keytable.go): the mark costs no byte, where a set's slot cost 16 and
// its share of the set's slack (docs/DESIGN.md, "What a server keeps").
// Only the watch sets or clears a mark; the cache's own changes carry it
// over. etcd's revisions stay far below the bit.
type cEntry struct {
	val  cVal
	modp int64
}

const plainMark = int64(1) << 62

// mod is the entry's mod revision.
func (e cEntry) mod() int64 { return e.modp &^ plainMark }

// plain reports whether the watch has the key plainly held.
func (e cEntry) plain() bool { return e.modp&plainMark != 0 }

func newRecCache(n names) *recCache {
	return &recCache{n: n, m: map[string]cEntry{}, gone: map[string]struct{}{}, queues: map[string]map[string]struct{}{}}
}

// holds reports whether key is of a kind the cache keeps.
func (c *recCache) holds(key string) bool {
	if !strings.HasPrefix(key, c.n.p) {
		return false
	}
	rest := key[len(c.n.p):]
	return strings.HasPrefix(rest, "k/") || strings.HasPrefix(rest, "s/") ||
		strings.HasPrefix(rest, "qn/") || strings.HasPrefix(rest, "r/")
}

// view is a read of the cache: the entries asked for and the revision
// they are at most as of. ok is false while the cache is not to be used.
type view struct {
	rev int64
	ok  bool
}

// kv returns key's entry as etcd would (nil when absent), for tx.get.
func (c *recCache) kv(key string) *mvccpb.KeyValue {
	c.mu.RLock()
	e, ok := c.m[key]
	c.mu.RUnlock()
	return e.kv(ok)
}

// kv is the entry as etcd would have it, nil for none (ok false), made
// after the cache's lock is let go: its value is a copy (cVal.bytes). The
// value's Key is left out: a transaction reads only the value and its
// revision.
func (e cEntry) kv(ok bool) *mvccpb.KeyValue {
	if !ok {
		return nil
	}
	return &mvccpb.KeyValue{Value: e.val.bytes(), ModRevision: e.mod()}
}

// first is a call's first read (tx.loadCached), under one read lock: the
// cache's view, the key's record (found false: absent) and the records of
// also, each as kv returns it.
func (c *recCache) first(key string, also []string) (v view, rec cEntry, found bool, kvs map[string]*mvccpb.KeyValue) {
	type entry struct {
		e  cEntry
		ok bool
	}
	var buf [4]entry // a call reads one or two more
	others := buf[:0]
	c.mu.RLock()
	v = view{rev: c.rev, ok: c.live}
	rec, found = c.m[key]
	for _, k := range also {
		e, ok := c.m[k]
		others = append(others, entry{e, ok})
	}
	c.mu.RUnlock()
	kvs = make(map[string]*mvccpb.KeyValue, len(also))
	for i, k := range also {
		kvs[k] = others[i].e.kv(others[i].ok)
	}
	return v, rec, found, kvs
}

// advance notes that the cache has every change up to rev (a progress
// notification of the watch).
func (c *recCache) advance(rev int64) {
	c.mu.Lock()
	c.rev, c.watched = max(c.rev, rev), max(c.watched, rev)
	c.mu.Unlock()
}

// count notes a first attempt served by the cache, or not.
func (c *recCache) count(hit bool) {
	if hit {
		c.hits.Add(1)
	} else {
		c.misses.Add(1)
	}
}

// reset replaces the whole cache with a list made at rev, its entries
// marked as the list's table of keys has them, and gone the marks of keys
// without an entry (nil: none). Used at once: a snapshot of etcd at rev,
// behind by what changed since, which the guards catch.
func (c *recCache) reset(rev int64, m map[string]cEntry, gone map[string]struct{}) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if gone == nil {
		gone = map[string]struct{}{}
	}
	c.m, c.gone, c.rev, c.watched, c.live = m, gone, rev, rev, true
	c.queues = map[string]map[string]struct{}{}
	for key := range m {
		c.group(key, true)
	}
}

// group adds key to, or takes it out of, its queue's group when it is a
// queue index entry; c.mu is held.
func (c *recCache) group(key string, add bool) {
	if !strings.HasPrefix(key, c.n.p+"qn/") {
		return
	}
	q := key[:strings.LastIndexByte(key, '/')+1]
	g := c.queues[q]
	switch {
	case add && g == nil:
		c.queues[q] = map[string]struct{}{key: {}}
	case add:
		g[key] = struct{}{}
	case g != nil:
		delete(g, key)
		if len(g) == 0 {
			delete(c.queues, q)
		}
	}
}

// mayHoldGroup reports whether the queue whose indexes are under prefix
// ("P/qn/<type>/<res>/") may have any: it has some in the cache, or the
// cache is not to be used.
func (c *recCache) mayHoldGroup(prefix string) bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return !c.live || len(c.queues[prefix]) > 0
}

// apply applies one revision's changes, as the watch delivers them, with
// keys[i] the key of evs[i] (the watch's copy, which its own tables keep
// too) and vals[i] its value as the cache keeps it (cacheForm). An entry
// newer than the change (written through already) stays; one of this very
// change, written through, takes the watch's copy of its key, so that the
// cache and the watch keep one copy between them.
func (c *recCache) apply(evs []*clientv3.Event, keys []string, vals []cVal, rev int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, ev := range evs {
		key := keys[i]
		if !c.holds(key) {
			continue
		}
		if ev.Type == mvccpb.DELETE {
			c.del(key, rev)
			continue
		}
		if e, ok := c.m[key]; ok && e.mod() == rev {
			c.m[key] = e // a Go map keeps the key last assigned
			continue
		}
		c.put(key, vals[i], rev)
	}
	c.rev, c.watched = max(c.rev, rev), max(c.watched, rev)
}

// writeThrough applies the operations of this server's transaction that
// committed at rev. A change the watch has already passed is left to it:
// the cache has that revision or a newer one, and an older write applied
// now could bring back a record deleted since. (Two commits of this server
// written through out of order can do that until the watch passes them; a
// guard then fails once.) ops[recOp], if recOp >= 0, is the key record's
// write, recForm its record as the cache keeps it.
func (c *recCache) writeThrough(ops []clientv3.Op, rev int64, recOp int, recForm cVal) {
	// The keys are made strings, and the records as the cache keeps them,
	// before the lock, which every call's first read takes too.
	type change struct {
		key, end string
		val      cVal
		put      bool
	}
	changes := make([]change, 0, len(ops))
	for i, op := range ops {
		ch := change{key: string(op.KeyBytes()), end: string(op.RangeBytes()), put: op.IsPut()}
		if (ch.put || op.IsDelete()) && c.holds(ch.key) {
			switch {
			case i == recOp:
				ch.val = recForm
			case ch.put:
				ch.val = c.cacheForm(ch.key, op.ValueBytes())
			}
			changes = append(changes, ch)
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if rev <= c.watched {
		return
	}
	for _, ch := range changes {
		switch {
		case ch.put:
			c.put(ch.key, ch.val, rev)
		case ch.end != "":
			c.delRange(ch.key, ch.end, rev)
		default:
			c.del(ch.key, rev)
		}
	}
	c.rev = max(c.rev, rev)
}

// cacheForm is val, the value of key in etcd, as the cache keeps it: a
// key's record compact (cacherec.go), anything else as it is.
func (c *recCache) cacheForm(key string, val []byte) cVal {
	if strings.HasPrefix(key, c.n.p) && strings.HasPrefix(key[len(c.n.p):], "k/") {
		return compactRec(val)
	}
	return cVal{b: string(val)}
}

// put, del and delRange change entries older than rev, put with val as the
// cache keeps it (cacheForm), each keeping the key's mark; c.mu is held.
func (c *recCache) put(key string, val cVal, rev int64) {
	e, ok := c.m[key]
	if ok && e.mod() >= rev {
		return
	}
	mark := e.modp & plainMark
	if !ok {
		c.group(key, true)
		if _, g := c.gone[key]; g {
			delete(c.gone, key)
			mark = plainMark
		}
	}
	c.m[key] = cEntry{val: val, modp: rev | mark}
}

func (c *recCache) del(key string, rev int64) {
	if e, ok := c.m[key]; ok && e.mod() <= rev {
		c.remove(key, e)
	}
}

// remove takes out key's entry e, keeping its mark in gone; c.mu is held.
func (c *recCache) remove(key string, e cEntry) {
	delete(c.m, key)
	c.group(key, false)
	if e.plain() {
		c.gone[key] = struct{}{}
	}
}

// delRange deletes the entries of a prefix delete, [from, end). The one
// such delete of a cached kind is a success clearing a queue's index
// (tx.end): its group is visited, not the whole cache.
func (c *recCache) delRange(from, end string, rev int64) {
	if !c.holds(from) {
		return
	}
	if end != clientv3.GetPrefixRangeEnd(from) || !strings.HasSuffix(from, "/") {
		// Not a whole queue: no transaction writes one; forget what the
		// range may hold rather than keep it wrong.
		for key, e := range c.m {
			if key >= from && key < end && e.mod() <= rev {
				c.remove(key, e)
			}
		}
		return
	}
	for key := range c.queues[from] {
		if e := c.m[key]; e.mod() <= rev {
			c.remove(key, e)
		}
	}
}

// mark sets (on) or clears key's mark, whether key has an entry or not,
// and reports whether it was set: the watch's table of keys (keytable.go)
// and nothing else calls it.
func (c *recCache) mark(key string, on bool) (was bool) {
	c.mu.RLock()
	was = c.markedLocked(key)
	c.mu.RUnlock()
	if was == on {
		return was // most calls change nothing: the read lock only
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	was = c.markedLocked(key)
	e, ok := c.m[key]
	switch {
	case ok && on:
		e.modp |= plainMark
		c.m[key] = e
	case ok:
		e.modp &^= plainMark
		c.m[key] = e
	case on:
		c.gone[key] = struct{}{}
	}
	if !on {
		delete(c.gone, key)
	}
	return was
}

// marked reports whether key is marked.
func (c *recCache) marked(key string) bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.markedLocked(key)
}

func (c *recCache) markedLocked(key string) bool {
	if e, ok := c.m[key]; ok {
		return e.plain()
	}
	_, ok := c.gone[key]
	return ok
}

// appendMarked appends the marked keys to dst.
func (c *recCache) appendMarked(dst []string) []string {
	c.mu.RLock()
	defer c.mu.RUnlock()
	for key, e := range c.m {
		if e.plain() {
			dst = append(dst, key)
		}
	}
	for key := range c.gone {
		dst = append(dst, key)
	}
	return dst
}

// stats returns the hits and misses so far.
func (c *recCache) stats() (hits, misses uint64) { return c.hits.Load(), c.misses.Load() }
