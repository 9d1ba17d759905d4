package lock

import (
	"cmp"
	"slices"
	"sync/atomic"
)

// ReplayLog is a session's recent events, oldest first, kept for a
// reconnect's replay (docs/DESIGN.md, "Event ids and replay"), bounded in
// events and in wire bytes. Both engines keep one per session; it is not
// safe for concurrent use (its engine's lock guards it).
//
// Most of a log is the session's own lock_assigned events, one a grant,
// which no other session shares: the log keeps such an event as the
// template of its type, its resource and its token (40 bytes an entry),
// and After builds it again, so that the Event sent to the streams, with
// the encoding cached in it, is garbage once written. Any other event is
// shared by every session that got it, and is kept as it is.
type ReplayLog struct {
	entries []replayEntry // entries[head:] are the events kept
	head    int
	bytes   int // their WireSize
}

type replayEntry struct {
	id    uint64
	ev    *Event // the event, or the template of a compact one
	res   string // set only in a compact one: its resource
	token uint64 // a compact one's token
}

// assignedTemplates are the templates of compact lock_assigned events, by
// type, made at a type's first: a Type is one byte, so every type has a
// slot, and the types a process never sees cost a nil pointer.
var assignedTemplates [256]atomic.Pointer[Event]

func assignedTemplate(t Type) *Event {
	if ev := assignedTemplates[t].Load(); ev != nil {
		return ev
	}
	assignedTemplates[t].CompareAndSwap(nil, &Event{Name: EventLockAssigned, Key: Key{Type: t}})
	return assignedTemplates[t].Load()
}

// size is the WireSize of the entry's event, sent to node.
func (e *replayEntry) size(node string) int {
	if e.res != "" {
		return EventWireSize(EventLockAssigned, e.res, node, "", "")
	}
	return e.ev.WireSize()
}

// Append adds d, an event of node's session, letting the oldest events go
// so that at most maxEvents events and maxBytes bytes stay (an event
// larger than maxBytes stays alone). It returns the id of the newest event
// it let go, 0 for none: a replay from before it misses events. Dropping
// from the head and moving the rest down once the head is half the slice
// costs O(1) amortized an event.
func (l *ReplayLog) Append(node string, d Delivery, maxEvents, maxBytes int) (dropped uint64) {
	e := replayEntry{id: d.ID, ev: d.Event}
	if ev := d.Event; ev.Name == EventLockAssigned && ev.Node == node {
		e.ev, e.res, e.token = assignedTemplate(ev.Key.Type), ev.Key.Resource, ev.Token
	}
	size := e.size(node)
	for l.head < len(l.entries) && (len(l.entries)-l.head >= maxEvents || l.bytes+size > maxBytes) {
		old := &l.entries[l.head]
		dropped = old.id
		l.bytes -= old.size(node)
		*old = replayEntry{}
		l.head++
	}
	if l.head > 0 && 2*l.head >= len(l.entries) {
		n := copy(l.entries, l.entries[l.head:])
		clear(l.entries[n:])
		l.entries, l.head = l.entries[:n], 0
	}
	l.entries = append(l.entries, e)
	l.bytes += size
	return dropped
}

// After is the events of node's log with an id above last, in order (nil
// for none), the compact ones built again in one allocation.
func (l *ReplayLog) After(node string, last uint64) []Delivery {
	log := l.entries[l.head:]
	i, _ := slices.BinarySearchFunc(log, last+1, func(e replayEntry, id uint64) int { return cmp.Compare(e.id, id) })
	log = log[i:]
	if len(log) == 0 {
		return nil
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
		ev := e.ev
		if e.res != "" {
			ev, built = &built[0], built[1:]
			ev.Name, ev.Key, ev.Node, ev.Token = EventLockAssigned, Key{Type: e.ev.Key.Type, Resource: e.res}, node, e.token
		}
		out[i] = Delivery{ID: e.id, Event: ev}
	}
	return out
}

// Reset empties the log and lets its memory go.
func (l *ReplayLog) Reset() { *l = ReplayLog{} }
