package lock

import (
	"cmp"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Event names (SPEC §3).
const (
	EventLockAssigned       = "lock_assigned"
	EventOperationCompleted = "operation_completed"
)

// Event is a notification about one key. Events are shared by every stream
// that receives them and must not be modified.
type Event struct {
	Name        string
	Key         Key
	Node        string // the new holder, or the node whose operation completed
	Token       uint64 // lock_assigned only
	Success     bool
	Error       string
	CompletedAt time.Time
	NextHolder  string

	encOnce sync.Once
	enc     []byte
}

// Encoded returns enc's encoding of the event, computed once: an event sent
// to ten thousand streams is encoded once, not ten thousand times.
func (e *Event) Encoded(enc func([]byte, *Event) []byte) []byte {
	e.encOnce.Do(func() { e.enc = enc(nil, e) })
	return e.enc
}

// Delivery is an event as one stream receives it, with its id.
type Delivery struct {
	ID    uint64
	Event *Event
}

// item is one event to deliver: to the sessions of the nodes in to, and to
// the key's observers.
type item struct {
	ev        *Event
	to        []string
	observers bool
}

// batch is one transition's events. It is not delivered before it is ready:
// a transition that changed references is ready once they are durable.
type batch struct {
	items []item
	ready bool
}

// outbox delivers a shard's batches in transition order, whichever goroutine
// happens to drain it, and never while the shard mutex is held.
type outbox struct {
	mu       sync.Mutex
	q        []*batch
	draining bool
}

func (o *outbox) push(b *batch) {
	o.mu.Lock()
	o.q = append(o.q, b)
	o.mu.Unlock()
}

func (o *outbox) markReady(b *batch) {
	o.mu.Lock()
	b.ready = true
	o.mu.Unlock()
}

func (o *outbox) drain(deliver func(item)) {
	o.mu.Lock()
	if o.draining {
		o.mu.Unlock()
		return
	}
	o.draining = true
	for len(o.q) > 0 && o.q[0].ready {
		b := o.q[0]
		o.q[0] = nil
		o.q = o.q[1:]
		o.mu.Unlock()
		for _, it := range b.items {
			deliver(it)
		}
		o.mu.Lock()
	}
	if len(o.q) == 0 {
		o.q = nil
	}
	o.draining = false
	o.mu.Unlock()
}

func (m *Manager) deliver(it item) {
	m.opDeliver(it)
	for _, node := range it.to {
		if s := m.sess.get(node); s != nil {
			s.push(m, it.ev)
		}
	}
	if !it.observers || m.obs.n.Load() == 0 {
		return
	}
	for _, st := range m.obs.get(it.ev.Key) {
		if st.sess != nil && slices.Contains(it.to, st.sess.node) {
			continue // it had the event as its session's
		}
		if !st.offer(Delivery{ID: m.seq.Add(1), Event: it.ev}) {
			st.kill()
		}
	}
}

type sessionTable struct {
	mu sync.Mutex
	m  map[string]*session
	n  atomic.Int64 // len(m), read without mu on the hot path
}

func (t *sessionTable) get(node string) *session {
	t.mu.Lock()
	s := t.m[node]
	t.mu.Unlock()
	return s
}

// session is a node's event-stream session. It outlives its last stream by
// Config.SessionGrace and keeps its recent events for replay.
type session struct {
	node string

	mu      sync.Mutex
	streams []*Stream
	keys    map[Key]struct{} // keys this session holds or waits for under a session lease
	log     []Delivery       // recent events, oldest first
	ended   bool
	grace   *time.Timer
}

func (m *Manager) newSessionLocked(node string) *session {
	s := &session{node: node, keys: make(map[Key]struct{})}
	m.sess.m[node] = s
	m.sess.n.Add(1)
	return s
}

// startGrace arms the session's end. Called with s.mu held or s unpublished.
func (s *session) startGrace(m *Manager) {
	if s.grace == nil {
		s.grace = time.AfterFunc(m.cfg.SessionGrace, func() { m.endSession(s) })
		return
	}
	s.grace.Reset(m.cfg.SessionGrace)
}

func (s *session) push(m *Manager, ev *Event) {
	var slow []*Stream
	s.mu.Lock()
	if s.ended {
		s.mu.Unlock()
		return
	}
	d := Delivery{ID: m.seq.Add(1), Event: ev}
	// Keep between SessionLog and twice that: trimming half at a time
	// costs O(1) an event, where trimming one at a time would copy the
	// whole log on every event.
	if len(s.log) >= 2*m.cfg.SessionLog {
		n := copy(s.log, s.log[len(s.log)-m.cfg.SessionLog:])
		clear(s.log[n:])
		s.log = s.log[:n]
	}
	s.log = append(s.log, d)
	for _, st := range s.streams {
		if !st.offer(d) {
			slow = append(slow, st)
		}
	}
	s.mu.Unlock()
	for _, st := range slow {
		st.kill()
	}
}

// endSession runs when a session's grace ran out: everything it held is
// released as a failure and every queue entry it had is removed.
func (m *Manager) endSession(s *session) {
	m.closeMu.RLock()
	defer m.closeMu.RUnlock()
	if m.closed.Load() {
		return
	}
	m.sess.mu.Lock()
	s.mu.Lock()
	if s.ended || len(s.streams) > 0 {
		s.mu.Unlock()
		m.sess.mu.Unlock()
		return
	}
	s.ended = true
	if m.sess.m[s.node] == s {
		delete(m.sess.m, s.node)
		m.sess.n.Add(-1)
	}
	keys := s.keys
	s.keys, s.log = nil, nil
	s.mu.Unlock()
	m.sess.mu.Unlock()
	m.sessionsLost.Add(1)
	m.opSession(s)
	m.log.Info("session lost", "node", s.node, "keys", len(keys))
	for k := range keys {
		m.shardFor(k.Resource).dropSession(k, s)
	}
}

type observerTable struct {
	mu sync.RWMutex
	m  map[Key][]*Stream
	n  atomic.Int64
}

func (t *observerTable) get(k Key) []*Stream {
	t.mu.RLock()
	l := t.m[k]
	t.mu.RUnlock()
	return l // never modified in place: add and remove copy
}

func (t *observerTable) add(k Key, st *Stream) {
	t.mu.Lock()
	t.m[k] = append(slices.Clip(t.m[k]), st)
	t.n.Add(1)
	t.mu.Unlock()
}

func (t *observerTable) remove(k Key, st *Stream) {
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

// Stream is one event stream: a node's session stream, an observer of one
// key, or both. Wait on Ready, then Take what arrived, until Done is closed;
// then call Close.
type Stream struct {
	m       *Manager
	sess    *session
	observe *Key
	done    chan struct{}
	once    sync.Once
	slow    atomic.Bool

	// The undelivered events: a slice, not a buffered channel, so that an
	// idle stream of the thousands a server keeps costs a few bytes, not
	// StreamBuffer slots.
	mu    sync.Mutex
	queue []Delivery
	ready chan struct{} // holds a token while queue is not empty
}

// Ready receives when events are waiting to be taken.
func (st *Stream) Ready() <-chan struct{} { return st.ready }

// Take appends the waiting events, in order, to buf and returns it.
func (st *Stream) Take(buf []Delivery) []Delivery {
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
func (st *Stream) Done() <-chan struct{} { return st.done }

// Slow reports whether the stream was closed for not keeping up.
func (st *Stream) Slow() bool { return st.slow.Load() }

// offer queues d unless StreamBuffer events are waiting already.
func (st *Stream) offer(d Delivery) bool {
	st.mu.Lock()
	if len(st.queue) >= st.m.cfg.StreamBuffer {
		st.mu.Unlock()
		return false
	}
	st.queue = append(st.queue, d)
	st.mu.Unlock()
	select {
	case st.ready <- struct{}{}:
	default:
	}
	return true
}

func (st *Stream) kill() {
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
func (st *Stream) Close() {
	st.once.Do(func() {
		m := st.m
		if st.observe != nil {
			m.obs.remove(*st.observe, st)
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
		close(st.done)
	})
}

// Subscription is what Subscribe returns besides the stream.
type Subscription struct {
	// ID is the id of the subscribed event: a reconnect that sends it as its
	// last event id replays everything after it.
	ID uint64
	// Replay holds, in order, the session's events the stream missed.
	Replay []Delivery
}

// Subscribe opens a stream: the session stream of node (when not empty)
// and/or an observer of one key (when observe is not nil). With hasLast, a
// session stream first replays the session's retained events after lastID.
func (m *Manager) Subscribe(node string, observe *Key, lastID uint64, hasLast bool) (*Stream, Subscription, error) {
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
	st := &Stream{m: m, observe: observe, ready: make(chan struct{}, 1), done: make(chan struct{})}
	var sub Subscription
	if node != "" {
		m.sess.mu.Lock()
		s := m.sess.m[node]
		if s == nil {
			s = m.newSessionLocked(node)
		}
		s.mu.Lock()
		if s.grace != nil {
			s.grace.Stop()
		}
		s.streams = append(s.streams, st)
		st.sess = s
		// Read under s.mu: every event of this session numbered after it
		// reaches the stream.
		sub.ID = m.seq.Load()
		if hasLast && lastID <= sub.ID {
			sub.ID = lastID
			i, _ := slices.BinarySearchFunc(s.log, lastID+1, func(d Delivery, id uint64) int {
				return cmp.Compare(d.ID, id)
			})
			sub.Replay = slices.Clone(s.log[i:])
		}
		s.mu.Unlock()
		m.sess.mu.Unlock()
		m.opSession(s)
		if len(sub.Replay) > 0 {
			m.log.Debug("replaying session events", "node", node, "events", len(sub.Replay))
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
