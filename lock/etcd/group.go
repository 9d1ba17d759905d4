package etcd

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/lock"
)

// Transactions of different keys that are ready at the same moment share
// one etcd request: each is a transaction nested in the Then of a request
// with no guards of its own (etcd ≥ 3.3), keeping its own guards and
// succeeding or failing alone, while one raft entry, one fsync and one
// apply serve them all (docs/DESIGN.md, "Fewer, larger transactions").
//
// etcd evaluates every nested transaction's guards against the state before
// the request and then applies the writes in order, so a group is as if its
// transactions ran one after the other only in an order where none reads a
// key an earlier one writes. A group therefore has:
//   - no key written twice (etcd refuses that anyway);
//   - no transaction that both reads a key another member writes and writes
//     a key another member reads, which is what could close a cycle: each
//     member added has edges one way only, so the group stays a partial
//     order, and the request lists it readers first (order).
//
// Two requests are in flight at most: while they are, what arrives waits
// and leaves together in the next one. An idle server sends each
// transaction at once, alone, as before. A request etcd has not answered
// within groupStall no longer counts: an etcd member that holds every
// request sent to it (frozen, or behind a path that drops packets) holds
// the transactions of the requests that reached it, not every one of the
// server's behind them (TestAttackGroupHungRequest).

const (
	// groupMax bounds the transactions of one request, hence the
	// transitions of one revision: idsPerRev has room for that many.
	groupMax = idsPerRev / idsPerChange
	// groupOps bounds the guards and operations of one request, nested ones
	// counted; one transaction with more than groupSubOps goes alone, as
	// etcd allows a nested transaction maxTxnOps (128) less the number of
	// its siblings.
	groupOps    = 1024
	groupSubOps = 128 - groupMax
	// groupBytes bounds the keys and values of one request, well under
	// etcd's default 1.5 MiB request limit.
	groupBytes = 512 << 10
	// groupFlight is the number of requests in flight at once, not
	// counting those etcd has not answered within groupStall: tens of an
	// etcd's usual commit (a few ms), a few of one on a slow disk.
	groupFlight = 2
	groupStall  = 100 * time.Millisecond
)

// span is a key or, with end set, the range [key, end).
type span struct{ key, end []byte }

// has reports whether key k is in s: s's key alone when s has no end;
// every key from s's key on when its end is "\x00" (WithFromKey).
func (s span) has(k []byte) bool {
	switch {
	case len(s.end) == 0:
		return bytes.Equal(k, s.key)
	case len(s.end) == 1 && s.end[0] == 0:
		return bytes.Compare(k, s.key) >= 0
	}
	return bytes.Compare(k, s.key) >= 0 && bytes.Compare(k, s.end) < 0
}

// overlaps reports whether s and o share a key; it allocates nothing, as
// take calls it under the grouper's mutex for every pair of transactions.
func (s span) overlaps(o span) bool {
	switch {
	case len(s.end) == 0:
		return o.has(s.key)
	case len(o.end) == 0:
		return s.has(o.key)
	}
	// Two ranges share a key when one begins inside the other.
	return s.has(o.key) || o.has(s.key)
}

// pending is one transaction waiting for, or in, a request.
type pending struct {
	cmps   []clientv3.Cmp
	ops    []clientv3.Op
	reads  []span
	writes []span
	size   int // guards and operations
	bytes  int
	alone  bool

	ready chan struct{} // closed with the outcome
	taken bool          // in a request: its outcome is etcd's, not the caller's
	ok    bool
	rev   int64
	err   error
}

func newPending(cmps []clientv3.Cmp, ops []clientv3.Op) *pending {
	p := &pending{cmps: cmps, ops: ops, ready: make(chan struct{}), size: len(cmps) + len(ops)}
	for i := range cmps {
		c := cmps[i].GetCompare()
		p.reads = append(p.reads, span{c.Key, c.RangeEnd})
		p.bytes += len(c.Key) + len(c.RangeEnd)
	}
	for _, op := range ops {
		s := span{op.KeyBytes(), op.RangeBytes()}
		p.bytes += len(s.key) + len(s.end) + len(op.ValueBytes())
		switch {
		case op.IsPut(), op.IsDelete():
			p.writes = append(p.writes, s)
		case op.IsGet():
			p.reads = append(p.reads, s)
		default:
			p.alone = true // a nested transaction of its own: not grouped
		}
	}
	if max(len(cmps), len(ops)) > groupSubOps || p.bytes > groupBytes {
		p.alone = true
	}
	return p
}

