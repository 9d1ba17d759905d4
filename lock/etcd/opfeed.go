package etcd

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dlock/dlock/lock"
)

// opTable is this server's operator feeds (lock.Inspector.WatchOps): every
// transition in the data set, derived from the watch as the session streams'
// events are, plus the queue joins and leaves and the session changes that
// only operators are told (docs/API.md, GET /ui/events).
type opTable struct {
	b    *Backend
	mu   sync.Mutex
	list []*opStream // replaced, never changed in place
	n    atomic.Int64
}

func (t *opTable) streams() []*opStream {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.list
}

// publish hands ev to every feed; w.mu held, so that events go out in the
// order the watch applied their changes.
func (t *opTable) publish(ev lock.OpEvent) {
	t.b.vw.built.Add(1)
	for _, st := range t.streams() {
		if !st.Offer(ev) {
			st.kill()
		}
	}
}

// revision publishes one revision's transitions, in the order a memory
// engine tells them: for each key, its grant, its completion, then the
// waiters that left its queue without being granted it or skipped by a
// success, then those that joined. A waiter refused at promotion left the
// queue: the feed says so, as the memory engine's does, not what it told
// the waiter's session.
func (t *opTable) revision(recs []keyChange, joined, left []queueChange) {
	for _, c := range recs {
		k, r, x := c.k, c.rec, c.rec.X
		if x.Assigned != "" {
			t.publish(lock.OpEvent{Event: &lock.Event{Name: lock.EventLockAssigned, Key: k, Node: x.Assigned, Token: r.Token}})
		}
		if d := x.Done; d != nil {
			t.publish(lock.OpEvent{Event: &lock.Event{Name: lock.EventOperationCompleted, Key: k, Node: d.Node, Success: d.OK,
				Error: d.Err, CompletedAt: time.Unix(0, d.At), NextHolder: d.Next}})
		}
	}
	for _, c := range left {
		if i := slices.IndexFunc(recs, func(r keyChange) bool { return r.k == c.k }); i >= 0 {
			if x := recs[i].rec.X; x.Assigned == c.node || x.Skip {
				continue // granted, or told by the success's operation_completed
			}
		}
		t.publish(lock.OpEvent{Event: &lock.Event{Name: lock.EventQueueLeft, Key: c.k, Node: c.node}})
	}
	for _, c := range joined {
		t.publish(lock.OpEvent{Event: &lock.Event{Name: lock.EventQueueJoined, Key: c.k, Node: c.node}})
	}
}

// streamsChanged tells the feeds a node's count of streams after one of
// this server's opened or closed: this server's, which local is, and the
// other servers' as they reported them (presence.go). w.mu held.
func (t *opTable) streamsChanged(node string, local int) {
	t.b.pres.changed(node)
	if t.n.Load() == 0 {
		return
	}
	t.publish(lock.OpEvent{Session: &lock.SessionChange{Node: node, Streams: local + t.b.pres.remote(node)}})
}

// endAll ends every feed, as not slow: after a relist, so that their
// readers read a fresh snapshot, and at Close. w.mu held.
func (t *opTable) endAll() {
	for _, st := range t.streams() {
		st.closeLocked()
	}
}

// opStream is an operator feed; like every stream, one that does not keep
// up (Rules.StreamBuffer) is closed.
type opStream struct {
	lock.FeedQueue[lock.OpEvent]
	b    *Backend
	once sync.Once
}

// WatchOps opens an operator feed. It counts against Rules.MaxWatchers with
// the observers of keys.
func (b *Backend) WatchOps(ctx context.Context) (lock.OpStream, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := b.alive(); err != nil {
		return nil, err
	}
	st := &opStream{b: b}
	st.Init(b.cfg.StreamBuffer)
	w := b.w
	w.mu.Lock()
	if b.cfg.MaxWatchers > 0 && w.nWatchers >= b.cfg.MaxWatchers {
		n := w.nWatchers
		w.mu.Unlock()
		b.refusedWatchers.Add(1)
		return nil, fmt.Errorf("%w: %d are open, at most %d are allowed", lock.ErrTooManyWatchers, n, b.cfg.MaxWatchers)
	}
	w.nWatchers++
	// Joined under w.mu: the feed gets every revision the watch applies
	// after this one, none twice.
	t := &b.ops
	t.mu.Lock()
	t.list = append(slices.Clip(t.list), st)
	t.n.Add(1)
	t.mu.Unlock()
	w.mu.Unlock()
	b.vw.feeds.Add(1)
	b.vw.look()
	// Close may have gone through the table before st was in it.
	if b.closed.Load() {
		st.Close()
		return nil, lock.ErrClosed
	}
	return st, nil
}

// kill closes a feed that did not keep up; w.mu held.
func (st *opStream) kill() {
	if st.MarkSlow() {
		st.b.slowStreams.Add(1)
		st.b.log.Warn("closing an operator stream that does not keep up", "buffer", st.b.cfg.StreamBuffer)
	}
	st.closeLocked()
}

// Close ends the feed and gives its place among the watchers back.
func (st *opStream) Close() {
	w := st.b.w
	w.mu.Lock()
	st.closeLocked()
	w.mu.Unlock()
}

// closeLocked is Close with w.mu held, which guards the count of watchers.
func (st *opStream) closeLocked() {
	st.once.Do(func() {
		b := st.b
		t := &b.ops
		t.mu.Lock()
		if i := slices.Index(t.list, st); i >= 0 {
			t.list = slices.Delete(slices.Clone(t.list), i, i+1)
			t.n.Add(-1)
			b.w.nWatchers--
			b.vw.feeds.Add(-1)
		}
		t.mu.Unlock()
		st.End()
	})
}
