package lock

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
)

type observerTable struct {
	mu sync.RWMutex
	m  map[Key][]*stream
	n  atomic.Int64
}

func (t *observerTable) get(k Key) []*stream {
	t.mu.RLock()
	l := t.m[k]
	t.mu.RUnlock()
	return l // never modified in place: add and remove copy
}

func (t *observerTable) add(k Key, st *stream) {
	t.mu.Lock()
	t.m[k] = append(slices.Clip(t.m[k]), st)
	t.n.Add(1)
	t.mu.Unlock()
}

func (t *observerTable) remove(k Key, st *stream) {
	t.mu.Lock()
	l := t.m[k]
	if i := slices.Index(l, st); i >= 0 {
		l = slices.Delete(slices.Clone(l), i, i+1)
		if len(l) == 0 {
			delete(t.m, k)
		} else {
			t.m[k] = l
		}
		t.n.Add(-1)
	}
	t.mu.Unlock()
}

// stream is the in-memory Stream: a node's session stream, an observer of
// one key, or both. Wait on Ready, then Take what arrived, until Done is closed;
// then call Close.
type stream struct {
	m       *Memory
	sess    *session
	observe *Key
	done    chan struct{}
	once    sync.Once
	slow    atomic.Bool

	// The undelivered events: a slice, not a buffered channel, so that an
	// idle stream of the thousands a server keeps costs a few bytes, not
	// StreamBuffer slots.
	mu     sync.Mutex
	queue  []Delivery
	ready  chan struct{} // holds a token while queue is not empty
	notify func()        // Notify's f; guarded by mu
	ended  bool          // done is closed; guarded by mu
}

// Notify makes the stream also call f when events start waiting and when
// it ends.
func (st *stream) Notify(f func()) {
	st.mu.Lock()
	st.notify = f
	now := len(st.queue) > 0 || st.ended
	st.mu.Unlock()
	if now {
		f()
	}
}

// Ready receives when events are waiting to be taken.
func (st *stream) Ready() <-chan struct{} { return st.ready }

// Take appends the waiting events, in order, to buf and returns it.
func (st *stream) Take(buf []Delivery) []Delivery {
	st.mu.Lock()
	buf = append(buf, st.queue...)
	clear(st.queue)
	if cap(st.queue) > 64 {
		st.queue = nil // let a burst's backing array go
	} else {
		st.queue = st.queue[:0]
	}
	st.mu.Unlock()
	return buf
}

// Done is closed when the stream was closed: by Close, by the manager's
// Close, or because its buffer filled up (Slow reports true then).
func (st *stream) Done() <-chan struct{} { return st.done }

// Slow reports whether the stream was closed for not keeping up.
func (st *stream) Slow() bool { return st.slow.Load() }

