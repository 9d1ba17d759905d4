package etcd

import (
	"container/heap"
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// keeper keeps this server's session leases alive over LeaseKeepAlive
// streams of its own, and knows for each lease a moment before which etcd
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
// stream. The leases are spread over lanes, a stream each: etcd 3.4 makes
// every keepalive wait until it has applied the writes committed before
// it, one keepalive of a stream at a time, so while sessions open (writes)
// one stream was answered a few hundred times a second, too few for
// thousands of leases; the lanes' keepalives wait together
// (docs/BENCHMARKS.md, "Fleet scale on etcd").
type keeper struct {
	b     *Backend
	every time.Duration // a lease's keepalives are this far apart at least: a third of the TTL
	tick  time.Duration // how often the due leases are sent
	lanes []*lane

	sent, answers atomic.Uint64 // keepalives sent on the streams, and answered there
	checked       atomic.Uint64 // keepalives sent as checks
	stuck         atomic.Uint64 // streams ended because a keepalive held them up
	checks        chan struct{} // a token per check running
	kept          atomic.Int64  // leases kept, over the lanes
	heard         atomic.Int64  // etcd's last answer (unix ns), or when the first lease was kept since none were
	ttl           atomic.Int64  // the lease TTL etcd answered (ns; it may raise the one asked for)
}

// lanes is how many streams a keeper keeps its leases alive over.
const lanes = 16

// lane keeps the leases whose id falls to it alive over one stream.
type lane struct {
	k *keeper

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
	// lastWait is how long the lane's last answered keepalive waited, or
	// the oldest one on a stream etcd ended because its apply was behind;
	// lastAt when that was (lag).
	lastWait time.Duration
	lastAt   time.Time
}

type kept struct {
	id      int64
	last    time.Time // the last keepalive sent (or the grant or KeepAliveOnce that showed it alive)
	until   time.Time // etcd does not expire the lease before this
	next    time.Time // when its next keepalive is due, while in the queue
	waiting bool      // not in the queue: its keepalive is on the wire, or it is checked
	checked bool      // its keepalive is a KeepAliveOnce of its own (check)
	suspect bool      // its keepalive held its stream up: the next is a check
}

type wireSend struct {
	id int64
	at time.Time
}

func newKeeper(b *Backend) *keeper {
	every := max(100*time.Millisecond, time.Duration(b.graceTTL)*time.Second/3)
	k := &keeper{
		b:      b,
		every:  every,
		tick:   max(10*time.Millisecond, every/32),
		checks: make(chan struct{}, maxChecks),
	}
	for range lanes {
		k.lanes = append(k.lanes, &lane{k: k, leases: map[int64]*kept{}, onWire: map[int64]int{}})
	}
	return k
}

func (k *keeper) lane(lease int64) *lane { return k.lanes[uint64(lease)%uint64(len(k.lanes))] }

// add keeps lease alive from now on; sent is when the keepalive (or the
// grant) that showed it alive was sent, and until the moment it then
// stands to.
func (k *keeper) add(lease int64, sent, until time.Time) { k.lane(lease).add(lease, sent, until) }

// remove stops keeping lease alive: it runs out one TTL after its last
// keepalive unless another server keeps it.
func (k *keeper) remove(lease int64) { k.lane(lease).remove(lease) }

// until is the moment before which etcd cannot expire lease, zero when
// this server does not keep it alive.
func (k *keeper) until(lease int64) time.Time { return k.lane(lease).until(lease) }

// removeAll stops every keepalive (Close).
func (k *keeper) removeAll() {
	for _, l := range k.lanes {
		l.mu.Lock()
		k.kept.Add(-int64(len(l.leases)))
		clear(l.leases)
		l.queue = nil
		l.mu.Unlock()
	}
}

// heardAt notes that etcd answered at now.
func (k *keeper) heardAt(now time.Time) {
	for {
		old := k.heard.Load()
		if now.UnixNano() <= old || k.heard.CompareAndSwap(old, now.UnixNano()) {
			return
		}
	}
}

// answeredTTL notes the TTL etcd answered.
func (k *keeper) answeredTTL(ttl int64) {
	d := int64(time.Duration(ttl) * time.Second)
	for {
		old := k.ttl.Load()
		if d <= old || k.ttl.CompareAndSwap(old, d) {
			return
		}
	}
}

// silence reports how long etcd answered no keepalive of this server (nor
// its watch: Backend.health), and the leases' TTL; false when it keeps no
// lease alive. The keepalives of the kept leases go out at least every
// period, so a healthy etcd answers one that often: silence is etcd out of
// reach or stuck, not a slow lease (docs/DESIGN.md, "An etcd backend").
func (k *keeper) silence(now time.Time) (time.Duration, time.Duration, bool) {
	if k.kept.Load() <= 0 {
		return 0, 0, false
	}
	ttl := time.Duration(k.ttl.Load())
	if ttl == 0 {
		ttl = time.Duration(k.b.graceTTL) * time.Second
	}
	return now.Sub(time.Unix(0, k.heard.Load())), ttl, true
}

// lag is how late etcd is with this server's keepalives at now: the
// longest wait of a keepalive on the streams, or of a lane's last answered
// one (or of the oldest on a stream etcd ended, its apply behind) within
// the last period. The wait on the wire alone falls to nothing each time
// etcd 3.4 ends a stream whose keepalive waited a second for its apply,
// just when etcd is furthest behind; the last answer's wait stays until
// the next answer shows etcd caught up. Writes are held back by it
// (grouper.admit, sessions.make), so that the sessions that stand keep
// their leases first (docs/DESIGN.md, "Leases" in "An etcd backend").
// wait is the wait on the streams alone: how long the oldest keepalive on
// them has waited at now for its answer.
func (k *keeper) lag(now time.Time) (lag, wait time.Duration) {
	for _, l := range k.lanes {
		l.mu.Lock()
		if len(l.wire) > 0 {
			wait = max(wait, now.Sub(l.wire[0].at))
		}
		if now.Sub(l.lastAt) < k.every {
			lag = max(lag, l.lastWait)
		}
		l.mu.Unlock()
	}
	return max(lag, wait), wait
}

// run keeps the leases alive until the backend closes, a lane a stream.
func (k *keeper) run() {
	defer k.b.wg.Done()
	var wg sync.WaitGroup
	for _, l := range k.lanes {
		wg.Go(l.run)
	}
	wg.Wait()
}

func (l *lane) add(lease int64, sent, until time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if kl := l.leases[lease]; kl != nil {
		kl.until = later(kl.until, until)
		return
	}
	if l.k.kept.Add(1) == 1 {
		// Nothing was asked of etcd while nothing was kept.
		l.k.heardAt(time.Now())
	}
	kl := &kept{id: lease, last: sent, until: until, next: sent.Add(l.k.every)}
	if until.IsZero() {
		kl.next = time.Now() // not known alive: asked at once
	}
	l.leases[lease] = kl
	if l.onWire[lease] > 0 {
		// Kept again while its keepalive of before is on the wire: that
		// one's answer puts it back in the queue.
		kl.waiting = true
		return
	}
	heap.Push(&l.queue, kl)
}

func (l *lane) remove(lease int64) {
	l.mu.Lock()
	// Its queue entry, if any, is dropped when it comes up: the queue
	// holds only leases that are kept.
	if _, ok := l.leases[lease]; ok {
		delete(l.leases, lease)
		l.k.kept.Add(-1)
	}
	l.mu.Unlock()
}

func (l *lane) until(lease int64) time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	if kl := l.leases[lease]; kl != nil {
		return kl.until
	}
	return time.Time{}
}

