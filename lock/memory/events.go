package memory

import (
	"slices"
	"sync"

	"github.com/dlock/dlock/lock"
)

// item is one event to deliver: to the sessions of the nodes in to, and to
// the key's observers.
type item struct {
	ev        *lock.Event
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

func (m *Backend) deliver(it item) {
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
		if !st.Offer(lock.Delivery{ID: m.seq.Add(1), Event: it.ev}) {
			st.kill()
		}
	}
}
