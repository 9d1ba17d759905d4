package memory

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/dlock/dlock/lock"
)

type observerTable struct {
	mu sync.RWMutex
	m  map[lock.Key][]*stream
	n  atomic.Int64
}

func (t *observerTable) get(k lock.Key) []*stream {
	t.mu.RLock()
	l := t.m[k]
	t.mu.RUnlock()
	return l // never modified in place: add and remove copy
}

func (t *observerTable) add(k lock.Key, st *stream) {
	t.mu.Lock()
	t.m[k] = append(slices.Clip(t.m[k]), st)
	t.n.Add(1)
	t.mu.Unlock()
}

func (t *observerTable) remove(k lock.Key, st *stream) {
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
// one key, or both. Its queue is the feed core every backend shares; what
// is its own is what Close undoes.
type stream struct {
	lock.FeedQueue[lock.Delivery]
	m       *Backend
	sess    *session
	observe *lock.Key
	once    sync.Once
}

func (m *Backend) newStream(observe *lock.Key) *stream {
	st := &stream{m: m, observe: observe}
	st.Init(m.cfg.StreamBuffer)
	return st
}

// kill closes a stream whose queue is full: one that does not keep up is
// closed, never waited for (docs/DESIGN.md, "Slow streams"). Not under the
// session's mutex, which Close takes.
func (st *stream) kill() {
	if st.MarkSlow() {
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
		st.End()
	})
}

// Subscribe opens a stream: the session stream of req.Node (when not empty)
// and/or an observer of one key (when req.Observe is not nil). With
// req.HasLast, a session stream first replays the session's retained events
// after req.LastID.
func (m *Backend) Subscribe(ctx context.Context, req lock.SubscribeRequest) (lock.Stream, lock.Subscription, error) {
	if err := ctx.Err(); err != nil {
		return nil, lock.Subscription{}, err
	}
	node, observe, lastID, hasLast := req.Node, req.Observe, req.LastID, req.HasLast
	if node == "" && observe == nil {
		return nil, lock.Subscription{}, lock.ValidateNode("")
	}
	if node != "" {
		if err := lock.ValidateNode(node); err != nil {
			return nil, lock.Subscription{}, err
		}
	}
	if observe != nil {
		if err := lock.ValidateKey(observe.Type, observe.Resource, "-"); err != nil {
			return nil, lock.Subscription{}, err
		}
	}
	if m.closed.Load() {
		return nil, lock.Subscription{}, lock.ErrClosed
	}
	if observe != nil {
		if err := m.watch(); err != nil {
			return nil, lock.Subscription{}, err
		}
	}
	st := m.newStream(observe)
	var sub lock.Subscription
	if node != "" {
		m.sess.mu.Lock()
		s := m.sess.m[node]
		anew := s == nil
		if anew {
			if err := m.sessionRoom(); err != nil {
				m.sess.mu.Unlock()
				m.unwatch(observe != nil)
				return nil, lock.Subscription{}, err
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
			return nil, lock.Subscription{}, fmt.Errorf("%w: node %s has %d open event streams, at most %d are allowed", lock.ErrTooManySessions, node, n, max)
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
	// Close may have gone through the tables before st was in them (it
	// checked closed above, before Close began): nothing else would end
	// st, and its reader would wait on it for ever.
	if m.closed.Load() {
		st.Close()
		return nil, lock.Subscription{}, lock.ErrClosed
	}
	return st, sub, nil
}
