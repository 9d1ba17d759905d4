package etcd

import (
	"container/heap"
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/lock"
)

// An event's id is its revision × idsPerRev, plus idsPerChange × the place
// of its change among the revision's changes that make events (in the order
// etcd reports them, the same on every server), plus its index among the
// events of that change (0 lock_assigned, 1 operation_completed, 2 on
// refusals). Every server derives the same events from the same revision,
// so an id means the same event on every server and a stream resumes
// anywhere (docs/DESIGN.md, "An etcd backend"). A revision has more than one
// such change when transactions of several keys share a request (group.go).
//
// The ids begin at idBase, above every id of the numbering before grouped
// requests (revision × 8 + index, one transition a revision): ids increase
// on a stream across an upgrade, and an old id is translated (normID) to
// the id its event has now.
const (
	idsPerChange = 8
	idsPerRev    = 32 * idsPerChange
	idBase       = 1 << 62
	oldPerRev    = 8
)

// revID is the first id of rev's events.
func revID(rev int64) uint64 { return idBase + uint64(rev)*idsPerRev }

// normID is id in this numbering: an id of the one before is its revision's
// first transition's (the only one it had), at the same index.
func normID(id uint64) uint64 {
	if id >= idBase {
		return id
	}
	return revID(int64(id/oldPerRev)) + id%oldPerRev
}

// idRev is the revision of an id of this numbering.
func idRev(id uint64) int64 {
	if id < idBase {
		return 0
	}
	return int64((id - idBase) / idsPerRev)
}

// watcher follows every change of the data set with one watch: it keeps
// the counts and deadlines of the keys, the sessions and their replay logs,
// and hands each change's events to the streams of this server.
type watcher struct {
	b *Backend

	mu        sync.Mutex
	advanced  chan struct{} // closed and replaced when processed moves
	processed int64         // every change up to this revision is applied
	floor     int64         // the revision the watch began after

	// The warm-up: changes up to warmTo (the first list) only fill the
	// replay logs; warm once the watch has passed it.
	warmFrom, warmTo int64
	warm             bool
	watchCtx         context.Context

	keys              keyTable // by key: a set for the plainly held (keytable.go)
	nKeys, nHeld, nQd int
	deadlines         deadlineHeap
	nDone             int          // keys with a completion record
	dones             deadlineHeap // the records by their time: the oldest go first past CompletedMax
	wake              chan struct{}

	sessions map[string]*sessInfo

	streams   map[string][]*feed // a node's session streams on this server
	observers map[lock.Key][]*feed
	nWatchers int

	asked atomic.Int64 // when caughtUp last asked for progress (unix ns)
}

// keyInfo is what the timers and counts need of a key, 24 bytes (none for
// a key held and nothing more, keytable.go): its record is in the cache
// (cache.go).
type keyInfo struct {
	deadline   int64
	doneAt     int64 // the completion record's time, 0 for none
	queue      int32 // at most lock.Rules.MaxQueue
	held, kept bool
}

// sessInfo is a session as the watch saw it, with its replay log.
type sessInfo struct {
	lease   int64
	home    int64 // the home lease its record lives on, 0 once its own is granted
	modRev  int64 // its record's
	created int64
	log     lock.ReplayLog
	dropped uint64 // the id of the newest event the log let go
}

// session is node's session record as the watch saw it (zero for none),
// with its mod revision, and the revision the watch had processed.
func (w *watcher) session(node string) (rec sessRec, modRev, processed int64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if si := w.sessions[node]; si != nil {
		rec, modRev = sessRec{Lease: si.lease, Home: si.home}, si.modRev
	}
	return rec, modRev, w.processed
}

func newWatcher(b *Backend) *watcher {
	return &watcher{
		b:         b,
		advanced:  make(chan struct{}),
		keys:      newKeyTable(b.n, b.rc),
		wake:      make(chan struct{}, 1),
		sessions:  map[string]*sessInfo{},
		streams:   map[string][]*feed{},
		observers: map[lock.Key][]*feed{},
	}
}

