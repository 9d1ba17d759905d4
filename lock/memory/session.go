package memory

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unique"

	"github.com/dlock/dlock/lock"
)

// Sessions: a node's event log, kept while it streams and through a grace
// after its last stream closed (docs/DESIGN.md, "Sessions and events").

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
	// id is node interned, the id of the session's entries, made at the
	// first of them: a session that holds nothing does not pay for it.
	// Guarded by the session table's mutex and mu.
	id unique.Handle[string]

	mu      sync.Mutex
	streams []*stream
	// ents lists the entries that this session holds or waits for under a
	// session lease, through entry.sprev and entry.snext, which mu guards:
	// the session's end finds them there. An entry joins and leaves in O(1)
	// and allocates nothing, where a set of keys cost a map entry each
	// (docs/DESIGN.md, "What a held lock costs").
	ents  *entry
	nents int
	ended bool

	// The replay log: the session's recent events, at most
	// Config.SessionLog of them and Config.SessionLogBytes of wire size.
	log lock.ReplayLog
	// lost is the id of the newest event the log let go, or the last id
	// issued before the session began: a replay from an older id misses
	// events.
	lost uint64

	// graceAt is when the session's grace ends: written under
	// Backend.grace.mu and s.mu (or the session table's mutex while no
	// stream has s), so it can be read under either. gidx places s in the
	// grace heap, guarded by Backend.grace.mu.
	graceAt mono
	gidx    int
}

func (m *Backend) newSessionLocked(node string) *session {
	s := &session{node: node, lost: m.seq.Load(), gidx: -1}
	m.sess.m[node] = s
	m.sess.n.Add(1)
	return s
}

// sessionRoom reports ErrTooManySessions when no session may be added.
// Called with m.sess.mu held.
func (m *Backend) sessionRoom() error {
	if max := m.cfg.MaxSessions; max > 0 && len(m.sess.m) >= max {
		m.refusedSessions.Add(1)
		return fmt.Errorf("%w: %d sessions are open, at most %d are allowed", lock.ErrTooManySessions, len(m.sess.m), max)
	}
	return nil
}

// guaranteed is how long from now the session is sure to stand: the whole
// grace while a stream is open (it starts only when the last one closes),
// what is left of it in grace, nothing once ended. Takes s.mu, after the
// shard's mutex (docs/DESIGN.md, "The memory engine": the lock order).
func (s *session) guaranteed(m *Backend, now mono) time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.ended:
		return 0
	case len(s.streams) > 0:
		return m.cfg.SessionGrace
	}
	// graceAt may be written under the session table's mutex alone
	// (attach), never without the grace heap's, which comes after s.mu.
	m.grace.mu.Lock()
	at := s.graceAt
	m.grace.mu.Unlock()
	return max(time.Duration(at-now), 0)
}

// startGrace arms the session's end. Called with s.mu held or s unpublished.
func (s *session) startGrace(m *Backend) {
	m.grace.set(m, s, m.now().add(m.cfg.SessionGrace))
}

// link adds e to the session's entries. Called with s.mu held.
func (s *session) link(e *entry) {
	e.sprev, e.snext = nil, s.ents
	if s.ents != nil {
		s.ents.sprev = e
	}
	s.ents = e
	s.nents++
}

// unlink takes e out of the session's entries. Called with s.mu held.
func (s *session) unlink(e *entry) {
	if e.sprev != nil {
		e.sprev.snext = e.snext
	} else {
		s.ents = e.snext
	}
	if e.snext != nil {
		e.snext.sprev = e.sprev
	}
	e.sprev, e.snext = nil, nil
	s.nents--
}

// live is the replay log's events, in order (Subscribe's replay).
//
// It builds every compact event of the log, up to SessionLog of them,
// where Subscribe replays only those after its last event id: Subscribe
// (stream.go) should ask for after(lastID) instead.
func (s *session) live() []lock.Delivery { return s.after(0) }

// after is the replay log's events with an id above last, in order.
func (s *session) after(last uint64) []lock.Delivery { return s.log.After(s.node, last) }

func (s *session) push(m *Backend, ev *lock.Event) {
	var slow []*stream
	s.mu.Lock()
	if s.ended {
		s.mu.Unlock()
		return
	}
	d := lock.Delivery{ID: m.seq.Add(1), Event: ev}
	s.logAppend(&m.cfg, d)
	for _, st := range s.streams {
		if !st.Offer(d) {
			slow = append(slow, st)
		}
	}
	s.mu.Unlock()
	for _, st := range slow {
		st.kill()
	}
}

// logAppend adds d to the replay log, letting the oldest events go beyond
// the log's bounds.
func (s *session) logAppend(cfg *Config, d lock.Delivery) {
	if dropped := s.log.Append(s.node, d, cfg.SessionLog, cfg.SessionLogBytes); dropped > 0 {
		s.lost = dropped
	}
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
func (g *graceHeap) set(m *Backend, s *session, at mono) {
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

func (g *graceHeap) armLocked(m *Backend, at mono) {
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
func (m *Backend) graceExpired() {
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
	key  lock.Key
	sess *session
}

// endSessions ends sessions whose grace ran out at now, unless a stream
// came since, and adds their keys to drops. Each session's entries are then
// found by its keys, without a scan of any queue (dropSessions), and the
// work goes in steps: the session table and each shard are taken for at
// most endStep sessions or entries at a time, so that other requests wait
// for one step, never for the whole mass.
func (m *Backend) endSessions(due []*session, now mono, drops map[*shard][]sessionDrop) {
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
		// The entries are taken as keys: an entry may be released and
		// reused before its shard is reached, a key is looked up again
		// there (dropSessions). Their links go: an entry's detach leaves an
		// ended session's list alone.
		n := s.nents
		for e := s.ents; e != nil; {
			next := e.snext
			k := e.ks.key()
			sh := m.shardFor(k.Resource)
			drops[sh] = append(drops[sh], sessionDrop{k, s})
			e.sprev, e.snext = nil, nil
			e = next
		}
		s.ents, s.nents = nil, 0
		s.log.Reset()
		s.mu.Unlock()
		m.opSession(s)
		if n == 0 {
			// A clean end: the node closed its streams holding nothing.
			m.sessionsClosed.Add(1)
			m.log.Debug("session ended", "node", s.node)
			continue
		}
		m.sessionsLost.Add(1)
		m.log.Info("session lost", "node", s.node, "keys", n)
	}
}

// endStep is how many sessions or entries one step of a mass session loss
// handles under one mutex.
const endStep = 256
