package lock

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"
)

// Event names (docs/API.md).
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
	size    atomic.Int32 // WireSize, computed once
}

// WireSize is at least the bytes of the event's SSE frame (id, event and
// data lines), whatever the encoder escapes: it is what a session's replay
// log counts against Config.SessionLogBytes.
func (e *Event) WireSize() int {
	if n := e.size.Load(); n != 0 {
		return int(n)
	}
	// The frame's fixed part: "id: " and 20 digits, the event line, the
	// JSON keys, type, token or success, a time stamp, the separators.
	const fixed = 256
	n := fixed + 2*len(e.Name) + jsonLen(e.Key.Resource) + jsonLen(e.Node) + jsonLen(e.Error) + jsonLen(e.NextHolder)
	e.size.Store(int32(n))
	return n
}

// jsonLen bounds the length of s as a JSON string by encoding/json: quotes,
// two bytes for \" and \\, six for a control byte or an HTML-escaped <, >
// and &, six for an invalid byte (\ufffd) and at most two per byte of a
// multi-byte character (U+2028 and U+2029 take six for three).
func jsonLen(s string) int {
	n := 2
	perHigh := 0 // bytes a byte >= 0x80 may take, once known
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '"' || c == '\\':
			n += 2
		case c < 0x20 || c == '<' || c == '>' || c == '&':
			n += 6
		case c >= 0x80:
			if perHigh == 0 {
				perHigh = 2
				if !utf8.ValidString(s) {
					perHigh = 6
				}
			}
			n += perHigh
		default:
			n++
		}
	}
	return n
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
	streams []*stream
	keys    map[Key]struct{} // keys this session holds or waits for under a session lease
	ended   bool

	// The replay log: the session's recent events from logHead on, oldest
	// first, at most Config.SessionLog of them and Config.SessionLogBytes
	// of wire size (logBytes).
	log      []Delivery
	logHead  int
	logBytes int
	// lost is the id of the newest event the log let go, or the last id
	// issued before the session began: a replay from an older id misses
	// events.
	lost uint64

	// graceAt is when the session's grace ends: written under
	// Manager.grace.mu and s.mu (or the session table's mutex while no
	// stream has s), so it can be read under either. gidx places s in the
	// grace heap, guarded by Manager.grace.mu.
	graceAt mono
	gidx    int
}

func (m *Manager) newSessionLocked(node string) *session {
	s := &session{node: node, keys: make(map[Key]struct{}), lost: m.seq.Load(), gidx: -1}
	m.sess.m[node] = s
	m.sess.n.Add(1)
	return s
}

// sessionRoom reports ErrTooManySessions when no session may be added.
// Called with m.sess.mu held.
func (m *Manager) sessionRoom() error {
	if max := m.cfg.MaxSessions; max > 0 && len(m.sess.m) >= max {
		m.refusedSessions.Add(1)
		return fmt.Errorf("%w: %d sessions are open, at most %d are allowed", ErrTooManySessions, len(m.sess.m), max)
	}
	return nil
}

// startGrace arms the session's end. Called with s.mu held or s unpublished.
func (s *session) startGrace(m *Manager) {
	m.grace.set(m, s, m.now().add(m.cfg.SessionGrace))
}

// live is the replay log's events.
func (s *session) live() []Delivery { return s.log[s.logHead:] }