// start reads the keys and sessions, then follows every change after them.
func (w *watcher) start(ctx context.Context) error {
	rev, err := w.list(ctx)
	if err != nil {
		return err
	}
	// The replay logs begin with the history before the list, so that a
	// node that moves here from another server resumes from an event this
	// server did not see live (up to warmRevisions back, or etcd's
	// compaction). The watch begins there; until it has passed the list's
	// revision, it only fills the logs (applyLog).
	from := max(1, rev-warmRevisions+1)
	w.mu.Lock()
	w.warmTo, w.warmFrom = rev, from
	w.mu.Unlock()
	w.b.wg.Add(1)
	go w.follow(from - 1)
	w.waitWarm(ctx)
	return nil
}

// warmRevisions is how far back in etcd's history a starting server reads
// its sessions' replay logs.
const warmRevisions = 100000

// waitWarm waits, at most 10 s, until the watch has read the history up to
// the list. After that, a replay from before what was read is Missed.
func (w *watcher) waitWarm(ctx context.Context) {
	t := time.NewTimer(10 * time.Second)
	defer t.Stop()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		w.mu.Lock()
		warm := w.warm
		w.mu.Unlock()
		if warm {
			return
		}
		select {
		case <-tick.C:
			// A watch reports its progress only once it has caught up:
			// ask until it has.
			_ = w.b.cli.RequestProgress(w.wctx())
		case <-t.C:
			w.b.log.Warn("etcd backend: the history of the replay logs took over 10 s to read; replays from before this server started are Missed")
			w.setWarm(0)
			return
		case <-ctx.Done():
			w.setWarm(0)
			return
		}
	}
}

// setWarm ends the warm-up: the logs hold what the watch read up to rev
// of the history.
func (w *watcher) setWarm(rev int64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.warm {
		return
	}
	w.warm = true
	if rev < w.warmTo {
		// Not read up to the list: no session can replay from before it.
		for _, s := range w.sessions {
			s.log.Reset()
			s.dropped = max(s.dropped, revID(w.warmTo+1)-1)
		}
	}
}

