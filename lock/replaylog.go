package lock

import (
	"cmp"
	"slices"
)

// ReplayLog is a session's recent events, oldest first, kept for a
// reconnect's replay (docs/DESIGN.md, "Event ids and replay"), bounded in
// events and in wire bytes. Both engines keep one per session; it is not
// safe for concurrent use (its engine's lock guards it).
//
// Most of a log is the session's own lock_assigned events, one a grant,
// which no other session shares: the log keeps such an event as its type,
// its resource and its token (32 bytes an entry), and After builds it
// again, so that the Event sent to the streams, with the encoding cached
// in it, is garbage once written. Any other event is shared by every
// session that got it, and is kept as it is, in whole, in the order of
// the entries that stand for them.
type ReplayLog struct {
	entries fifo[replayEntry] // the events kept
	whole   fifo[*Event]      // those of them kept whole
	bytes   int               // their WireSize
}

// fifo is a slice taken from the front and added to at the back: a pop
// moves its head, and what is left moves down once the head is half the
// slice, so that each costs O(1) amortized.
type fifo[T any] struct {
	s    []T
	head int
}

// items is what the fifo holds, oldest first.
func (q *fifo[T]) items() []T { return q.s[q.head:] }

func (q *fifo[T]) push(v T) { q.s = append(q.s, v) }

// pop takes the oldest item out, which must be there.
func (q *fifo[T]) pop() T {
	v := q.s[q.head]
	var zero T
	q.s[q.head] = zero // let it go
	q.head++
	if 2*q.head >= len(q.s) {
		n := copy(q.s, q.s[q.head:])
		clear(q.s[n:])
		q.s, q.head = q.s[:n], 0
	}
	return v
}

type replayEntry struct {
	id  uint64
	res string // a compact one's resource; "" for one kept whole
	// tt is a compact one's type, in its top byte, and token below it.
	tt uint64
}

// tokenBits are the bits of a compact entry's token: a token above them
// (2^56, a grant a nanosecond for two years) is kept whole.
const tokenBits = 56

func (e *replayEntry) typ() Type     { return Type(e.tt >> tokenBits) }
func (e *replayEntry) token() uint64 { return e.tt & (1<<tokenBits - 1) }

// size is the WireSize of a compact entry's event, sent to node.
func (e *replayEntry) size(node string) int {
	return EventWireSize(EventLockAssigned, e.res, node, "", "")
}

// Append adds d, an event of node's session, letting the oldest events go
// so that at most maxEvents events and maxBytes bytes stay (an event
// larger than maxBytes stays alone). It returns the id of the newest event
// it let go, 0 for none: a replay from before it misses events.
func (l *ReplayLog) Append(node string, d Delivery, maxEvents, maxBytes int) (dropped uint64) {
	e := replayEntry{id: d.ID}
	var size int
	if ev := d.Event; ev.Name == EventLockAssigned && ev.Node == node && ev.Key.Resource != "" && ev.Token>>tokenBits == 0 {
		e.res, e.tt = ev.Key.Resource, uint64(ev.Key.Type)<<tokenBits|ev.Token
		size = e.size(node)
	} else {
		size = ev.WireSize()
	}
	for n := len(l.entries.items()); n > 0 && (n >= maxEvents || l.bytes+size > maxBytes); n-- {
		old := l.entries.pop()
		dropped = old.id
		if old.res != "" {
			l.bytes -= old.size(node)
		} else {
			l.bytes -= l.whole.pop().WireSize()
		}
	}
	if e.res == "" {
		l.whole.push(d.Event)
	}
	l.entries.push(e)
	l.bytes += size
	return dropped
}

// After is the events of node's log with an id above last, in order (nil
// for none), the compact ones built again in one allocation.
func (l *ReplayLog) After(node string, last uint64) []Delivery {
	kept := l.entries.items()
	// The first entry past last (last+1 would wrap at the largest id).
	i, at := slices.BinarySearchFunc(kept, last, func(e replayEntry, id uint64) int { return cmp.Compare(e.id, id) })
	if at {
		i++
	}
	log := kept[i:]
	if len(log) == 0 {
		return nil
	}
	whole := l.whole.items()
	w := 0 // the whole events of the entries before log's come first
	for j := range kept[:i] {
		if kept[j].res == "" {
			w++
		}
	}
	n := 0
	for i := range log {
		if log[i].res != "" {
			n++
		}
	}
	built := make([]Event, n)
	out := make([]Delivery, len(log))
	for i := range log {
		e := &log[i]
		var ev *Event
		if e.res != "" {
			ev, built = &built[0], built[1:]
			ev.Name, ev.Key, ev.Node, ev.Token = EventLockAssigned, Key{Type: e.typ(), Resource: e.res}, node, e.token()
		} else {
			ev = whole[w]
			w++
		}
		out[i] = Delivery{ID: e.id, Event: ev}
	}
	return out
}

// Reset empties the log and lets its memory go.
func (l *ReplayLog) Reset() { *l = ReplayLog{} }
