package lock

import (
	"fmt"
	"math"
	"testing"
)

// TestReplayLogCompact: a session's own lock_assigned events are kept
// compact and the others whole, the log counts its bytes exactly and
// keeps its bounds, and After gives back, from every id, the events
// appended, built again as they were.
func TestReplayLogCompact(t *testing.T) {
	const node, maxEvents = "a", 8
	var (
		l       ReplayLog
		sent    []Delivery
		dropped uint64
	)
	for i := range 30 {
		d := Delivery{ID: uint64(10 + 2*i)} // ids increase, with gaps
		k := Key{Type: []Type{Pull, Update, Delete}[i%3], Resource: fmt.Sprint("r", i)}
		switch i % 3 {
		case 0: // a's own grant: compact, but for a token too large for it
			tok := uint64(100 + i)
			if i%9 == 6 {
				tok = 1<<56 + uint64(i)
			}
			d.Event = &Event{Name: EventLockAssigned, Key: k, Node: node, Token: tok}
		case 1: // a completion, shared with other sessions: whole
			d.Event = &Event{Name: EventOperationCompleted, Key: k, Node: "x", Success: true}
		case 2: // another node's grant, as an observer gets it: whole
			d.Event = &Event{Name: EventLockAssigned, Key: k, Node: "x", Token: uint64(100 + i)}
		}
		if x := l.Append(node, d, maxEvents, 1<<20); x > 0 {
			if x <= dropped {
				t.Fatalf("dropped %d after %d", x, dropped)
			}
			dropped = x
		}
		sent = append(sent, d)
		compact, whole, bytes := 0, 0, 0
		for _, e := range l.entries.items() {
			if e.res != "" {
				compact++
				bytes += e.size(node)
				continue
			}
			ev := l.whole.items()[whole]
			whole++
			bytes += ev.WireSize()
			if ev.Name == EventLockAssigned && ev.Node == node && ev.Token < 1<<56 {
				t.Errorf("the log keeps a's own lock_assigned %d whole", e.id)
			}
		}
		if n := len(l.whole.items()); n != whole {
			t.Errorf("the log keeps %d events whole for %d entries", n, whole)
		}
		if bytes != l.bytes {
			t.Errorf("the log counts %d bytes, its events take %d", l.bytes, bytes)
		}
		if i >= 2 && (compact == 0 || whole == 0) {
			t.Fatalf("after %d events: %d compact and %d whole in the log, want both", i+1, compact, whole)
		}
		kept := sent[max(0, len(sent)-maxEvents):]
		if n := len(l.entries.items()); n != len(kept) {
			t.Fatalf("after %d events the log keeps %d, want %d", i+1, n, len(kept))
		}
		if len(sent) > maxEvents && dropped != sent[len(sent)-maxEvents-1].ID {
			t.Fatalf("after %d events: dropped %d, want %d", i+1, dropped, sent[len(sent)-maxEvents-1].ID)
		}
		for j := -1; j < len(kept); j++ {
			var last uint64
			if j >= 0 {
				last = kept[j].ID
			}
			got, want := l.After(node, last), kept[j+1:]
			if len(got) != len(want) {
				t.Fatalf("after %d events, from %d: %d replayed, want %d", i+1, last, len(got), len(want))
			}
			for x, d := range got {
				w := want[x]
				if a, b := d.Event, w.Event; d.ID != w.ID || a.Name != b.Name || a.Key != b.Key || a.Node != b.Node || a.Token != b.Token || a.Success != b.Success || a.Error != b.Error {
					t.Fatalf("after %d events, from %d: event %d is %s, want %s", i+1, last, x, d.Event.Name+" "+d.Event.Key.String(), w.Event.Name+" "+w.Event.Key.String())
				}
			}
		}
	}
}

// TestReplayLogBytes: the byte bound lets the oldest go, and an event
// larger than it stays alone.
func TestReplayLogBytes(t *testing.T) {
	var l ReplayLog
	ev := &Event{Name: EventOperationCompleted, Key: Key{Type: Pull, Resource: "r"}, Node: "x"}
	size := ev.WireSize()
	for i := range 5 {
		l.Append("a", Delivery{ID: uint64(i + 1), Event: ev}, 100, 2*size)
	}
	if got := l.After("a", 0); len(got) != 2 || got[0].ID != 4 || l.bytes != 2*size {
		t.Fatalf("kept %d events from %v, %d bytes; want 4 and 5, %d bytes", len(got), got, l.bytes, 2*size)
	}
	big := &Event{Name: EventOperationCompleted, Key: Key{Type: Pull, Resource: "r"}, Node: "x", Error: string(make([]byte, 3*size))}
	if x := l.Append("a", Delivery{ID: 6, Event: big}, 100, 2*size); x != 5 {
		t.Fatalf("dropped %d, want 5", x)
	}
	if got := l.After("a", 0); len(got) != 1 || got[0].ID != 6 {
		t.Fatalf("kept %v, want the large event alone", got)
	}
	if got := l.After("a", math.MaxUint64); got != nil {
		t.Fatalf("after the largest id: %v", got)
	}
	l.Reset()
	if got := l.After("a", 0); got != nil {
		t.Fatalf("after Reset: %v", got)
	}
}

// TestFifo: pops come out in the order of the pushes, and nothing the
// fifo let go stays in its array, where it would keep an event alive.
func TestFifo(t *testing.T) {
	var q fifo[*int]
	var model []*int
	for i := range 1000 {
		// It grows for 500 steps, one pop to four pushes, then shrinks.
		if pop := i%5 == 1 || i > 500 && i%5 != 0; pop && len(model) > 0 {
			if got := q.pop(); got != model[0] {
				t.Fatalf("step %d: popped %d, want %d", i, *got, *model[0])
			}
			model = model[1:]
		} else {
			v := i
			q.push(&v)
			model = append(model, &v)
		}
		items := q.items()
		if len(items) != len(model) {
			t.Fatalf("step %d: %d items, want %d", i, len(items), len(model))
		}
		for j := range items {
			if items[j] != model[j] {
				t.Fatalf("step %d: item %d is %d, want %d", i, j, *items[j], *model[j])
			}
		}
		whole := q.s[:cap(q.s)]
		for j, v := range whole {
			if (j < q.head || j >= len(q.s)) && v != nil {
				t.Fatalf("step %d: slot %d outside the items still holds %d", i, j, *v)
			}
		}
	}
}