// list reads the state as of one revision.
func (w *watcher) list(ctx context.Context) (int64, error) {
	b := w.b
	w.mu.Lock()
	first := w.processed == 0
	w.mu.Unlock()
	resp, err := b.cli.Get(ctx, b.n.epoch())
	if err != nil {
		return 0, b.etcdErr("listing", err)
	}
	rev := resp.Header.Revision
	// The list's table marks the entries of a cache of its own, which
	// replaces the server's whole, its marks with it (reset).
	fresh := newRecCache(b.n)
	cached := fresh.m
	keys := newKeyTable(b.n, fresh)
	var nKeys, nHeld, nQd, nDone int
	var dl, dones deadlineHeap
	queues := b.qs.list(rev)
	keep := func(kv *mvccpb.KeyValue) {
		cached[string(kv.Key)] = cEntry{val: cVal{b: string(kv.Value)}, modp: kv.ModRevision}
	}
	// Each key's queue indexes: more than its record counts waiters
	// (queues.counts) are stale ones a success left, which a sweep
	// deletes (indexes.go).
	indexes := map[string]int{}
	err = w.page(ctx, b.n.keys(), rev, func(kv *mvccpb.KeyValue) {
		// One copy of the key for the cache and the timers' table, and
		// the record as the cache keeps it (cacherec.go).
		key := string(kv.Key)
		r, err := decodeKey(kv.Value)
		cached[key] = cEntry{val: compactOf(kv.Value, &r, err), modp: kv.ModRevision}
		k, ok := b.n.parseKey(key)
		if !ok || err != nil {
			return
		}
		queues.record(key, kv.ModRevision, &r)
		ki := info(&r, b.cfg.CompletedRetention)
		keys.set(k, key, ki)
		nKeys, nHeld, nQd = nKeys+b2i(ki.kept), nHeld+b2i(ki.held), nQd+int(ki.queue)
		if ki.deadline != 0 {
			dl = append(dl, deadline{at: ki.deadline, k: k})
		}
		if ki.doneAt != 0 {
			dones = append(dones, deadline{at: ki.doneAt, k: k})
			nDone++
		}
	})
	if err != nil {
		return 0, err
	}
	sessions := map[string]*sessInfo{}
	err = w.page(ctx, b.n.sessions(), rev, func(kv *mvccpb.KeyValue) {
		keep(kv)
		node, ok := b.n.parseNode(string(kv.Key))
		if !ok {
			return
		}
		s, err := decodeSess(kv.Value)
		if err != nil {
			return
		}
		sessions[node] = &sessInfo{lease: s.Lease, home: s.Home, modRev: kv.ModRevision, created: kv.CreateRevision, dropped: revID(rev+1) - 1}
		if first {
			// The warm-up reads the history from warmFrom (start).
			sessions[node].dropped = revID(max(kv.CreateRevision, rev-warmRevisions+1)) - 1
		}
	})
	if err != nil {
		return 0, err
	}
	err = w.page(ctx, b.n.p+"qn/", rev, func(kv *mvccpb.KeyValue) {
		keep(kv)
		if id, ok := b.n.indexID(string(kv.Key)); ok {
			indexes[id]++
		}
	})
	if err != nil {
		return 0, err
	}
	if err := w.page(ctx, b.n.refs(), rev, keep); err != nil {
		return 0, err
	}
	if err := w.page(ctx, b.n.p+"q/", rev, queues.wait); err != nil {
		return 0, err
	}
	b.qs.reset(queues)
	b.ix.scheduleStale(indexes, queues.counts)
	heap.Init(&dl)
	heap.Init(&dones)
	w.mu.Lock()
	// The cache takes the list's marks and the watch its table in one
	// step for whoever reads the table under w.mu (the viewer).
	b.rc.reset(rev, cached, fresh.gone)
	keys.c = b.rc
	w.keys, w.nKeys, w.nHeld, w.nQd, w.deadlines = keys, nKeys, nHeld, nQd, dl
	w.nDone, w.dones = nDone, dones
	var moved []movedSession
	for node, s := range sessions {
		if old := w.sessions[node]; old != nil && old.lease == s.lease {
			// A relist keeps the logs of sessions that go on.
			if s.home != old.home {
				moved = append(moved, movedSession{node, sessRec{Lease: s.lease, Home: s.home}, s.modRev})
			}
			old.home, old.modRev = s.home, s.modRev
			continue
		}
		w.sessions[node] = s
	}
	for node := range w.sessions {
		if sessions[node] == nil {
			delete(w.sessions, node)
		}
	}
	w.floor = max(w.floor, rev)
	w.setProcessed(rev)
	w.mu.Unlock()
	for _, m := range moved {
		b.s.moved(m.node, m.rec, m.modRev)
	}
	w.poke()
	return rev, nil
}

func b2i(v bool) int {
	if v {
		return 1
	}
	return 0
}

func info(r *keyRec, retention time.Duration) keyInfo {
	ki := keyInfo{held: r.held(), kept: r.held() || r.Queue > 0 || r.Done != nil || r.delayed(), queue: int32(r.Queue), deadline: r.deadline(retention)}
	if r.Done != nil {
		ki.doneAt = r.Done.At
	}
	return ki
}

// page reads every record under prefix at rev, a thousand at a time.
func (w *watcher) page(ctx context.Context, prefix string, rev int64, fn func(*mvccpb.KeyValue)) error {
	end := clientv3.GetPrefixRangeEnd(prefix)
	from := prefix
	for {
		resp, err := w.b.cli.Get(ctx, from, clientv3.WithRange(end), clientv3.WithRev(rev), clientv3.WithLimit(1000), clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend))
		if err != nil {
			return w.b.etcdErr("listing", err)
		}
		for _, kv := range resp.Kvs {
			fn(kv)
		}
		if !resp.More || len(resp.Kvs) == 0 {
			return nil
		}
		from = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
}

