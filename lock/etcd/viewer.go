package etcd

import (
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/lock"
)

// viewer is what this server keeps for the operators' view (docs/DESIGN.md,
// "An etcd backend", "The operators' view"), and only while someone looks:
// an operator feed is open here, or an inspection ran within viewIdle.
// While nobody looks it keeps nothing, and the watch's one hook into it
// (revision) reads two atomics and returns.
type viewer struct {
	b *Backend

	// on is set while someone looks; feeds counts the open operator feeds.
	on    atomic.Bool
	feeds atomic.Int64

	mu    sync.Mutex
	last  time.Time   // the last inspection
	timer *time.Timer // ends the look once idle
	// idx is the sorted index of the listed keys (keyindex.go), nil until
	// an inspection needs it while someone looks. It is built and changed
	// under the watcher's mutex, and read under idxMu alone.
	idxMu sync.Mutex
	idx   *keyIndex
	// While an index is built (index), its keys are sorted without the
	// watcher's mutex; the keys the watch changes meanwhile wait in
	// pending, and gen tells the builder that a relist or the end of the
	// look made what it built stale. All three under the watcher's mutex.
	build   sync.Mutex // one builder at a time
	pending []lock.Key
	gen     uint64
	growing bool

	// built counts what the hooks built: indexes and operator events. It
	// stays zero while nobody looks (a test checks).
	built atomic.Uint64
}

// viewIdle is how long the view's state outlives the last inspection when
// no operator feed is open. A page of the live view keeps a feed open, and
// reads pages only when the feed tells it something changed. A variable
// for tests.
var viewIdle = time.Minute

func newViewer(b *Backend) *viewer { return &viewer{b: b} }

// look notes an inspection (or a feed opening): someone looks from now on,
// until viewIdle after the last one with no feed open.
func (v *viewer) look() {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.last = time.Now()
	if !v.on.Swap(true) {
		v.b.pres.viewing(true)
	}
	if v.timer == nil && v.b.ctx.Err() == nil {
		v.timer = time.AfterFunc(viewIdle, v.idle)
	}
}

// idle ends the look when nobody has looked for viewIdle and no feed is
// open; else it looks again later.
func (v *viewer) idle() {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.timer = nil
	if v.b.ctx.Err() != nil {
		return
	}
	if wait := viewIdle - time.Since(v.last); v.feeds.Load() > 0 || wait > 0 {
		v.timer = time.AfterFunc(max(wait, viewIdle/8), v.idle)
		return
	}
	v.on.Store(false)
	v.b.pres.viewing(false)
	// Under the watcher's mutex, so that no hook is changing the index
	// being dropped.
	v.b.w.mu.Lock()
	v.drop()
	v.b.w.mu.Unlock()
}

// stop ends the idle timer (Close).
func (v *viewer) stop() {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.timer != nil {
		v.timer.Stop()
		v.timer = nil
	}
}

// index returns the index of the listed keys, built from the watch's table
// if there is none: once per look, and again after a relist. The keys are
// copied under the watcher's mutex, the plainly held ones as their etcd
// keys (keytable.go), and read back and sorted without it, so that the
// watch does not wait for either (tens of milliseconds for 100,000 keys);
// what it changed meanwhile is applied before the index is used.
func (v *viewer) index() *keyIndex {
	v.idxMu.Lock()
	x := v.idx
	v.idxMu.Unlock()
	if x != nil {
		return x
	}
	v.build.Lock()
	defer v.build.Unlock()
	v.idxMu.Lock()
	x = v.idx
	v.idxMu.Unlock()
	if x != nil {
		return x
	}
	w := v.b.w
	w.mu.Lock()
	keys := make([]lock.Key, 0, w.nHeld)
	for k, ki := range w.keys.notPlain() {
		if ki.held || ki.queue > 0 {
			keys = append(keys, k)
		}
	}
	plain := w.keys.plainKeys(make([]string, 0, w.keys.plain))
	gen := v.gen
	v.growing, v.pending = true, nil
	w.mu.Unlock()
	for _, key := range plain {
		if k, ok := v.b.n.parseKey(key); ok {
			keys = append(keys, k)
		}
	}
	x = newKeyIndex(keys)
	v.built.Add(1)
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, k := range v.pending {
		ki, _ := w.keys.getKey(k)
		x.set(k, ki.held || ki.queue > 0)
	}
	v.growing, v.pending = false, nil
	if gen == v.gen {
		v.idxMu.Lock()
		v.idx = x
		v.idxMu.Unlock()
	}
	return x
}

// relisted drops what a relist made stale: the index (built again on the
// next inspection) and the operator feeds, which missed changes (their
// readers read a fresh snapshot when they reconnect). The watcher calls it
// after listing the state again.
func (v *viewer) relisted() {
	w := v.b.w
	w.mu.Lock()
	defer w.mu.Unlock()
	v.drop()
	v.b.ops.endAll()
}

// drop forgets the index, and makes one being built stale; w.mu held.
func (v *viewer) drop() {
	v.idxMu.Lock()
	v.idx = nil
	v.idxMu.Unlock()
	v.gen++
}

// revision is the watch's hook: it keeps the index and feeds the operator
// streams with one revision's changes, after the watcher applied them to
// its table (w.mu held). While nobody looks it reads two atomics.
func (v *viewer) revision(evs []*clientv3.Event, rev int64) {
	feeding := v.b.ops.n.Load() > 0
	if !feeding && !v.on.Load() {
		return
	}
	b, w := v.b, v.b.w
	v.idxMu.Lock()
	x := v.idx
	v.idxMu.Unlock()
	var recs []keyChange // the keys' records this revision wrote, in its order
	var joined, left []queueChange
	var ended []string
	for _, ev := range evs {
		key := string(ev.Kv.Key)
		switch {
		case strings.HasPrefix(key, b.n.keys()):
			k, ok := b.n.parseKey(key)
			if !ok {
				continue
			}
			switch {
			case x != nil:
				ki, _ := w.keys.get(k, key)
				v.idxMu.Lock()
				x.set(k, ki.held || ki.queue > 0)
				v.idxMu.Unlock()
			case v.growing:
				v.pending = append(v.pending, k)
			}
			if !feeding || ev.Type == mvccpb.DELETE {
				continue
			}
			if r, err := decodeKey(ev.Kv.Value); err == nil && r.X != nil {
				recs = append(recs, keyChange{k, &r})
			}
		case feeding && strings.HasPrefix(key, b.n.p+"q/"):
			k, node, ok := b.n.parseWait(key)
			if !ok {
				continue
			}
			switch {
			case ev.Type == mvccpb.DELETE:
				left = append(left, queueChange{k, node})
			case ev.Kv.Version == 1: // made, not a renewal rewriting it
				joined = append(joined, queueChange{k, node})
			}
		case feeding && ev.Type == mvccpb.DELETE && strings.HasPrefix(key, b.n.sessions()):
			if node, ok := b.n.parseNode(key); ok {
				ended = append(ended, node)
			}
		}
	}
	if feeding {
		b.ops.revision(recs, joined, left)
		for _, node := range ended {
			b.ops.publish(lock.OpEvent{Session: &lock.SessionChange{Node: node, Ended: true}})
		}
	}
}

// keyChange is a key's record as a revision wrote it.
type keyChange struct {
	k   lock.Key
	rec *keyRec
}

// queueChange is a node that joined or left a key's queue.
type queueChange struct {
	k    lock.Key
	node string
}
