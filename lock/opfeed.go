package lock

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
)

// The operator feed: every transition, for an operator's live view
// (docs/API.md, GET /ui/events). It costs nothing while nobody watches:
// each hook reads one atomic counter before it builds anything.

// Operator-only event names: a node joined or left a key's queue without
// being granted it. Session streams and observers never get them; a waiter
// that becomes holder is reported by lock_assigned, and the waiters a
// success sends away by operation_completed.
const (
	EventQueueJoined = "queue_joined"
	EventQueueLeft   = "queue_left"
)

// OpEvent is one transition on the operator feed: a lock event (Event is
// set) or a change of a node's session (Session is set).
type OpEvent struct {
	Event   *Event
	Session *SessionChange
}

// SessionChange reports a session's state after a stream opened or
// closed, or after the session ended.
type SessionChange struct {
	Node    string
	Streams int  // open streams; 0 with Ended false means in grace
	Ended   bool // the session is gone
}

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

func (t *opTable) publish(ev OpEvent) {
	for _, st := range t.streams() {
		if !st.offer(ev) {
			st.kill()
		}
	}
}

// opDeliver passes a delivered event on to the feed. Every event observers
// get goes, and every operator-only one (no session, no observers); an
// event meant for one node alone (a waiter refused on promotion) does
// not: the feed reports that waiter's queue_left instead.
func (m *Memory) opDeliver(it item) {
	if m.ops.n.Load() > 0 && (it.observers || len(it.to) == 0) {
		if it.observers {
			m.ops.built.Add(1) // operator-only events were counted when built
		}
		m.ops.publish(OpEvent{Event: it.ev})
	}
}

// opJoined reports that node joined ks's queue. Called under s.mu; the
// event goes out with t's.
func (s *shard) opJoined(t *txn, ks *keyState, node string) {
	if s.m.ops.n.Load() > 0 {
		s.m.ops.built.Add(1)
		t.items = append(t.items, item{ev: &Event{Name: EventQueueJoined, Key: ks.key(), Node: node}})
	}
}

// opLeft reports that node left ks's queue without the key. Called under
// s.mu by code that has no transaction at hand; commit sends the event
// with the transaction's (takeOps).
func (s *shard) opLeft(ks *keyState, node string) {
	if s.m.ops.n.Load() > 0 {
		s.m.ops.built.Add(1)
		s.opq = append(s.opq, item{ev: &Event{Name: EventQueueLeft, Key: ks.key(), Node: node}})
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
func (m *Memory) opSession(s *session) {
	if m.ops.n.Load() == 0 {
		return
	}
	m.ops.built.Add(1)
	s.mu.Lock()
	c := &SessionChange{Node: s.node, Streams: len(s.streams), Ended: s.ended}
	s.mu.Unlock()
	m.ops.publish(OpEvent{Session: c})
}

// opStream is the in-memory OpStream, a subscription to the operator feed. Wait on Ready, then
// Take what arrived, until Done is closed; then call Close. It has the
// bounded buffer of every stream (Config.StreamBuffer): one that does not
// keep up is closed, and its reader should read a fresh snapshot.
type opStream struct {
	m     *Memory
	done  chan struct{}
	once  sync.Once
	slow  atomic.Bool
	ready chan struct{} // holds a token while queue is not empty

	mu     sync.Mutex
	queue  []OpEvent
	notify func() // Notify's f
	ended  bool   // done is closed
}

// Notify makes the stream also call f when events start waiting and when
// it ends.
func (st *opStream) Notify(f func()) {
	st.mu.Lock()
	st.notify = f
	now := len(st.queue) > 0 || st.ended
	st.mu.Unlock()
	if now {
		f()
	}
}

// WatchOps subscribes to the operator feed.
func (m *Memory) WatchOps(ctx context.Context) (OpStream, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if m.closed.Load() {
		return nil, ErrClosed
	}
	if err := m.watch(); err != nil {
		return nil, err
	}
	st := &opStream{m: m, done: make(chan struct{}), ready: make(chan struct{}, 1)}
	m.ops.mu.Lock()
	m.ops.list = append(slices.Clip(m.ops.list), st)
	m.ops.n.Add(1)
	m.ops.mu.Unlock()
	// Close may have gone through the table before st was in it.
	if m.closed.Load() {
		st.Close()
		return nil, ErrClosed
	}
	return st, nil
}

// Ready receives when events are waiting to be taken.
func (st *opStream) Ready() <-chan struct{} { return st.ready }

// Take appends the waiting events, in order, to buf and returns it.
func (st *opStream) Take(buf []OpEvent) []OpEvent {
	st.mu.Lock()
	buf = append(buf, st.queue...)
	clear(st.queue)
	if cap(st.queue) > 64 {
		st.queue = nil
	} else {
		st.queue = st.queue[:0]
	}
	st.mu.Unlock()
	return buf
}

// Done is closed when the stream was closed: by Close, by the manager's
// Close, or because it did not keep up (Slow reports true then).
func (st *opStream) Done() <-chan struct{} { return st.done }

// Slow reports whether the stream was closed for not keeping up.
func (st *opStream) Slow() bool { return st.slow.Load() }

func (st *opStream) offer(ev OpEvent) bool {
	st.mu.Lock()
	if len(st.queue) >= st.m.cfg.StreamBuffer {
		st.mu.Unlock()
		return false
	}
	st.queue = append(st.queue, ev)
	var notify func()
	if len(st.queue) == 1 {
		notify = st.notify
	}
	st.mu.Unlock()
	select {
	case st.ready <- struct{}{}:
	default:
	}
	if notify != nil {
		notify()
	}
	return true
}

func (st *opStream) kill() {
	if st.slow.CompareAndSwap(false, true) {
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
		st.mu.Lock()
		st.ended = true
		notify := st.notify
		st.mu.Unlock()
		close(st.done)
		if notify != nil {
			notify()
		}
	})
}

// closeOps ends every operator stream; the manager's Close calls it.
func (m *Memory) closeOps() {
	for _, st := range m.ops.streams() {
		st.Close()
	}
}

// watch takes a place for a stream that watches without a session (an
// observer of a key, an operator feed): each gets every event of what it
// watches, handed over on the path of the request that made it, so their
// number is bounded (docs/SECURITY.md).
func (m *Memory) watch() error {
	if n := m.watchers.Add(1); m.cfg.MaxWatchers > 0 && n > int64(m.cfg.MaxWatchers) {
		m.watchers.Add(-1)
		m.refusedWatchers.Add(1)
		return fmt.Errorf("%w: %d are open, at most %d are allowed", ErrTooManyWatchers, n-1, m.cfg.MaxWatchers)
	}
	return nil
}

// unwatch gives back the place watch took, when took.
func (m *Memory) unwatch(took bool) {
	if took {
		m.watchers.Add(-1)
	}
}