// follow applies every change after rev until the backend closes. A watch
// that ends (etcd out of reach, its member without a leader) is opened
// again from the next revision; one that was compacted past has lost
// changes, so the state is listed again and the replay logs start anew
// from that list: this server's session streams are closed, and their
// reconnects are told Missed (docs/DESIGN.md, "An etcd backend").
func (w *watcher) follow(rev int64) {
	defer w.b.wg.Done()
	b := w.b
	for b.ctx.Err() == nil {
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(b.ctx))
		w.mu.Lock()
		w.watchCtx = wctx
		w.mu.Unlock()
		// No previous values: the waiters a success removed are named
		// by their keys, and etcd would read a previous value for each.
		ch := b.cli.Watch(wctx, b.n.p, clientv3.WithPrefix(), clientv3.WithRev(rev+1))
		var compacted bool
		rev, compacted = w.consume(ch, rev)
		cancel()
		if !compacted {
			select {
			case <-b.ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
			continue
		}
		for b.ctx.Err() == nil {
			lctx, lcancel := context.WithTimeout(b.ctx, 10*time.Second)
			r, err := w.list(lctx)
			lcancel()
			if err == nil {
				rev = r
				w.lost()
				// A warm-up cut short by it is over: the logs begin
				// at the list (lost), and a watch from the list's
				// revision, which etcd may not pass for a while, hears
				// of no progress before then.
				w.setWarm(r)
				break
			}
			b.log.Warn("etcd backend: listing the lock state after a compacted watch", "err", err)
			select {
			case <-b.ctx.Done():
			case <-time.After(time.Second):
			}
		}
	}
}

func (w *watcher) wctx() context.Context {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.watchCtx == nil {
		return w.b.ctx
	}
	return w.watchCtx
}

// lost drops what the replay logs hold and ends this server's streams,
// after changes went by unseen.
func (w *watcher) lost() {
	w.mu.Lock()
	floor := revID(w.processed+1) - 1
	for _, s := range w.sessions {
		s.log.Reset()
		s.dropped = max(s.dropped, floor)
	}
	w.mu.Unlock()
	w.endStreams()
	w.b.vw.relisted()
}

// endStreams ends every stream of this server and returns how many.
func (w *watcher) endStreams() int {
	w.mu.Lock()
	var all []*feed
	for _, l := range w.streams {
		all = append(all, l...)
	}
	for _, l := range w.observers {
		all = append(all, l...)
	}
	for _, f := range all {
		w.dropLocked(f)
	}
	w.mu.Unlock()
	for _, f := range all {
		f.End()
		w.b.s.release(f)
	}
	return len(all)
}

// consume applies the watch's changes, a revision at a time, until the
// watch ends, and returns the last revision applied and whether the watch
// was compacted past.
func (w *watcher) consume(ch clientv3.WatchChan, rev int64) (int64, bool) {
	for resp := range ch {
		if resp.Err() == nil {
			// etcd is there and applying (health).
			w.b.keeper.heardAt(time.Now())
		}
		if resp.CompactRevision > 0 {
			// Only the history the list already holds (up to warmTo)
			// may be passed over. A compaction past it took changes
			// made after the list, which the watch must not go on
			// without: the queues it keeps would take a later record
			// for the queue of one it missed (queues.go), and their
			// events would go untold (TestAttackWarmupCompactedPastList).
			w.mu.Lock()
			warming := !w.warm && rev < w.warmTo && resp.CompactRevision <= w.warmTo+1
			w.mu.Unlock()
			if warming {
				// The history to warm the logs with begins later: read
				// from there; sessions replay from there at most.
				from := resp.CompactRevision
				w.mu.Lock()
				for _, s := range w.sessions {
					s.dropped = max(s.dropped, revID(from)-1)
				}
				w.mu.Unlock()
				return from - 1, false
			}
			w.b.log.Warn("etcd backend: the watch was compacted past", "revision", resp.CompactRevision)
			return rev, true
		}
		if err := resp.Err(); err != nil {
			w.b.log.Warn("etcd backend: the watch ended", "err", err)
			return rev, false
		}
		evs := resp.Events
		for len(evs) > 0 {
			r := evs[0].Kv.ModRevision
			n := 1
			for n < len(evs) && evs[n].Kv.ModRevision == r {
				n++
			}
			w.apply(evs[:n], r)
			rev = r
			evs = evs[n:]
		}
		if resp.IsProgressNotify() {
			if resp.Header.Revision >= w.warmTo {
				w.setWarm(resp.Header.Revision)
			}
			if resp.Header.Revision > rev {
				rev = resp.Header.Revision
				w.b.rc.advance(rev)
				w.mu.Lock()
				w.setProcessed(rev)
				w.mu.Unlock()
			}
		}
	}
	return rev, false
}