// offer queues d unless StreamBuffer events are waiting already: a stream
// that does not keep up is closed, never waited for (docs/DESIGN.md, "Slow
// streams").
func (st *stream) offer(d Delivery) bool {
	st.mu.Lock()
	if len(st.queue) >= st.m.cfg.StreamBuffer {
		st.mu.Unlock()
		return false
	}
	st.queue = append(st.queue, d)
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

func (st *stream) kill() {
	if st.slow.CompareAndSwap(false, true) {
		st.m.slowStreams.Add(1)
		node := ""
		if st.sess != nil {
			node = st.sess.node
		}
		st.m.log.Warn("closing a stream that does not keep up", "node", node, "buffer", st.m.cfg.StreamBuffer)
	}
	st.Close()
}

// Close ends the stream. When it was its session's last stream, the
// session's grace starts.
func (st *stream) Close() {
	st.once.Do(func() {
		m := st.m
		if st.observe != nil {
			m.obs.remove(*st.observe, st)
			m.unwatch(true)
		}
		if s := st.sess; s != nil {
			s.mu.Lock()
			if i := slices.Index(s.streams, st); i >= 0 {
				s.streams = slices.Delete(s.streams, i, i+1)
			}
			if len(s.streams) == 0 && !s.ended && !m.closed.Load() {
				s.startGrace(m)
			}
			s.mu.Unlock()
			m.opSession(s)
		}
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

// Subscription is what Subscribe returns besides the stream.
type Subscription struct {
	// ID is the id of the subscribed event: a reconnect that sends it as its
	// last event id replays everything after it. After a Last-Event-ID it
	// is that id, unless events after it were let go (Missed): then it is
	// the id of the newest one let go, so the replay starts after a gap the
	// client can see (docs/DESIGN.md, "Event ids and replay").
	ID uint64
	// Replay holds, in order, the session's retained events after the last
	// event id; they take at most Config.SessionLogBytes on the api.
	Replay []Delivery
	// Missed reports that events after the last event id are no longer
	// kept: the log's bounds let them go, or the session ended and began
	// anew.
	Missed bool
}

// Subscribe opens a stream: the session stream of req.Node (when not empty)
// and/or an observer of one key (when req.Observe is not nil). With
// req.HasLast, a session stream first replays the session's retained events
// after req.LastID.
func (m *Memory) Subscribe(ctx context.Context, req SubscribeRequest) (Stream, Subscription, error) {
	if err := ctx.Err(); err != nil {
		return nil, Subscription{}, err
	}
	node, observe, lastID, hasLast := req.Node, req.Observe, req.LastID, req.HasLast
	if node == "" && observe == nil {
		return nil, Subscription{}, validateID("node_id", "", MaxNodeLen)
	}
	if node != "" {
		if err := ValidateNode(node); err != nil {
			return nil, Subscription{}, err
		}
	}
	if observe != nil {
		if err := validateKey(observe.Type, observe.Resource, "-"); err != nil {
			return nil, Subscription{}, err
		}
	}
	if m.closed.Load() {
		return nil, Subscription{}, ErrClosed
	}
	if observe != nil {
		if err := m.watch(); err != nil {
			return nil, Subscription{}, err
		}
	}
	st := &stream{m: m, observe: observe, ready: make(chan struct{}, 1), done: make(chan struct{})}
	var sub Subscription
	if node != "" {
		m.sess.mu.Lock()
		s := m.sess.m[node]
		anew := s == nil
		if anew {
			if err := m.sessionRoom(); err != nil {
				m.sess.mu.Unlock()
				m.unwatch(observe != nil)
				return nil, Subscription{}, err
			}
			s = m.newSessionLocked(node)
		}
		s.mu.Lock()
		if max := m.cfg.MaxSessionsPerNode; max > 0 && len(s.streams) >= max {
			n := len(s.streams)
			s.mu.Unlock()
			m.sess.mu.Unlock()
			m.refusedNodeStreams.Add(1)
			m.unwatch(observe != nil)
			return nil, Subscription{}, fmt.Errorf("%w: node %s has %d open event streams, at most %d are allowed", ErrTooManySessions, node, n, max)
		}
		m.grace.stop(s)
		s.streams = append(s.streams, st)
		st.sess = s
		// Read under s.mu: every event of this session numbered after it
		// reaches the stream.
		sub.ID = m.seq.Load()
		if hasLast && lastID <= sub.ID {
			sub.ID = lastID
			sub.Replay = s.after(lastID)
			// What the log let go cannot be replayed, nor what a session
			// that ended had (a stream with a last event id that finds no
			// session lost it to the grace): the subscribed event's id
			// then says where the replay starts.
			if anew && lastID >= s.lost {
				// Nothing was numbered since the old session's last
				// event: take an id, which no event carries, so that
				// the gap shows on the wire, where a client sees only
				// ids. Events of this session are numbered under s.mu,
				// held here, so none falls below it.
				s.lost = m.seq.Add(1)
			}
			if lastID < s.lost || anew {
				sub.ID, sub.Missed = s.lost, true
			}
		}
		s.mu.Unlock()
		m.sess.mu.Unlock()
		m.opSession(s)
		if sub.Missed {
			m.replayGaps.Add(1)
		}
		if len(sub.Replay) > 0 || sub.Missed {
			m.log.Debug("replaying session events", "node", node, "events", len(sub.Replay), "missed_after", lastID, "replay_after", sub.ID)
		}
	}
	if observe != nil {
		if node == "" {
			sub.ID = m.seq.Load()
		}
		m.obs.add(*observe, st)
	}
	return st, sub, nil
}
