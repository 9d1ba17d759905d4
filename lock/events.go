package lock

import (
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
	n := EventWireSize(e.Name, e.Key.Resource, e.Node, e.Error, e.NextHolder)
	e.size.Store(int32(n))
	return n
}

// EventWireSize is the WireSize of an event with these texts, for a
// backend that keeps an event in a more compact form than an Event.
func EventWireSize(name, resource, node, errText, next string) int {
	// The frame's fixed part: "id: " and 20 digits, the event line, the
	// JSON keys, type (up to MaxTypeLen bytes), token or success, a time
	// stamp, the separators: some 210 bytes with the longest type, which
	// server.TestEventWireSize holds to this bound.
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