// setProcessed moves processed on and wakes who waits for it; w.mu held.
func (w *watcher) setProcessed(rev int64) {
	if rev > w.processed {
		w.processed = rev
		close(w.advanced)
		w.advanced = make(chan struct{})
	}
}

// caughtUp waits, at most d, until the watch has applied rev.
//
// The watch hears only of the data set's prefix, so a revision that etcd
// reached through changes outside it (another data set on the same etcd,
// another user of it, leases of those expiring) is reached only through a
// progress notification: while it waits, caughtUp asks etcd for one every
// progressEvery, which etcd sends once the watch has caught up. Without
// it, a wait for etcd's current revision (a stream opening, with the
// revision of its session's read) lasted until the next change in the
// data set.
func (w *watcher) caughtUp(rev int64, d time.Duration) bool {
	var timeout, ask <-chan time.Time
	for {
		w.mu.Lock()
		ok, ch := w.processed >= rev, w.advanced
		w.mu.Unlock()
		if ok {
			return true
		}
		if timeout == nil {
			t := time.NewTimer(d)
			defer t.Stop()
			timeout = t.C
			// A change of the data set is usually on its way (this
			// server's own commit): ask only if none came soon.
			tick := time.NewTicker(progressEvery)
			defer tick.Stop()
			ask = tick.C
		}
		select {
		case <-ch:
		case <-ask:
			// One request serves every waiter: thousands of streams
			// that open together do not each ask.
			now, last := time.Now().UnixNano(), w.asked.Load()
			if now-last >= int64(progressEvery) && w.asked.CompareAndSwap(last, now) {
				_ = w.b.cli.RequestProgress(w.wctx())
			}
		case <-timeout:
			return false
		case <-w.b.ctx.Done():
			return false
		}
	}
}

// progressEvery is how often caughtUp asks etcd for a progress
// notification while it waits.
const progressEvery = 50 * time.Millisecond

// change is one key's record as a revision left it.
type change struct {
	k       lock.Key
	key     string // the record's etcd key
	rec     keyRec
	deleted bool
}