// grouper queues transactions and sends them in groups.
type grouper struct {
	b      *Backend
	signal chan struct{} // a request can go: something waits

	mu sync.Mutex
	q  []*pending

	// hold, when set (tests), runs before each request is sent.
	hold atomic.Pointer[func()]

	// requests counts the requests sent, grouped those of more than one
	// transaction, txns the transactions they carried, and stalled those
	// etcd had not answered within groupStall.
	requests, grouped, txns, stalled atomic.Uint64
}

func newGrouper(b *Backend) *grouper {
	return &grouper{b: b, signal: make(chan struct{}, groupFlight)}
}

// commit applies ops if every guard in cmps holds, in a request it may share
// with other transactions: ok false when a guard failed. The request's
// revision is rev. A caller whose ctx ends before its transaction is sent
// gets ctx's error and nothing is written; after, it gets ctx's error at
// once and the transaction may or may not apply, as with a cancelled etcd
// call.
//
// alone keeps the transaction out of groups: one that attaches a key to a
// lease, since etcd refuses a whole request for a lease it no longer has.
func (g *grouper) commit(ctx context.Context, cmps []clientv3.Cmp, ops []clientv3.Op, alone bool) (rev int64, ok bool, err error) {
	p := newPending(cmps, ops)
	p.alone = p.alone || alone
	g.mu.Lock()
	g.q = append(g.q, p)
	g.mu.Unlock()
	select {
	case g.signal <- struct{}{}:
	default: // as many signals wait as requests can go: one will take p
	}
	select {
	case <-p.ready:
		return p.rev, p.ok, p.err
	case <-ctx.Done():
		g.mu.Lock()
		if !p.taken {
			g.q = removePending(g.q, p)
		}
		g.mu.Unlock()
		return 0, false, g.b.etcdErr("transaction", ctx.Err())
	}
}

func removePending(l []*pending, p *pending) []*pending {
	for i, d := range l {
		if d == p {
			return append(l[:i:i], l[i+1:]...)
		}
	}
	return l
}

// run sends requests until the backend closes; groupFlight of them run.
func (g *grouper) run() {
	defer g.b.wg.Done()
	for {
		select {
		case <-g.b.ctx.Done():
			g.mu.Lock()
			q := g.q
			g.q = nil
			for _, p := range q {
				p.taken = true
			}
			g.mu.Unlock()
			for _, p := range q {
				p.err = lock.ErrClosed
				close(p.ready)
			}
			return
		case <-g.signal:
		}
		for {
			group := g.take()
			if len(group) == 0 {
				break
			}
			if ordered, ok := order(group); ok {
				g.dispatch(ordered)
				continue
			}
			// joins keeps a group free of cycles; were there one, the
			// request would not be as if serial: each goes alone.
			for _, p := range group {
				g.dispatch([]*pending{p})
			}
		}
	}
}

// take removes from the queue the oldest transaction and every later one
// that may join it, in the order the request must list them.
func (g *grouper) take() []*pending {
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.q) == 0 {
		return nil
	}
	group := []*pending{g.q[0]}
	size, size8 := g.q[0].size, g.q[0].bytes
	rest := g.q[1:1]
	for i, p := range g.q[1:] {
		full := len(group) == groupMax || size >= groupOps || size8 >= groupBytes
		if full || group[0].alone {
			rest = append(rest, g.q[1+i:]...)
			break
		}
		if p.alone || size+p.size > groupOps || size8+p.bytes > groupBytes || !joins(group, p) {
			rest = append(rest, p)
			continue
		}
		group = append(group, p)
		size += p.size
		size8 += p.bytes
	}
	g.q = rest
	for _, p := range group {
		p.taken = true
	}
	if len(g.q) > 0 {
		select {
		case g.signal <- struct{}{}: // the other request slot takes the rest
		default:
		}
	}
	return group
}

