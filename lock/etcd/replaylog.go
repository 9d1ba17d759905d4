package etcd

import (
	"sync/atomic"

	"github.com/dlock/dlock/lock"
)

// logEntry is one event of a session's replay log, 40 bytes. Most of a log
// is the session's own lock_assigned events, one a grant, which no other
// session shares: the log keeps such an event as the template of its type
// (assignedTemplate), its resource and its token, and a replay builds it
// again, so that the Event sent to the streams, with the encoding cached
// in it, is garbage once written (docs/DESIGN.md, "An etcd backend",
// "What a server keeps"). Any other event is kept as it is.
type logEntry struct {
	id    uint64
	ev    *lock.Event // the event, or the template of a compact one
	res   string      // set only in a compact one: its resource, the watch's copy
	token uint64      // a compact one's token
}

// assigned are the templates of compact lock_assigned events, by type,
// made at a type's first: a Type is one byte, so every type has a slot.
var assigned [256]atomic.Pointer[lock.Event]

func assignedTemplate(t lock.Type) *lock.Event {
	if ev := assigned[t].Load(); ev != nil {
		return ev
	}
	assigned[t].CompareAndSwap(nil, &lock.Event{Name: lock.EventLockAssigned, Key: lock.Key{Type: t}})
	return assigned[t].Load()
}

// size is the WireSize of the entry's event, as the log of node counts it.
func (le *logEntry) size(node string) int {
	if le.res != "" {
		return lock.EventWireSize(lock.EventLockAssigned, le.res, node, "", "")
	}
	return le.ev.WireSize()
}

// logEvent appends d to the replay log of node's session s within the
// log's bounds; w.mu held. The oldest events go first; dropping from the
// head and moving the rest down once the head is half the slice costs
// O(1) amortized an event.
func (w *watcher) logEvent(s *sessInfo, node string, d lock.Delivery) {
	le := logEntry{id: d.ID, ev: d.Event}
	if ev := d.Event; ev.Name == lock.EventLockAssigned && ev.Node == node {
		le.ev, le.res, le.token = assignedTemplate(ev.Key.Type), ev.Key.Resource, ev.Token
	}
	s.log = append(s.log, le)
	s.bytes += le.size(node)
	cfg := &w.b.cfg
	for len(s.log)-s.head > cfg.SessionLog || s.bytes > cfg.SessionLogBytes {
		old := &s.log[s.head]
		s.bytes -= old.size(node)
		s.dropped = old.id
		*old = logEntry{}
		s.head++
	}
	if s.head > 0 && 2*s.head >= len(s.log) {
		n := copy(s.log, s.log[s.head:])
		clear(s.log[n:])
		s.log, s.head = s.log[:n], 0
	}
}

// forget empties the replay log; w.mu held.
func (s *sessInfo) forget() { s.log, s.head, s.bytes = nil, 0, 0 }

// after is the events of node's replay log with an id above last, in
// order (nil for none), the compact ones built again in one allocation;
// w.mu held.
func (s *sessInfo) after(node string, last uint64) []lock.Delivery {
	log := s.log[s.head:]
	m, n := 0, 0
	for i := range log {
		if log[i].id > last {
			m++
			if log[i].res != "" {
				n++
			}
		}
	}
	if m == 0 {
		return nil
	}
	built := make([]lock.Event, n)
	out := make([]lock.Delivery, 0, m)
	for i := range log {
		le := &log[i]
		if le.id <= last {
			continue
		}
		ev := le.ev
		if le.res != "" {
			ev, built = &built[0], built[1:]
			ev.Name, ev.Key, ev.Node, ev.Token = lock.EventLockAssigned, lock.Key{Type: le.ev.Key.Type, Resource: le.res}, node, le.token
		}
		out = append(out, lock.Delivery{ID: le.id, Event: ev})
	}
	return out
}