// run keeps the lane's leases alive until the backend closes: it opens
// the stream, sends each lease's keepalive as it falls due, and opens the
// stream again when it breaks.
func (ln *lane) run() {
	for ln.k.b.ctx.Err() == nil {
		ln.stream()
		select {
		case <-ln.k.b.ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// errOutOfOrder ends a stream whose answer is not for the oldest send on
// it: the pairing of answers with sends would be lost.
var errOutOfOrder = errors.New("etcd backend: a keepalive answered out of order")

// stream keeps the leases alive over one LeaseKeepAlive stream until it
// breaks or the backend closes.
func (ln *lane) stream() {
	ctx, cancel := context.WithCancel(ln.k.b.ctx)
	defer cancel()
	st, err := pb.NewLeaseClient(ln.k.b.cli.ActiveConnection()).LeaseKeepAlive(ctx)
	if err != nil {
		return
	}
	// Sends lost with a broken stream are never answered: forget them,
	// which only makes until earlier than it could be, and send again at
	// once on the next stream.
	defer ln.broken()
	recvDone := make(chan struct{})
	go func() {
		defer close(recvDone)
		defer cancel()
		for {
			resp, err := st.Recv()
			if err != nil {
				if errors.Is(rpctypes.Error(err), rpctypes.ErrTimeoutWaitAppliedIndex) {
					// etcd answered: it is there, behind with its
					// writes (etcd 3.4 holds a keepalive until it has
					// applied what it committed before it).
					ln.k.heardAt(time.Now())
					ln.behind(time.Now())
				}
				if ctx.Err() == nil {
					ln.k.b.log.Warn("etcd backend: the keepalive stream ended", "err", err)
				}
				return
			}
			if err := ln.answered(resp, time.Now()); err != nil {
				ln.k.b.log.Warn("etcd backend: the keepalive stream ends", "err", err)
				return
			}
		}
	}()
	defer func() { cancel(); <-recvDone }()
	t := time.NewTicker(ln.k.tick)
	defer t.Stop()
	var ids, checks []int64
	for {
		if ln.stuck(time.Now()) {
			return // its sends are sent again on the next stream
		}
		ids, checks = ln.due(ids[:0], checks[:0], time.Now())
		for _, id := range checks {
			ln.check(ctx, id)
		}
		for _, id := range ids {
			if err := st.Send(&pb.LeaseKeepAliveRequest{ID: id}); err != nil {
				return
			}
			ln.k.sent.Add(1)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// stuck reports whether the oldest keepalive on the wire has waited a
// period at now, for a lease that may have run out (past the moment it was
// known to stand until, or never known: a session that moved here): etcd
// answers a stream's keepalives one at a time, and holds one of a lease
// that ran out (not yet revoked) until the revoke is applied, every
// keepalive behind it with it. That lease is checked on its own from now
// on, the stream ended, and its other sends sent again.
func (ln *lane) stuck(now time.Time) bool {
	ln.mu.Lock()
	defer ln.mu.Unlock()
	if len(ln.wire) == 0 || now.Sub(ln.wire[0].at) < ln.k.every {
		return false
	}
	l := ln.leases[ln.wire[0].id]
	if l != nil && l.until.After(now) {
		return false // it stands: etcd is slow, not held up by it
	}
	if l != nil {
		l.suspect = true
	}
	ln.k.stuck.Add(1)
	return true
}

// behind notes, at now, that etcd ended the stream because its apply was
// behind: the oldest keepalive on it waited that long (lag).
func (ln *lane) behind(now time.Time) {
	ln.mu.Lock()
	defer ln.mu.Unlock()
	if len(ln.wire) > 0 {
		ln.lastWait, ln.lastAt = now.Sub(ln.wire[0].at), now
	}
}

// broken forgets the sends of a stream that ended: every kept lease is due
// at once on the next.
func (ln *lane) broken() {
	ln.mu.Lock()
	defer ln.mu.Unlock()
	ln.wire = nil
	clear(ln.onWire)
	now := time.Now()
	for _, l := range ln.leases {
		if l.waiting && !l.checked {
			l.waiting, l.next = false, now
			heap.Push(&ln.queue, l)
		}
	}
}

// due appends to ids the leases whose keepalive is due at now, oldest due
// first, and notes them as sent at now. A lease that held its stream up
// (stuck) goes to checks instead: etcd holds a keepalive of a lease that
// ran out until it has revoked it, and every keepalive behind it on the
// stream with it. Only such a lease: a check is a stream of its own, and
// sending every lease past the moment it was known to stand until that
// way (after etcd was slow a while) asked etcd for thousands.
func (ln *lane) due(ids, checks []int64, now time.Time) ([]int64, []int64) {
	ln.mu.Lock()
	defer ln.mu.Unlock()
	for len(ln.queue) > 0 && !ln.queue[0].next.After(now) {
		l := heap.Pop(&ln.queue).(*kept)
		if ln.leases[l.id] != l {
			continue // removed since
		}
		l.waiting = true
		if ln.onWire[l.id] > 0 {
			continue // its answer puts it back
		}
		l.last = now
		if l.suspect {
			l.checked = true
			checks = append(checks, l.id)
			continue
		}
		ln.wire = append(ln.wire, wireSend{l.id, now})
		ln.onWire[l.id]++
		ids = append(ids, l.id)
	}
	return ids, checks
}

// check keeps lease alive with a KeepAliveOnce of its own, at most
// maxChecks at once, and queues its next keepalive on the stream: not
// when etcd no longer has it (the watch ends its session).
func (ln *lane) check(ctx context.Context, lease int64) {
	ln.k.b.wg.Add(1)
	go func() {
		defer ln.k.b.wg.Done()
		select {
		case ln.k.checks <- struct{}{}:
			defer func() { <-ln.k.checks }()
		case <-ctx.Done():
		}
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		sent := time.Now()
		ln.k.checked.Add(1)
		ka, err := ln.k.b.cli.KeepAliveOnce(cctx, clientv3.LeaseID(lease))
		cancel()
		now := time.Now()
		gone := errors.Is(err, rpctypes.ErrLeaseNotFound)
		if err == nil || gone {
			ln.k.heardAt(now)
		}
		ln.mu.Lock()
		defer ln.mu.Unlock()
		l := ln.leases[lease]
		if l == nil || !l.checked {
			return
		}
		l.checked, l.suspect = false, false
		if gone {
			return // stays out of the queue
		}
		if err == nil && ka.TTL > 0 {
			l.until = later(l.until, sent.Add(time.Duration(ka.TTL)*time.Second))
			ln.k.answeredTTL(ka.TTL)
		}
		l.waiting, l.next = false, now
		if err == nil {
			l.next = sent.Add(ln.k.every)
		}
		heap.Push(&ln.queue, l)
	}()
}

// maxChecks bounds the KeepAliveOnce calls of check at once.
const maxChecks = 8

// answered pairs an answer, heard at now, with the oldest send on the
// wire, and queues the lease's next keepalive.
func (ln *lane) answered(resp *pb.LeaseKeepAliveResponse, now time.Time) error {
	ln.mu.Lock()
	if len(ln.wire) == 0 || ln.wire[0].id != resp.ID {
		ln.mu.Unlock()
		return errOutOfOrder
	}
	sent := ln.wire[0].at
	ln.lastWait, ln.lastAt = now.Sub(sent), now
	ln.wire[0] = wireSend{}
	ln.wire = ln.wire[1:]
	if ln.onWire[resp.ID]--; ln.onWire[resp.ID] <= 0 {
		delete(ln.onWire, resp.ID)
	}
	if l := ln.leases[resp.ID]; l != nil {
		if resp.TTL > 0 {
			l.until = later(l.until, sent.Add(time.Duration(resp.TTL)*time.Second))
		}
		// A lease etcd no longer has (TTL 0) is not asked about again:
		// the watch ends its session, and with it this keep.
		if l.waiting && resp.TTL > 0 {
			l.waiting, l.next = false, l.last.Add(ln.k.every)
			heap.Push(&ln.queue, l)
		}
	}
	ln.k.answers.Add(1)
	// Any answer shows etcd alive, a lease's end too (health).
	ln.k.heardAt(now)
	ln.k.answeredTTL(resp.TTL)
	ln.mu.Unlock()
	return nil
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