// joins says whether p may join group: it writes no key a member writes,
// and does not both read a member's write and write a member's read.
func joins(group []*pending, p *pending) bool {
	before, after := false, false // p must come before, after, a member
	for _, m := range group {
		if anyOverlap(p.writes, m.writes) {
			return false
		}
		if anyOverlap(p.reads, m.writes) {
			before = true
		}
		if anyOverlap(p.writes, m.reads) {
			after = true
		}
		if before && after {
			return false
		}
	}
	return true
}

func anyOverlap(a, b []span) bool {
	for _, x := range a {
		for _, y := range b {
			if x.overlaps(y) {
				return true
			}
		}
	}
	return false
}

// order lists group so that a transaction that reads a key comes before the
// one that writes it (the group is a partial order: joins), otherwise in
// arrival order; ok false if there is no such order.
func order(group []*pending) (out []*pending, ok bool) {
	n := len(group)
	if n == 1 {
		return group, true
	}
	// before[i][j]: i reads what j writes, so i goes first.
	indeg := make([]int, n)
	edges := make([][]int, n)
	for i := range group {
		for j := range group {
			if i != j && anyOverlap(group[i].reads, group[j].writes) {
				edges[i] = append(edges[i], j)
				indeg[j]++
			}
		}
	}
	out = make([]*pending, 0, n)
	done := make([]bool, n)
	for len(out) < n {
		progressed := false
		for i := 0; i < n; i++ {
			if done[i] || indeg[i] > 0 {
				continue
			}
			done[i] = true
			out = append(out, group[i])
			for _, j := range edges[i] {
				indeg[j]--
			}
			progressed = true
			break
		}
		if !progressed {
			return nil, false
		}
	}
	return out, true
}

// dispatch sends group and waits for etcd's answer, or for groupStall,
// after which the request goes on alone and its slot takes the next one.
func (g *grouper) dispatch(group []*pending) {
	if h := g.hold.Load(); h != nil {
		(*h)()
	}
	done := make(chan struct{})
	g.b.wg.Add(1) // this runner counts too: Close's Wait has not returned
	go func() {
		defer g.b.wg.Done()
		defer close(done)
		g.send(group)
	}()
	t := time.NewTimer(groupStall)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		g.stalled.Add(1)
	}
}

// send makes one request of group and hands each transaction its outcome.
func (g *grouper) send(group []*pending) {
	b := g.b
	ctx, cancel := context.WithTimeout(b.ctx, callTimeout)
	defer cancel()
	g.requests.Add(1)
	g.txns.Add(uint64(len(group)))
	if len(group) == 1 {
		p := group[0]
		resp, err := b.cli.Txn(ctx).If(p.cmps...).Then(p.ops...).Commit()
		if err = g.err(ctx, err); err != nil {
			p.err = err
		} else {
			p.ok, p.rev = resp.Succeeded, resp.Header.Revision
		}
		close(p.ready)
		return
	}
	g.grouped.Add(1)
	nested := make([]clientv3.Op, len(group))
	for i, p := range group {
		nested[i] = clientv3.OpTxn(p.cmps, p.ops, nil)
	}
	resp, err := b.cli.Txn(ctx).Then(nested...).Commit()
	if err == nil && len(resp.Responses) != len(group) {
		err = fmt.Errorf("etcd backend: %d answers to a request of %d transactions", len(resp.Responses), len(group))
	}
	err = g.err(ctx, err)
	for i, p := range group {
		if err != nil {
			p.err = err
		} else {
			p.rev = resp.Header.Revision
			p.ok = resp.Responses[i].GetResponseTxn().GetSucceeded()
		}
		close(p.ready)
	}
}

// err is the error of a request made with ctx: an etcd that did not answer
// within callTimeout is unavailable, as for a call's own request (bound).
func (g *grouper) err(ctx context.Context, err error) error {
	b := g.b
	switch {
	case err == nil:
		return nil
	case ctx.Err() != nil && b.ctx.Err() == nil:
		return fmt.Errorf("%w: etcd did not answer within %v", lock.ErrUnavailable, callTimeout)
	}
	return b.etcdErr("transaction", err)
}