// apply applies the changes of one revision and delivers their events.
func (w *watcher) apply(evs []*clientv3.Event, rev int64) {
	b := w.b
	if rev <= w.warmTo {
		w.applyLog(evs, rev)
		return
	}
	w.setWarm(rev)
	// Each key made a string once: the cache and the watch's tables keep
	// the same copy. Each key record is read once, before the cache's
	// lock and the watch's, for the watch's changes and as the cache
	// keeps it (vals).
	keys := make([]string, len(evs))
	vals := make([]cVal, len(evs))
	var changes []change
	for i, ev := range evs {
		key := string(ev.Kv.Key)
		keys[i] = key
		if !strings.HasPrefix(key, b.n.keys()) {
			if ev.Type == mvccpb.PUT && b.rc.holds(key) {
				vals[i] = cVal{b: string(ev.Kv.Value)}
			}
			continue
		}
		c := change{key: key, deleted: ev.Type == mvccpb.DELETE}
		var err error
		if !c.deleted {
			c.rec, err = decodeKey(ev.Kv.Value)
			vals[i] = compactOf(ev.Kv.Value, &c.rec, err)
		}
		var ok bool
		if c.k, ok = b.n.parseKey(key); ok && err == nil {
			changes = append(changes, c)
		}
	}
	// The queues before the records: a call that finds a record of this
	// revision in the cache finds its queue too.
	b.qs.apply(evs, keys, changes, rev)
	b.rc.apply(evs, keys, vals, rev)
	var (
		skipped map[lock.Key][]string
		ended   []endedSession
		moved   []movedSession // sessions given their own lease, or another home lease
	)
	w.mu.Lock()
	for i, ev := range evs {
		key := keys[i]
		switch {
		case strings.HasPrefix(key, b.n.p+"q/"):
			if ev.Type != mvccpb.DELETE {
				continue
			}
			k, node, ok := b.n.parseWait(key)
			if !ok {
				continue
			}
			if skipped == nil {
				skipped = map[lock.Key][]string{}
			}
			skipped[k] = append(skipped[k], node)
		case strings.HasPrefix(key, b.n.sessions()):
			node, ok := b.n.parseNode(key)
			if !ok {
				continue
			}
			if ev.Type == mvccpb.DELETE {
				if s := w.sessions[node]; s != nil {
					delete(w.sessions, node)
					ended = append(ended, endedSession{node, s.lease})
				}
				continue
			}
			sr, err := decodeSess(ev.Kv.Value)
			if err != nil {
				continue
			}
			if s := w.sessions[node]; s != nil && s.lease == sr.Lease {
				// The same session, put again: its own lease granted,
				// or moved onto another server's home lease.
				if sr.Home != s.home {
					moved = append(moved, movedSession{node, sr, ev.Kv.ModRevision})
				}
				s.home, s.modRev = sr.Home, ev.Kv.ModRevision
				continue
			}
			// A session begins: its log starts before this revision's
			// events, which it receives.
			w.sessions[node] = &sessInfo{lease: sr.Lease, home: sr.Home, modRev: ev.Kv.ModRevision, created: rev, dropped: revID(rev) - 1}
		}
	}
	var released []*feed
	base := revID(rev)
	for _, c := range changes {
		w.track(c)
		if !c.deleted && c.rec.X != nil {
			released = append(released, w.deliver(c, base, rev, skipped[c.k])...)
			base += idsPerChange
			if c.rec.X.Left {
				b.ix.schedule(c.k, b.ix.later())
			}
		}
	}
	// A session that ended closes its streams here: the node reconnects
	// and learns from Missed that its holds are gone.
	for _, e := range ended {
		for _, f := range w.streams[e.node] {
			w.dropLocked(f)
			f.End()
			released = append(released, f)
		}
	}
	b.vw.revision(evs, rev)
	w.setProcessed(rev)
	w.mu.Unlock()
	for _, m := range moved {
		b.s.moved(m.node, m.rec, m.modRev)
	}
	for _, e := range ended {
		b.s.ended(e.node, e.lease)
	}
	for _, f := range released {
		b.s.release(f)
	}
	for _, e := range ended {
		b.sessionEnded(e.node, e.lease)
	}
	w.poke()
}