func (s *session) push(m *Manager, ev *Event) {
	var slow []*stream
	s.mu.Lock()
	if s.ended {
		s.mu.Unlock()
		return
	}
	d := Delivery{ID: m.seq.Add(1), Event: ev}
	s.logAppend(&m.cfg, d)
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

// logAppend adds d to the replay log, letting the oldest events go beyond
// the log's bounds. Dropping from the head and compacting once the head is
// half the slice costs O(1) amortized an event.
func (s *session) logAppend(cfg *Config, d Delivery) {
	size := d.Event.WireSize()
	for s.logHead < len(s.log) && (len(s.log)-s.logHead >= cfg.SessionLog || s.logBytes+size > cfg.SessionLogBytes) {
		old := &s.log[s.logHead]
		s.lost = old.ID
		s.logBytes -= old.Event.WireSize()
		*old = Delivery{}
		s.logHead++
	}
	if s.logHead > 0 && 2*s.logHead >= len(s.log) {
		n := copy(s.log, s.log[s.logHead:])
		clear(s.log[n:])
		s.log = s.log[:n]
		s.logHead = 0
	}
	s.log = append(s.log, d)
	s.logBytes += size
}

// graceHeap holds the sessions in grace by the end of their grace: one
// timer for the manager serves them all, where a timer each cost a
// goroutine each when a mass of sessions ran out at once (docs/DESIGN.md).
type graceHeap struct {
	mu      sync.Mutex
	h       []*session
	timer   *time.Timer
	timerAt mono // when timer fires; zero when idle
}

func (g *graceHeap) less(i, j int) bool { return g.h[i].graceAt < g.h[j].graceAt }

func (g *graceHeap) swap(i, j int) {
	g.h[i], g.h[j] = g.h[j], g.h[i]
	g.h[i].gidx = i
	g.h[j].gidx = j
}

func (g *graceHeap) up(i int) {
	for i > 0 {
		p := (i - 1) / 2
		if !g.less(i, p) {
			return
		}
		g.swap(i, p)
		i = p
	}
}

func (g *graceHeap) down(i int) bool {
	start := i
	for {
		l := 2*i + 1
		if l >= len(g.h) {
			break
		}
		c := l
		if r := l + 1; r < len(g.h) && g.less(r, l) {
			c = r
		}
		if !g.less(c, i) {
			break
		}
		g.swap(i, c)
		i = c
	}
	return i > start
}

func (g *graceHeap) removeLocked(s *session) {
	i := s.gidx
	if i < 0 {
		return
	}
	last := len(g.h) - 1
	if i != last {
		g.swap(i, last)
	}
	g.h[last] = nil
	g.h = g.h[:last]
	s.gidx = -1
	if i != last && !g.down(i) {
		g.up(i)
	}
}

// set puts s in the heap to end at at, arming the timer if it fires later.
func (g *graceHeap) set(m *Manager, s *session, at mono) {
	g.mu.Lock()
	s.graceAt = at
	if s.gidx < 0 {
		s.gidx = len(g.h)
		g.h = append(g.h, s)
		g.up(s.gidx)
	} else if !g.down(s.gidx) {
		g.up(s.gidx)
	}
	if g.timerAt == 0 || at < g.timerAt {
		g.armLocked(m, at)
	}
	g.mu.Unlock()
}

// stop takes s out of the heap: a stream opened.
func (g *graceHeap) stop(s *session) {
	g.mu.Lock()
	g.removeLocked(s)
	g.mu.Unlock()
}

func (g *graceHeap) armLocked(m *Manager, at mono) {
	g.timerAt = at
	d := time.Duration(at - m.now())
	if g.timer == nil {
		g.timer = time.AfterFunc(d, m.graceExpired)
		return
	}
	g.timer.Reset(d)
}

// graceExpired is the grace timer's callback: it ends every session whose
// grace ran out. It takes them from the heap endStep at a time: the heap's
// mutex is taken by every stream that opens or closes.
func (m *Manager) graceExpired() {
	m.closeMu.RLock()
	defer m.closeMu.RUnlock()
	if m.closed.Load() {
		return
	}
	g := &m.grace
	now := m.now()
	drops := make(map[*shard][]sessionDrop)
	due := make([]*session, 0, endStep)
	for first, more := true, true; more; first = false {
		due = due[:0]
		g.mu.Lock()
		if first {
			g.timerAt = 0
		}
		for len(g.h) > 0 && g.h[0].graceAt <= now && len(due) < endStep {
			s := g.h[0]
			g.removeLocked(s)
			due = append(due, s)
		}
		more = len(g.h) > 0 && g.h[0].graceAt <= now
		if !more && len(g.h) > 0 && (g.timerAt == 0 || g.h[0].graceAt < g.timerAt) {
			g.armLocked(m, g.h[0].graceAt)
		}
		g.mu.Unlock()
		m.endSessions(due, now, drops)
	}
	for sh, ds := range drops {
		sh.dropSessions(ds)
	}
}

// sessionDrop is one key of a lost session.
type sessionDrop struct {
	key  Key
	sess *session
}

// endSessions ends sessions whose grace ran out at now, unless a stream
// came since, and adds their keys to drops. Each session's entries are then
// found by its keys, without a scan of any queue (dropSessions), and the
// work goes in steps: the session table and each shard are taken for at
// most endStep sessions or entries at a time, so that other requests wait
// for one step, never for the whole mass.
func (m *Manager) endSessions(due []*session, now mono, drops map[*shard][]sessionDrop) {
	m.sess.mu.Lock()
	defer m.sess.mu.Unlock()
	for _, s := range due {
		s.mu.Lock()
		if s.ended || len(s.streams) > 0 || s.graceAt > now {
			s.mu.Unlock() // a stream is open, or came and went since
			continue
		}
		s.ended = true
		if m.sess.m[s.node] == s {
			delete(m.sess.m, s.node)
			m.sess.n.Add(-1)
		}
		keys := s.keys
		s.keys, s.log, s.logHead, s.logBytes = nil, nil, 0, 0
		s.mu.Unlock()
		m.sessionsLost.Add(1)
		m.opSession(s)
		m.log.Info("session lost", "node", s.node, "keys", len(keys))
		for k := range keys {
			sh := m.shardFor(k.Resource)
			drops[sh] = append(drops[sh], sessionDrop{k, s})
		}
	}
}

// endStep is how many sessions or entries one step of a mass session loss
// handles under one mutex.
const endStep = 256

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

// offer queues d unless StreamBuffer events are waiting already.
func (st *stream) offer(d Delivery) bool {
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
		close(st.done)
	})
}

// Subscription is what Subscribe returns besides the stream.
type Subscription struct {
	// ID is the id of the subscribed event: a reconnect that sends it as its
	// last event id replays everything after it. After a Last-Event-ID it
	// is that id, unless events after it were let go (Missed): then it is
	// the id of the newest one let go, so the replay starts after a gap the
	// client can see (docs/API.md).
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
func (m *Manager) Subscribe(ctx context.Context, req SubscribeRequest) (Stream, Subscription, error) {
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
			live := s.live()
			i, _ := slices.BinarySearchFunc(live, lastID+1, func(d Delivery, id uint64) int {
				return cmp.Compare(d.ID, id)
			})
			sub.Replay = slices.Clone(live[i:])
			// What the log let go cannot be replayed, nor what a session
			// that ended had (a stream with a last event id that finds no
			// session lost it to the grace): the subscribed event's id
			// then says where the replay starts.
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
