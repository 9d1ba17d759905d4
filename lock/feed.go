package lock

import (
	"sync"
	"sync/atomic"
)

// FeedQueue is the bounded queue behind every Feed: both engines' session
// streams and observers, and the operators' feed, embed one and add only
// what their Close must undo. It holds at most limit items: Offer refuses
// one more, and the owner ends the feed as slow (docs/DESIGN.md, "Slow
// streams"). The queue is a slice, not a buffered channel, so that an idle
// feed of the thousands a server keeps costs a few bytes, not limit slots;
// and its channels are made when first asked for: a server that takes
// items through Notify and looks at Ended (docs/DESIGN.md, "Event
// streams") never asks, and a channel is some 100 bytes.
// The zero value is not usable: call Init first.
type FeedQueue[T any] struct {
	limit int
	slow  atomic.Bool

	mu     sync.Mutex
	ready  chan struct{} // nil until Ready; holds a token while queue is not empty
	done   chan struct{} // nil until Done; closed by End
	queue  []T
	notify func() // Notify's f
	ended  bool   // End was called
}

// closedChan is the Done of every feed that ended before Done was asked
// for.
var closedChan = func() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}()

// Init readies q to hold at most limit items.
func (q *FeedQueue[T]) Init(limit int) {
	q.limit = limit
}

// Ready receives when items are waiting to be taken.
func (q *FeedQueue[T]) Ready() <-chan struct{} {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.ready == nil {
		q.ready = make(chan struct{}, 1)
		if len(q.queue) > 0 {
			q.ready <- struct{}{}
		}
	}
	return q.ready
}

// Done is closed when the feed ended (End).
func (q *FeedQueue[T]) Done() <-chan struct{} {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.done == nil {
		if q.ended {
			return closedChan
		}
		q.done = make(chan struct{})
	}
	return q.done
}

// Ended reports whether the feed ended (End): Done is closed.
func (q *FeedQueue[T]) Ended() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.ended
}

// Slow reports whether the feed was marked as not keeping up.
func (q *FeedQueue[T]) Slow() bool { return q.slow.Load() }

// Take appends the waiting items, in order, to buf and returns it.
func (q *FeedQueue[T]) Take(buf []T) []T {
	q.mu.Lock()
	buf = append(buf, q.queue...)
	clear(q.queue)
	if cap(q.queue) > 64 {
		q.queue = nil // let a burst's backing array go
	} else {
		q.queue = q.queue[:0]
	}
	q.mu.Unlock()
	return buf
}

// Notify makes the feed also call f when items start waiting and when it
// ends; at once when either is already so.
func (q *FeedQueue[T]) Notify(f func()) {
	q.mu.Lock()
	q.notify = f
	now := len(q.queue) > 0 || q.ended
	q.mu.Unlock()
	if now {
		f()
	}
}

// Offer queues v. It reports false, queueing nothing, when limit items are
// waiting already: the owner then ends the feed as slow, never waits for
// it. An ended feed drops v and reports true.
func (q *FeedQueue[T]) Offer(v T) bool {
	q.mu.Lock()
	if q.ended {
		q.mu.Unlock()
		return true
	}
	if len(q.queue) >= q.limit {
		q.mu.Unlock()
		return false
	}
	q.queue = append(q.queue, v)
	var notify func()
	if len(q.queue) == 1 {
		notify = q.notify
	}
	ready := q.ready
	q.mu.Unlock()
	if ready != nil {
		select {
		case ready <- struct{}{}:
		default:
		}
	}
	if notify != nil {
		notify()
	}
	return true
}

// MarkSlow records that the feed did not keep up; it reports true to the
// first caller only, which counts and logs it once.
func (q *FeedQueue[T]) MarkSlow() bool { return q.slow.CompareAndSwap(false, true) }

// End closes Done and calls Notify's f. It reports true to the first caller
// only; later calls do nothing.
func (q *FeedQueue[T]) End() bool {
	q.mu.Lock()
	if q.ended {
		q.mu.Unlock()
		return false
	}
	q.ended = true
	notify := q.notify
	if q.done != nil {
		close(q.done)
	}
	q.mu.Unlock()
	if notify != nil {
		notify()
	}
	return true
}