// applyLog adds the events of one revision of the history before the
// first list to the replay logs of the sessions that existed then; the
// list has the state itself.
func (w *watcher) applyLog(evs []*clientv3.Event, rev int64) {
	b := w.b
	var changes []change
	skipped := map[lock.Key][]string{}
	for _, ev := range evs {
		key := string(ev.Kv.Key)
		switch {
		case strings.HasPrefix(key, b.n.keys()) && ev.Type != mvccpb.DELETE:
			k, ok := b.n.parseKey(key)
			if !ok {
				continue
			}
			r, err := decodeKey(ev.Kv.Value)
			if err != nil || r.X == nil {
				continue
			}
			changes = append(changes, change{k: k, rec: r})
		case strings.HasPrefix(key, b.n.p+"q/") && ev.Type == mvccpb.DELETE:
			if k, node, ok := b.n.parseWait(key); ok {
				skipped[k] = append(skipped[k], node)
			}
		}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for i, c := range changes {
		w.deliverTo(c, revID(rev)+uint64(i)*idsPerChange, rev, skipped[c.k], true)
	}
}

// endedSession is a session the watch saw end.
type endedSession struct {
	node  string
	lease int64
}

// movedSession is a session whose record the watch saw put again at modRev
// on another lease: its own, or another server's home lease.
type movedSession struct {
	node   string
	rec    sessRec
	modRev int64
}

// track updates the counts and deadlines for a key's new record; w.mu held.
func (w *watcher) track(c change) {
	var old, ki keyInfo
	if c.deleted {
		old, _ = w.keys.del(c.k, c.key)
	} else {
		ki = info(&c.rec, w.b.cfg.CompletedRetention)
		old, _ = w.keys.set(c.k, c.key, ki)
	}
	w.nKeys += b2i(ki.kept) - b2i(old.kept)
	w.nHeld += b2i(ki.held) - b2i(old.held)
	w.nQd += int(ki.queue) - int(old.queue)
	w.nDone += b2i(ki.doneAt != 0) - b2i(old.doneAt != 0)
	if ki.doneAt != 0 && ki.doneAt != old.doneAt {
		heap.Push(&w.dones, deadline{at: ki.doneAt, k: c.k})
	}
	if c.deleted {
		return
	}
	// A key that completes again and again leaves one stale entry a time,
	// which oldestPastCap drops only past the cap.
	if len(w.dones) > 2*w.nDone+1024 {
		w.compactDones()
	}
	if ki.deadline != 0 && ki.deadline != old.deadline {
		heap.Push(&w.deadlines, deadline{at: ki.deadline, k: c.k})
		if len(w.deadlines) > 2*w.keys.len()+1024 {
			w.compactDeadlines()
		}
	}
}

// deliver hands the events of one key's change, made at rev, to this
// server's streams and to the replay logs of the sessions they are for; its
// events' ids begin at base; w.mu held. It returns the streams it closed
// for not keeping up.
func (w *watcher) deliver(c change, base uint64, rev int64, skipped []string) []*feed {
	return w.deliverTo(c, base, rev, skipped, false)
}

// deliverTo is deliver; with history, it only adds to the logs of the
// sessions that existed at rev (the warm-up).
func (w *watcher) deliverTo(c change, base uint64, rev int64, skipped []string, history bool) []*feed {
	x := c.rec.X
	var released []*feed
	send := func(id uint64, ev *lock.Event, to []string, observers bool) {
		d := lock.Delivery{ID: id, Event: ev}
		var sent map[string]bool
		if observers && len(to) > 0 {
			sent = make(map[string]bool, len(to))
		}
		for _, node := range to {
			s := w.sessions[node]
			if s == nil || s.created > rev {
				continue // events go only to sessions that exist
			}
			if history {
				if d.ID > s.dropped {
					w.logEvent(s, node, d)
				}
				continue
			}
			w.logEvent(s, node, d)
			for _, f := range w.streams[node] {
				if !f.push(d) {
					w.dropLocked(f)
					released = append(released, f)
				}
			}
			if sent != nil {
				sent[node] = true
			}
		}
		if !observers || history {
			return
		}
		for _, f := range w.observers[c.k] {
			if f.node != "" && sent[f.node] {
				continue // a session that observes too gets the event once
			}
			if !f.push(d) {
				w.dropLocked(f)
				released = append(released, f)
			}
		}
	}
	if x.Assigned != "" {
		ev := &lock.Event{Name: lock.EventLockAssigned, Key: c.k, Node: x.Assigned, Token: c.rec.Token}
		send(base, ev, []string{x.Assigned}, true)
	}
	if d := x.Done; d != nil {
		ev := &lock.Event{Name: lock.EventOperationCompleted, Key: c.k, Node: d.Node, Success: d.OK, Error: d.Err, CompletedAt: time.Unix(0, d.At), NextHolder: d.Next}
		var to []string
		if x.Skip {
			to = skipped
		}
		send(base+1, ev, to, true)
	}
	for i, node := range x.Refused {
		at := time.Unix(0, x.At)
		ev := &lock.Event{Name: lock.EventOperationCompleted, Key: c.k, Node: node, Error: "in_use", CompletedAt: at}
		send(base+2+uint64(i), ev, []string{node}, false)
	}
	return released
}

// logEvent appends d to the replay log of node's session s within the
// log's bounds (docs/DESIGN.md, "An etcd backend", "What a server keeps");
// w.mu held.
func (w *watcher) logEvent(s *sessInfo, node string, d lock.Delivery) {
	if dropped := s.log.Append(node, d, w.b.cfg.SessionLog, w.b.cfg.SessionLogBytes); dropped > 0 {
		s.dropped = dropped
	}
}

// stats returns the cluster's gauges as the watch saw them.
func (w *watcher) stats() lock.Stats {
	w.mu.Lock()
	defer w.mu.Unlock()
	return lock.Stats{Keys: w.nKeys, Held: w.nHeld, Queued: w.nQd, Sessions: len(w.sessions)}
}

// nearLimit is how close to a cluster-wide limit a count must be before a
// check waits for the watch to see this server's own last write: far from
// it, the count it has is good enough, and the call does not wait.
const nearLimit = 1024

func (w *watcher) keyCount(limit int) int {
	return w.count(limit, func() int { return w.nKeys })
}

func (w *watcher) sessionCount(limit int) int {
	return w.count(limit, func() int { return len(w.sessions) })
}

// count reads a cluster-wide count (under w.mu), again after the watch has
// seen this server's last write when it is within nearLimit of limit.
func (w *watcher) count(limit int, read func() int) int {
	w.mu.Lock()
	n := read()
	w.mu.Unlock()
	if n+nearLimit < limit {
		return n
	}
	w.caughtUp(w.b.lastCommit.Load(), time.Second)
	w.mu.Lock()
	defer w.mu.Unlock()
	return read()
}

// roomForSession refuses a session beyond Config.MaxSessions, counted in
// the whole cluster as this server's watch has seen it.
func (b *Backend) roomForSession() error {
	if b.cfg.MaxSessions > 0 {
		if n := b.w.sessionCount(b.cfg.MaxSessions); n >= b.cfg.MaxSessions {
			b.refusedSessions.Add(1)
			return fmt.Errorf("%w: %d sessions, at most %d are allowed", lock.ErrTooManySessions, n, b.cfg.MaxSessions)
		}
	}
	return nil
}

// poke wakes the timers after the deadlines changed.
func (w *watcher) poke() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// next returns the earliest deadline and its key.
func (w *watcher) next() (lock.Key, int64, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for w.deadlines.Len() > 0 {
		d := w.deadlines[0]
		if ki, ok := w.keys.timed(d.k); !ok || ki.deadline != d.at {
			heap.Pop(&w.deadlines) // stale
			continue
		}
		return d.k, d.at, true
	}
	return lock.Key{}, 0, false
}

// oldestPastCap returns the oldest completion record while more than
// Config.CompletedMax are kept in the cluster.
func (w *watcher) oldestPastCap() (lock.Key, int64, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.nDone <= w.b.cfg.CompletedMax {
		return lock.Key{}, 0, false
	}
	for w.dones.Len() > 0 {
		d := w.dones[0]
		if ki, ok := w.keys.timed(d.k); ok && ki.doneAt == d.at {
			return d.k, d.at, true
		}
		heap.Pop(&w.dones) // stale
	}
	return lock.Key{}, 0, false
}

// forgetDone drops a record from the cap's heap, acted on or not.
func (w *watcher) forgetDone(k lock.Key, at int64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.dones.Len() > 0 && w.dones[0].k == k && w.dones[0].at == at {
		heap.Pop(&w.dones)
	}
}

// postpone moves k's deadline when its timer could not act on it.
func (w *watcher) postpone(k lock.Key, at int64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if ki, ok := w.keys.timed(k); ok && ki.deadline != 0 && ki.deadline < at {
		ki.deadline = at
		w.keys.set(k, w.b.n.key(k), ki)
		heap.Push(&w.deadlines, deadline{at: at, k: k})
	}
}

// compactDeadlines drops the heap's stale entries, which a key whose
// deadline moves often leaves behind; w.mu held.
func (w *watcher) compactDeadlines() {
	h := w.deadlines[:0]
	for _, d := range w.deadlines {
		if ki, ok := w.keys.timed(d.k); ok && ki.deadline == d.at {
			h = append(h, d)
		}
	}
	clear(w.deadlines[len(h):])
	w.deadlines = h
	heap.Init(&w.deadlines)
}

// compactDones drops the stale entries of the completion records' heap;
// w.mu held.
func (w *watcher) compactDones() {
	h := w.dones[:0]
	for _, d := range w.dones {
		if ki, ok := w.keys.timed(d.k); ok && ki.doneAt == d.at {
			h = append(h, d)
		}
	}
	clear(w.dones[len(h):])
	w.dones = h
	heap.Init(&w.dones)
}

type deadline struct {
	at int64
	k  lock.Key
}

type deadlineHeap []deadline

func (h deadlineHeap) Len() int           { return len(h) }
func (h deadlineHeap) Less(i, j int) bool { return h[i].at < h[j].at }
func (h deadlineHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *deadlineHeap) Push(x any)        { *h = append(*h, x.(deadline)) }
func (h *deadlineHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}
