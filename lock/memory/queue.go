package memory

// waitQueue is a key's FIFO of waiters, q from head on. A waiter removed
// from the middle leaves a nil slot (dead counts them) and the slots are
// compacted once they are half the slice, so that removing any waiter
// costs O(1) amortized: a mass session loss removes N waiters in O(N),
// not O(N²) (docs/DESIGN.md, "The memory engine"). It stays with
// its key once allocated, so that a key handed from waiter to waiter
// allocates nothing.
type waitQueue struct {
	q      []*entry
	head   int
	dead   int
	work   uint64            // queue slots visited to remove waiters or find positions: the tests' measure of cost
	byNode map[string]*entry // node → its queue entry
	// delay is the key's lock delay while it runs (docs/DESIGN.md,
	// "Leases"): an entry of no node whose deadline in the shard's heap
	// is the delay's end. It lives here, not in keyState, so that a key
	// stays 64 bytes: a delay is rare, and a key that has one keeps its
	// waitQueue anyway, since a node that asks meanwhile waits.
	delay *entry
}

func (q *waitQueue) len() int { return len(q.q) - q.head - q.dead }

func (q *waitQueue) push(e *entry) {
	e.qidx = int32(len(q.q))
	q.q = append(q.q, e)
}

// pop removes and returns the first waiter, nil when there is none.
func (q *waitQueue) pop() *entry {
	for q.head < len(q.q) {
		q.work++
		e := q.q[q.head]
		q.q[q.head] = nil
		q.head++
		if e != nil {
			q.settle()
			return e
		}
		q.dead--
	}
	q.settle()
	return nil
}

// remove removes a waiter from anywhere in the queue in O(1) amortized.
func (q *waitQueue) remove(e *entry) {
	q.q[e.qidx] = nil
	q.dead++
	q.work++
	q.settle()
}

// settle trims nil slots at both ends, reuses the backing array once the
// queue is empty, and compacts a queue that is half holes.
func (q *waitQueue) settle() {
	for q.head < len(q.q) && q.q[q.head] == nil {
		q.head++
		q.dead--
		q.work++
	}
	for n := len(q.q); n > q.head && q.q[n-1] == nil; n-- {
		q.q = q.q[:n-1]
		q.dead--
		q.work++
	}
	switch {
	case q.head == len(q.q):
		if cap(q.q) > 4096 {
			q.q = nil // let a burst's backing array go
		} else {
			q.q = q.q[:0]
		}
		q.head = 0
	case len(q.q) >= 64 && 2*(q.head+q.dead) > len(q.q):
		q.compact()
	}
}

// compact moves the waiters to the front of the slice, in order.
func (q *waitQueue) compact() {
	n := 0
	q.work += uint64(len(q.q) - q.head)
	for _, e := range q.q[q.head:] {
		if e != nil {
			e.qidx = int32(n)
			q.q[n] = e
			n++
		}
	}
	clear(q.q[n:])
	q.q = q.q[:n]
	q.head, q.dead = 0, 0
}

// position is e's 1-based place in the queue: O(1) unless the queue has holes.
func (q *waitQueue) position(e *entry) int {
	if q.dead == 0 {
		return int(e.qidx) - q.head + 1
	}
	p := 1
	q.work += uint64(int(e.qidx) - q.head)
	for _, w := range q.q[q.head:e.qidx] {
		if w != nil {
			p++
		}
	}
	return p
}
