package etcd

import (
	"context"
	"sync"
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
// in the order they were sent, one at a time, so a queue of send times per
// lease pairs every answer with its request.
type keeper struct {
	b     *Backend
	every time.Duration // a keepalive per lease this often: a third of the TTL

	mu     sync.Mutex
	leases map[int64]*kept
	// sent are the keepalives sent on the current stream and not yet
	// answered, oldest first, per lease, whether or not the lease is kept
	// still: a lease removed and kept again while one was on the wire
	// gets its answer, which must be paired with that send, not a later
	// one.
	sent map[int64][]time.Time
}

type kept struct {
	last  time.Time // the last keepalive sent
	until time.Time // etcd does not expire the lease before this
}

func newKeeper(b *Backend) *keeper {
	return &keeper{
		b:      b,
		every:  max(100*time.Millisecond, time.Duration(b.graceTTL)*time.Second/3),
		leases: map[int64]*kept{},
		sent:   map[int64][]time.Time{},
	}
}

// add keeps lease alive from now on; sent is when the keepalive that
// showed it alive was sent, and until the moment it then stands to.
func (k *keeper) add(lease int64, sent, until time.Time) {
	k.mu.Lock()
	if l := k.leases[lease]; l != nil {
		l.until = later(l.until, until)
	} else {
		k.leases[lease] = &kept{last: sent, until: until}
	}
	k.mu.Unlock()
}

// remove stops keeping lease alive: it runs out one TTL after its last
// keepalive unless another server keeps it.
func (k *keeper) remove(lease int64) {
	k.mu.Lock()
	delete(k.leases, lease)
	k.mu.Unlock()
}

// removeAll stops every keepalive (Close).
func (k *keeper) removeAll() {
	k.mu.Lock()
	clear(k.leases)
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
// stream, sends every lease's keepalive every third of the TTL, and opens
// the stream again when it breaks.
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
	defer func() {
		k.mu.Lock()
		clear(k.sent)
		for _, l := range k.leases {
			l.last = time.Time{}
		}
		k.mu.Unlock()
	}()
	recvDone := make(chan struct{})
	go func() {
		defer close(recvDone)
		defer cancel()
		for {
			resp, err := st.Recv()
			if err != nil {
				return
			}
			k.answered(resp)
		}
	}()
	defer func() { <-recvDone }()
	// Each lease is due every k.every; looking four times as often
	// spreads the leases added at different moments over the period.
	t := time.NewTicker(k.every / 4)
	defer t.Stop()
	var ids []int64
	for {
		ids = k.due(ids[:0], time.Now())
		for _, id := range ids {
			if err := st.Send(&pb.LeaseKeepAliveRequest{ID: id}); err != nil {
				return
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// due appends to ids the leases whose keepalive is due at now, and notes
// it as sent at now.
func (k *keeper) due(ids []int64, now time.Time) []int64 {
	k.mu.Lock()
	defer k.mu.Unlock()
	for id, l := range k.leases {
		// A lease whose sends pile up unanswered gets no more
		// until etcd answers: the stream is stuck, not the lease.
		if now.Sub(l.last) >= k.every && len(k.sent[id]) < 8 {
			k.sent[id] = append(k.sent[id], now)
			l.last = now
			ids = append(ids, id)
		}
	}
	return ids
}

// answered pairs an answer with the oldest send of its lease.
func (k *keeper) answered(resp *pb.LeaseKeepAliveResponse) {
	k.mu.Lock()
	q := k.sent[resp.ID]
	if len(q) == 0 {
		k.mu.Unlock()
		return
	}
	sent := q[0]
	if q = q[1:]; len(q) == 0 {
		delete(k.sent, resp.ID)
	} else {
		k.sent[resp.ID] = q
	}
	l := k.leases[resp.ID]
	if l != nil && resp.TTL > 0 {
		l.until = later(l.until, sent.Add(time.Duration(resp.TTL)*time.Second))
	}
	k.mu.Unlock()
	if resp.TTL > 0 {
		k.b.s.answered(resp.TTL)
	}
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
