package lock

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
)

// replayModel is what a ReplayLog must behave as: the deliveries kept, in
// a plain list, and their wire bytes.
type replayModel struct {
	kept  []Delivery
	bytes int
}

func (m *replayModel) append(d Delivery, maxEvents, maxBytes int) (dropped uint64) {
	size := d.Event.WireSize()
	for len(m.kept) > 0 && (len(m.kept) >= maxEvents || m.bytes+size > maxBytes) {
		dropped = m.kept[0].ID
		m.bytes -= m.kept[0].Event.WireSize()
		m.kept = m.kept[1:]
	}
	m.kept = append(m.kept, d)
	m.bytes += size
	return dropped
}

func (m *replayModel) after(last uint64) []Delivery {
	for i, d := range m.kept {
		if d.ID > last {
			return m.kept[i:]
		}
	}
	return nil
}

// sameEvent reports whether a replayed event is the one appended, field
// for field (the cached encoding aside).
func sameEvent(a, b *Event) bool {
	return a.Name == b.Name && a.Key == b.Key && a.Node == b.Node && a.Token == b.Token &&
		a.Success == b.Success && a.Error == b.Error && a.CompletedAt.Equal(b.CompletedAt) && a.NextHolder == b.NextHolder
}

// modelEvent is a random event of node's session, in the shapes the
// engines make: its own grants (some with a token too large to keep
// compact, or of the largest type), others' grants as an observer gets
// them, completions of every size, so that the byte bound lets a varying
// number go at once.
func modelEvent(rng *rand.Rand, node string) *Event {
	k := Key{Type: Type(rng.IntN(256)), Resource: fmt.Sprint("r", rng.IntN(1000), strings.Repeat("x", rng.IntN(200)))}
	switch rng.IntN(6) {
	case 0, 1, 2:
		tok := []uint64{1, rng.Uint64N(1 << 40), 1<<56 - 1, 1 << 56, 1<<56 + 1, 1<<64 - 1}[rng.IntN(6)]
		return &Event{Name: EventLockAssigned, Key: k, Node: node, Token: tok}
	case 3:
		return &Event{Name: EventLockAssigned, Key: k, Node: "other", Token: rng.Uint64()}
	case 4:
		return &Event{Name: EventLockAssigned, Key: Key{Type: k.Type}, Node: node, Token: 7} // no resource: kept whole
	default:
		return &Event{Name: EventOperationCompleted, Key: k, Node: node, Error: strings.Repeat("e", rng.IntN(3000)), NextHolder: "n"}
	}
}

// TestReplayLogModel: a ReplayLog under random appends, with ids that
// skip, its own grants and events kept whole interleaved, both bounds and
// resets, is the plain list of its deliveries: the same events kept, the
// same id dropped, the same bytes, and After from every kept id, from
// before the first and from past the last gives the same events back.
func TestReplayLogModel(t *testing.T) {
	const node = "a"
	for seed := range uint64(200) {
		rng := rand.New(rand.NewPCG(seed, 99))
		maxEvents := 1 + rng.IntN(12)
		maxBytes := 300 + rng.IntN(6000)
		var (
			l  ReplayLog
			m  replayModel
			id uint64
		)
		for step := range 300 {
			if rng.IntN(100) == 0 {
				l.Reset()
				m = replayModel{}
			}
			id += 1 + []uint64{0, 1, 1000}[rng.IntN(3)]
			d := Delivery{ID: id, Event: modelEvent(rng, node)}
			got, want := l.Append(node, d, maxEvents, maxBytes), m.append(d, maxEvents, maxBytes)
			where := fmt.Sprintf("seed %d, step %d (id %d, %s %s token %d)", seed, step, id, d.Event.Name, d.Event.Key, d.Event.Token)
			if got != want {
				t.Fatalf("%s: dropped %d, want %d", where, got, want)
			}
			if l.bytes != m.bytes {
				t.Fatalf("%s: the log counts %d bytes, want %d", where, l.bytes, m.bytes)
			}
			if n := len(l.entries.items()); n != len(m.kept) {
				t.Fatalf("%s: %d kept, want %d", where, n, len(m.kept))
			}
			lasts := []uint64{0}
			for _, d := range m.kept {
				lasts = append(lasts, d.ID-1, d.ID)
			}
			lasts = append(lasts, id+1)
			for _, last := range lasts {
				got, want := l.After(node, last), m.after(last)
				if len(got) != len(want) || (want == nil) != (got == nil) {
					t.Fatalf("%s: After(%d) has %d, want %d", where, last, len(got), len(want))
				}
				for i := range got {
					if got[i].ID != want[i].ID || !sameEvent(got[i].Event, want[i].Event) {
						t.Fatalf("%s: After(%d)[%d] is %d %s %s %s token %d, want %d %s %s %s token %d", where, last, i,
							got[i].ID, got[i].Event.Name, got[i].Event.Key, got[i].Event.Node, got[i].Event.Token,
							want[i].ID, want[i].Event.Name, want[i].Event.Key, want[i].Event.Node, want[i].Event.Token)
					}
				}
			}
		}
	}
}
