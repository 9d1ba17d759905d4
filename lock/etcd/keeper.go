package etcd

import (
	"container/heap"
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

// keeper keeps this server's session leases alive over one LeaseKeepAlive
// stream of its own, and knows for each lease a moment before which etcd
// cannot expire it: the send time of its newest answered keepalive plus the
// TTL answered (docs/DESIGN.md, "Leases"). That moment is what lets the
// server tell a client how long its session is sure to stand. clientv3's
// KeepAlive does not say when it sent the keepalive an answer is for, and
// keeps a goroutine per lease; etcd answers the keepalives of one stream
// in the order they were sent, one at a time, so the sends on the wire,
// oldest first, pair every answer with its request.
//
// What it asks of etcd stays bounded however slowly etcd answers: a lease
// has at most one keepalive on the wire, and its next one falls due a
// period after that one was sent, once it was answered. Leases are sent in
// the order they fall due, a few at each of many ticks per period, so that
// sessions opened together do not stay a burst. Sending a lease again
// before its answer came would only queue behind that answer on the same
// stream: etcd 3.4 makes each keepalive wait until it has applied every
// write committed before it, so while sessions open (writes) it may answer
// a few hundred a second, and a keeper that sent a keepalive per lease per
// period whatever came back piled up thousands, answered so late that
// etcd let their leases go (docs/BENCHMARKS.md, "Fleet scale on etcd").
type keeper struct {
	b     *Backend
	every time.Duration // a lease's keepalives are this far apart at least: a third of the TTL
	tick  time.Duration // how often the due leases are sent

	sent, answers atomic.Uint64 // keepalives sent, and answered

	mu     sync.Mutex
	leases map[int64]*kept
	queue  keptHeap // the kept leases with no keepalive on the wire, by when the next is due
	// wire are the keepalives sent on the current stream and not yet
	// answered, oldest first; onWire counts them per lease, whether or
	// not the lease is kept still: a lease removed and kept again while
	// one was on the wire gets its answer, which must be paired with that
	// send, not a later one, and no second send.
	wire   []wireSend
	onWire map[int64]int
	heard  time.Time     // etcd's last answer, or when the first lease was kept since none were
	ttl    time.Duration // the lease TTL etcd answered (it may raise the one asked for)
}

type kept struct {
	id      int64
	last    time.Time // the last keepalive sent (or the grant or KeepAliveOnce that showed it alive)
	until   time.Time // etcd does not expire the lease before this
	next    time.Time // when its next keepalive is due, while in the queue
	waiting bool      // not in the queue: its keepalive is on the wire
}

type wireSend struct {
	id int64
	at time.Time
}

func newKeeper(b *Backend) *keeper {
	every := max(100*time.Millisecond, time.Duration(b.graceTTL)*time.Second/3)
	return &keeper{
		b:      b,
		every:  every,
		tick:   max(10*time.Millisecond, every/32),
		leases: map[int64]*kept{},
		onWire: map[int64]int{},
	}
}

// add keeps lease alive from now on; sent is when the keepalive (or the
// grant) that showed it alive was sent, and until the moment it then
// stands to.
func (k *keeper) add(lease int64, sent, until time.Time) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if l := k.leases[lease]; l != nil {
		l.until = later(l.until, until)
		return
	}
	if len(k.leases) == 0 {
		// Nothing was asked of etcd while nothing was kept.
		k.heard = later(k.heard, time.Now())
	}
	l := &kept{id: lease, last: sent, until: until, next: sent.Add(k.every)}
	k.leases[lease] = l
	if k.onWire[lease] > 0 {
		// Kept again while its keepalive of before is on the wire: that
		// one's answer puts it back in the queue.
		l.waiting = true
		return
	}
	heap.Push(&k.queue, l)
}

// remove stops keeping lease alive: it runs out one TTL after its last
// keepalive unless another server keeps it.
func (k *keeper) remove(lease int64) {
	k.mu.Lock()
	// Its queue entry, if any, is dropped when it comes up: the queue
	// holds only leases that are kept.
	delete(k.leases, lease)
	k.mu.Unlock()
}

// removeAll stops every keepalive (Close).
func (k *keeper) removeAll() {
	k.mu.Lock()
	clear(k.leases)
	k.queue = nil
	k.mu.Unlock()
}

// until is the moment before which etcd cannot expire lease, zero when
// this server does not keep it alive.
func (k *keeper) until(lease int64) time.Time {
	k.mu.Lock()
	defer k.mu.Unlock()
	if l := k.leases[lease]; l != nil {
		return l.until
	}
	return time.Time{}
}

