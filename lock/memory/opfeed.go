package memory

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/dlock/dlock/lock"
)

type opTable struct {
	mu   sync.Mutex
	list []*opStream // replaced, never modified in place
	n    atomic.Int64
	// built counts the events built or passed on for the feed; it stays
	// zero while nobody watches (a test checks).
	built atomic.Uint64
}

func (t *opTable) streams() []*opStream {
	t.mu.Lock()
	l := t.list
	t.mu.Unlock()
	return l
}

func (t *opTable) publish(ev lock.OpEvent) {
	for _, st := range t.streams() {
		if !st.Offer(ev) {
			st.kill()
		}
	}
}

// opDeliver passes a delivered event on to the feed. Every event observers
// get goes, and every operator-only one (no session, no observers); an
// event meant for one node alone (a waiter refused on promotion) does
// not: the feed reports that waiter's queue_left instead.
func (m *Backend) opDeliver(it item) {
	if m.ops.n.Load() > 0 && (it.observers || len(it.to) == 0) {
		if it.observers {
			m.ops.built.Add(1) // operator-only events were counted when built
		}
		m.ops.publish(lock.OpEvent{Event: it.ev})
	}
}

// opJoined reports that node joined ks's queue. Called under s.mu; the
// event goes out with t's.
func (s *shard) opJoined(t *txn, ks *keyState, node string) {
	if s.m.ops.n.Load() > 0 {
		s.m.ops.built.Add(1)
		t.items = append(t.items, item{ev: &lock.Event{Name: lock.EventQueueJoined, Key: ks.key(), Node: node}})
	}
}

// opLeft reports that node left ks's queue without the key. Called under
// s.mu by code that has no transaction at hand; commit sends the event
// with the transaction's (takeOps).
func (s *shard) opLeft(ks *keyState, node string) {
	if s.m.ops.n.Load() > 0 {
		s.m.ops.built.Add(1)
		s.opq = append(s.opq, item{ev: &lock.Event{Name: lock.EventQueueLeft, Key: ks.key(), Node: node}})
	}
}

// takeOps moves the pending operator-only events into a transition's
// items. Called under s.mu.
func (s *shard) takeOps(items []item) []item {
	if len(s.opq) == 0 {
		return items
	}
	items = append(items, s.opq...)
	clear(s.opq)
	s.opq = s.opq[:0]
	return items
}

// opSession reports s's state after a change. Not under a shard mutex:
// session changes are not ordered with lock events.
func (m *Backend) opSession(s *session) {
	if m.ops.n.Load() == 0 {
		return
	}
	m.ops.built.Add(1)
	s.mu.Lock()
	c := &lock.SessionChange{Node: s.node, Streams: len(s.streams), Ended: s.ended}
	s.mu.Unlock()
	m.ops.publish(lock.OpEvent{Session: c})
}

// opStream is the in-memory OpStream, a subscription to the operator feed.
// It has the bounded queue of every stream (Rules.StreamBuffer): one that
// does not keep up is closed, and its reader should read a fresh snapshot.
type opStream struct {
	lock.FeedQueue[lock.OpEvent]
	m    *Backend
	once sync.Once
}

// WatchOps subscribes to the operator feed.
func (m *Backend) WatchOps(ctx context.Context) (lock.OpStream, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if m.closed.Load() {
		return nil, lock.ErrClosed
	}
	if err := m.watch(); err != nil {
		return nil, err
	}
	st := &opStream{m: m}
	st.Init(m.cfg.StreamBuffer)
	m.ops.mu.Lock()
	m.ops.list = append(slices.Clip(m.ops.list), st)
	m.ops.n.Add(1)
	m.ops.mu.Unlock()
	// Close may have gone through the table before st was in it.
	if m.closed.Load() {
		st.Close()
		return nil, lock.ErrClosed
	}
	return st, nil
}

func (st *opStream) kill() {
	if st.MarkSlow() {
		st.m.slowStreams.Add(1)
		st.m.log.Warn("closing an operator stream that does not keep up", "buffer", st.m.cfg.StreamBuffer)
	}
	st.Close()
}

// Close ends the subscription.
func (st *opStream) Close() {
	st.once.Do(func() {
		t := &st.m.ops
		t.mu.Lock()
		if i := slices.Index(t.list, st); i >= 0 {
			t.list = slices.Delete(slices.Clone(t.list), i, i+1)
			t.n.Add(-1)
			st.m.unwatch(true)
		}
		t.mu.Unlock()
		st.End()
	})
}

// closeOps ends every operator stream; the manager's Close calls it.
func (m *Backend) closeOps() {
	for _, st := range m.ops.streams() {
		st.Close()
	}
}

// watch takes a place for a stream that watches without a session (an
// observer of a key, an operator feed): each gets every event of what it
// watches, handed over on the path of the request that made it, so their
// number is bounded (docs/SECURITY.md).
func (m *Backend) watch() error {
	if n := m.watchers.Add(1); m.cfg.MaxWatchers > 0 && n > int64(m.cfg.MaxWatchers) {
		m.watchers.Add(-1)
		m.refusedWatchers.Add(1)
		return fmt.Errorf("%w: %d are open, at most %d are allowed", lock.ErrTooManyWatchers, n-1, m.cfg.MaxWatchers)
	}
	return nil
}

// unwatch gives back the place watch took, when took.
func (m *Backend) unwatch(took bool) {
	if took {
		m.watchers.Add(-1)
	}
}
