package lock

import (
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
	n := wireSize(e.Name, e.Key.Resource, e.Node, e.Error, e.NextHolder)
	e.size.Store(int32(n))
	return n
}

// wireSize is WireSize of an event with these texts.
func wireSize(name, resource, node, errText, next string) int {
	// The frame's fixed part: "id: " and 20 digits, the event line, the
	// JSON keys, type, token or success, a time stamp, the separators.
	const fixed = 256
	return fixed + 2*len(name) + jsonLen(resource) + jsonLen(node) + jsonLen(errText) + jsonLen(next)
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
// a transition that changed references is ready once they are durable
// (docs/DESIGN.md, "The outbox").
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

func (m *Memory) deliver(it item) {
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