// run keeps the leases alive until the backend closes: it opens the
// stream, sends each lease's keepalive as it falls due, and opens the
// stream again when it breaks.
func (k *keeper) run() {
	defer k.b.wg.Done()
	for k.b.ctx.Err() == nil {
		k.stream()
		select {
		case <-k.b.ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// errOutOfOrder ends a stream whose answer is not for the oldest send on
// it: the pairing of answers with sends would be lost.
var errOutOfOrder = errors.New("etcd backend: a keepalive answered out of order")

// stream keeps the leases alive over one LeaseKeepAlive stream until it
// breaks or the backend closes.
func (k *keeper) stream() {
	ctx, cancel := context.WithCancel(k.b.ctx)
	defer cancel()
	st, err := pb.NewLeaseClient(k.b.cli.ActiveConnection()).LeaseKeepAlive(ctx)
	if err != nil {
		return
	}
	// Sends lost with a broken stream are never answered: forget them,
	// which only makes until earlier than it could be, and send again at
	// once on the next stream.
	defer k.broken()
	recvDone := make(chan struct{})
	go func() {
		defer close(recvDone)
		defer cancel()
		for {
			resp, err := st.Recv()
			if err != nil {
				return
			}
			if err := k.answered(resp, time.Now()); err != nil {
				k.b.log.Warn("etcd backend: the keepalive stream ends", "err", err)
				return
			}
		}
	}()
	defer func() { <-recvDone }()
	t := time.NewTicker(k.tick)
	defer t.Stop()
	var ids []int64
	for {
		ids = k.due(ids[:0], time.Now())
		for _, id := range ids {
			if err := st.Send(&pb.LeaseKeepAliveRequest{ID: id}); err != nil {
				return
			}
			k.sent.Add(1)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// broken forgets the sends of a stream that ended: every kept lease is due
// at once on the next.
func (k *keeper) broken() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.wire = nil
	clear(k.onWire)
	now := time.Now()
	for _, l := range k.leases {
		if l.waiting {
			l.waiting, l.next = false, now
			heap.Push(&k.queue, l)
		}
	}
}

// due appends to ids the leases whose keepalive is due at now, oldest due
// first, and notes them as sent at now.
func (k *keeper) due(ids []int64, now time.Time) []int64 {
	k.mu.Lock()
	defer k.mu.Unlock()
	for len(k.queue) > 0 && !k.queue[0].next.After(now) {
		l := heap.Pop(&k.queue).(*kept)
		if k.leases[l.id] != l {
			continue // removed since
		}
		l.waiting = true
		if k.onWire[l.id] > 0 {
			continue // its answer puts it back
		}
		l.last = now
		k.wire = append(k.wire, wireSend{l.id, now})
		k.onWire[l.id]++
		ids = append(ids, l.id)
	}
	return ids
}

// answered pairs an answer, heard at now, with the oldest send on the
// wire, and queues the lease's next keepalive.
func (k *keeper) answered(resp *pb.LeaseKeepAliveResponse, now time.Time) error {
	k.mu.Lock()
	if len(k.wire) == 0 || k.wire[0].id != resp.ID {
		k.mu.Unlock()
		return errOutOfOrder
	}
	sent := k.wire[0].at
	k.wire[0] = wireSend{}
	k.wire = k.wire[1:]
	if k.onWire[resp.ID]--; k.onWire[resp.ID] <= 0 {
		delete(k.onWire, resp.ID)
	}
	if l := k.leases[resp.ID]; l != nil {
		if resp.TTL > 0 {
			l.until = later(l.until, sent.Add(time.Duration(resp.TTL)*time.Second))
		}
		// A lease etcd no longer has (TTL 0) is not asked about again:
		// the watch ends its session, and with it this keep.
		if l.waiting && resp.TTL > 0 {
			l.waiting, l.next = false, l.last.Add(k.every)
			heap.Push(&k.queue, l)
		}
	}
	k.answers.Add(1)
	// Any answer shows etcd alive, a lease's end too (health).
	k.heard = later(k.heard, now)
	k.ttl = max(k.ttl, time.Duration(resp.TTL)*time.Second)
	k.mu.Unlock()
	return nil
}

// silence reports how long etcd answered no keepalive of this server, and
// the leases' TTL; false when it keeps no lease alive. The keepalives of
// the kept leases go out at least every period, so a healthy etcd answers
// one that often: silence is etcd out of reach or stuck, not a slow lease
// (docs/DESIGN.md, "An etcd backend").
func (k *keeper) silence(now time.Time) (time.Duration, time.Duration, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if len(k.leases) == 0 {
		return 0, 0, false
	}
	ttl := k.ttl
	if ttl == 0 {
		ttl = time.Duration(k.b.graceTTL) * time.Second
	}
	return now.Sub(k.heard), ttl, true
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// keptHeap orders kept leases by when their next keepalive is due.
type keptHeap []*kept

func (h keptHeap) Len() int           { return len(h) }
func (h keptHeap) Less(i, j int) bool { return h[i].next.Before(h[j].next) }
func (h keptHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *keptHeap) Push(x any)        { *h = append(*h, x.(*kept)) }
func (h *keptHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return x
}
