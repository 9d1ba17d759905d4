package etcd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
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
//
// The lock path gives way to the sessions' keepalives (admit): etcd 3.4
// holds every keepalive until it has applied the writes committed before
// it, and fails it after a second, so writes that etcd commits faster than
// it applies cost every session its lease (docs/BENCHMARKS.md, "Fleet
// scale on etcd"). While this server's keepalives wait on etcd (keeper.lag)
// an eighth of a keepalive period or more, one request is in flight at a
// time, each after a pause of a quarter of that wait, and it counts as in
// flight until answered or for that wait (not groupStall); from half a
// period (a sixth of the TTL, as for making sessions) none is sent until
// the keepalives are answered sooner again. A call's context and its
// callTimeout still end its wait (503 unavailable).
//
// Transactions that attach a key to a lease granted by their call (a new
// session) share requests only with each other: etcd refuses a whole
// request that puts a key with a lease it no longer has, and then each is
// sent again alone. They are not held back by the keepalives' lag: their
// leases were granted already and would run out while they waited. Those
// that put a session on this server's home lease (txnHomed), which stands
// as long as the server does, go one request at a time, a second only
// with a full group or with a transaction of a lease just granted waiting
// (take): a fleet opening together shares requests of up to groupMax.

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
	// pressurePoll is how often a held-back request looks at the
	// keepalives' lag again.
	pressurePoll = 10 * time.Millisecond
)

// pressure is how much the keepalives' lag holds writes back (admit).
type pressure int

const (
	pressureNone pressure = iota // the writes go at full rate
	pressureSlow                 // one request at a time, each after a pause
	pressureHeld                 // no request, no new session
)

// pressureOf is the pressure of keepalives that wait lag on etcd, sent
// every period (a third of the TTL): slow from an eighth of a period,
// held from half of one. A lease stands two periods past its last
// answered keepalive, so half a period of lag is a quarter of its margin.
func pressureOf(lag, every time.Duration) pressure {
	switch {
	case lag >= every/2:
		return pressureHeld
	case lag >= every/8:
		return pressureSlow
	}
	return pressureNone
}

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
	els    []clientv3.Op // run when a guard fails: reads only
	size   int           // guards and operations
	bytes  int
	alone  bool
	// leased: an operation puts a key with a lease granted by the call;
	// the transaction shares a request only with others such. patient: that
	// lease is this server's home lease (txnHomed), not one just granted.
	leased, patient bool
	// madeLeased: ops is the one put of txnLeased, which attaches lease,
	// and the request can be made without clientv3 (txnRequest).
	madeLeased bool
	lease      int64

	ready chan struct{} // closed with the outcome
	taken bool          // in a request: its outcome is etcd's, not the caller's
	ok    bool
	rev   int64
	resp  *pb.TxnResponse // etcd's answer to the transaction
	err   error
}

func newPending(cmps []clientv3.Cmp, ops, els []clientv3.Op) *pending {
	p := &pending{cmps: cmps, ops: ops, els: els, ready: make(chan struct{}), size: len(cmps) + len(ops) + len(els)}
	for i := range cmps {
		c := cmps[i].GetCompare()
		p.reads = append(p.reads, span{c.Key, c.RangeEnd})
		p.bytes += len(c.Key) + len(c.RangeEnd)
	}
	for i := range ops {
		p.addOp(&ops[i])
	}
	for i := range els {
		p.addOp(&els[i])
	}
	if max(len(cmps), len(ops), len(els)) > groupSubOps || p.bytes > groupBytes {
		p.alone = true
	}
	return p
}

// addOp notes the keys op reads or writes. op is a pointer: an Op is a
// quarter of a KiB, and newPending ranged over a copy of ops and els, made
// for every transaction (half a KiB of a session's 7 in
// BenchmarkSessionsOpen).
func (p *pending) addOp(op *clientv3.Op) {
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

// grouper queues transactions and sends them in groups.
type grouper struct {
	b      *Backend
	kv     pb.KVClient   // b.cli's, for the requests groupRequest makes
	signal chan struct{} // a request can go: something waits

	// lag is how long this server's keepalives wait on etcd, and their
	// period (keeper.lag, keeper.every); tests set their own.
	lag atomic.Pointer[func(now time.Time) (lag, every time.Duration)]

	mu sync.Mutex
	q  []*pending
	// leasedFlying counts the requests of leased transactions in flight
	// (take), those etcd has not answered within their stall not counted;
	// nLeased the leased transactions in q, nUrgent those of them not
	// patient.
	leasedFlying, nLeased, nUrgent int

	// hold, when set (tests), runs before each request is sent.
	hold atomic.Pointer[func()]

	// requests counts the requests sent, grouped those of more than one
	// transaction, txns the transactions they carried, and stalled those
	// etcd had not answered within groupStall.
	requests, grouped, txns, stalled atomic.Uint64
	// throttled is how long requests were held back by the keepalives'
	// lag (ns), singles the leased transactions sent again alone after
	// their group's lease was not found.
	throttled atomic.Int64
	singles   atomic.Uint64
}

func newGrouper(b *Backend) *grouper {
	g := &grouper{b: b, kv: clientv3.RetryKVClient(b.cli), signal: make(chan struct{}, groupFlight)}
	lag := func(now time.Time) (time.Duration, time.Duration) {
		lag, _ := b.keeper.lag(now)
		return lag, b.keeper.every
	}
	g.lag.Store(&lag)
	return g
}

// commit applies ops if every guard in cmps holds, in a request it may share
// with other transactions: ok false when a guard failed. The request's
// revision is rev. A caller whose ctx ends before its transaction is sent
// gets ctx's error and nothing is written; after, it gets ctx's error at
// once and the transaction may or may not apply, as with a cancelled etcd
// call.
//
// leased says that an operation attaches a key to a lease the call
// granted: the transaction then shares a request only with others such,
// since etcd refuses a whole request for a lease it no longer has.
func (g *grouper) commit(ctx context.Context, cmps []clientv3.Cmp, ops []clientv3.Op, leased bool) (rev int64, ok bool, err error) {
	p, err := g.do(ctx, newPending(cmps, ops, nil), leased)
	if err != nil {
		return 0, false, err
	}
	return p.rev, p.ok, nil
}

// txn is commit with els run when a guard fails (reads only): it returns
// the request's revision and etcd's answer to the transaction.
func (g *grouper) txn(ctx context.Context, cmps []clientv3.Cmp, then, els []clientv3.Op, leased bool) (int64, *pb.TxnResponse, error) {
	return answer(g.do(ctx, newPending(cmps, then, els), leased))
}

// txnLeased is txn for a transaction whose one operation puts key with
// val, attaching lease, a lease the call granted: leased, as commit says.
// Made so, the request is made without clientv3's copies of every guard
// (txnRequest), which were a twentieth of a server's CPU while it opened
// 10,000 sessions on its home lease (docs/BENCHMARKS.md, "Leased
// transactions made as the others").
func (g *grouper) txnLeased(ctx context.Context, cmps []clientv3.Cmp, key, val string, lease int64, els []clientv3.Op) (int64, *pb.TxnResponse, error) {
	return answer(g.do(ctx, newLeasedPending(cmps, key, val, lease, els), true))
}

// txnHomed is txnLeased for a transaction that puts a session on this
// server's home lease (putHomed): patient, which lets it wait for a fuller
// request (take).
func (g *grouper) txnHomed(ctx context.Context, cmps []clientv3.Cmp, key, val string, home int64, els []clientv3.Op) (int64, *pb.TxnResponse, error) {
	p := newLeasedPending(cmps, key, val, home, els)
	p.patient = true
	return answer(g.do(ctx, p, true))
}

// newLeasedPending is the transaction of txnLeased.
func newLeasedPending(cmps []clientv3.Cmp, key, val string, lease int64, els []clientv3.Op) *pending {
	p := newPending(cmps, []clientv3.Op{clientv3.OpPut(key, val, clientv3.WithLease(clientv3.LeaseID(lease)))}, els)
	p.madeLeased, p.lease = true, lease
	return p
}

// answer is txn's outcome of p.
func answer(p *pending, err error) (int64, *pb.TxnResponse, error) {
	if err != nil {
		return 0, nil, err
	}
	return p.rev, p.resp, nil
}

func (g *grouper) do(ctx context.Context, p *pending, leased bool) (*pending, error) {
	p.leased = leased
	g.mu.Lock()
	// The runners end what is queued when the backend closes (run), under
	// g.mu, and leave: a transaction queued after that would wait on its
	// caller's context alone, which may never end.
	if g.b.ctx.Err() != nil {
		g.mu.Unlock()
		return nil, lock.ErrClosed
	}
	g.q = append(g.q, p)
	g.count(p, 1)
	// A patient transaction (leased, on the home lease) that must wait for
	// the leased request in flight (take) wakes no runner: landed does.
	wake := !p.patient || g.leasedFlying == 0 || g.nLeased >= groupMax
	g.mu.Unlock()
	if wake {
		select {
		case g.signal <- struct{}{}:
		default: // as many signals wait as requests can go: one will take p
		}
	}
	select {
	case <-p.ready:
		return p, p.err
	case <-ctx.Done():
		g.mu.Lock()
		if !p.taken {
			g.q = removePending(g.q, p)
			g.count(p, -1)
		}
		g.mu.Unlock()
		return nil, g.b.etcdErr("transaction", ctx.Err())
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

// run sends requests until the backend closes; groupFlight of them run,
// runner 0 the one that still sends while the keepalives' lag slows writes.
func (g *grouper) run(runner int) {
	defer g.b.wg.Done()
	for {
		select {
		case <-g.b.ctx.Done():
			g.mu.Lock()
			q := g.q
			g.q, g.nLeased, g.nUrgent = nil, 0, 0
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
		for g.queued() {
			stall, leasedOnly, ok := g.admit(runner)
			if !ok {
				break
			}
			group := g.take(leasedOnly)
			if len(group) == 0 {
				break
			}
			if ordered, ok := order(group); ok {
				g.dispatch(ordered, stall)
			} else {
				// joins keeps a group free of cycles; were there one,
				// the request would not be as if serial: each goes
				// alone.
				for _, p := range group {
					g.dispatch([]*pending{p}, stall)
				}
			}
			if group[0].leased {
				g.landed()
			}
		}
	}
}

// pressure is the pressure at now of this server's keepalives' lag, and
// that lag.
func (g *grouper) pressure(now time.Time) (pressure, time.Duration) {
	lag, every := (*g.lag.Load())(now)
	return pressureOf(lag, every), lag
}

// first is the index in the queue of its first transaction that is leased
// or not, as asked; -1 without one. g.mu held.
func (g *grouper) first(leased bool) int {
	for i, p := range g.q {
		if p.leased == leased {
			return i
		}
	}
	return -1
}

// count adds d to the counts of leased transactions queued, for p; g.mu
// held.
func (g *grouper) count(p *pending, d int) {
	if p.leased {
		g.nLeased += d
		if !p.patient {
			g.nUrgent += d
		}
	}
}

// landed notes that a request of leased transactions was answered, or
// stalled (dispatch, which returns at the first): the next one may go.
func (g *grouper) landed() {
	g.mu.Lock()
	g.leasedFlying--
	more := len(g.q) > 0
	g.mu.Unlock()
	if more {
		select {
		case g.signal <- struct{}{}:
		default:
		}
	}
}

func (g *grouper) hasLeased() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.nLeased > 0
}

func (g *grouper) queued() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.q) > 0
}

// admit waits until runner may send a request, as the keepalives' lag
// allows (pressureOf), and returns how long that request counts as in
// flight at most, and whether it may carry only leased transactions;
// false when the backend closes. Under pressure only runner 0 sends:
// another hands its signal on to it and waits until the pressure is gone.
// Leased transactions are not held back: their leases were granted
// already (a session's only when there was no pressureHeld, make), and
// run out if their keys wait; they go first.
func (g *grouper) admit(runner int) (time.Duration, bool, bool) {
	start := time.Now()
	handed := false
	for {
		now := time.Now()
		p, lag := g.pressure(now)
		switch {
		case p == pressureNone:
			if runner == 0 {
				g.throttled.Add(int64(now.Sub(start)))
			}
			return groupStall, false, true
		case runner == 0 && g.hasLeased():
			g.throttled.Add(int64(now.Sub(start)))
			return groupStall, true, true
		case runner > 0:
			if !handed {
				handed = true
				select {
				case g.signal <- struct{}{}:
				default:
				}
			}
		case p == pressureSlow && now.Sub(start) >= lag/4:
			g.throttled.Add(int64(now.Sub(start)))
			return max(groupStall, lag), false, true
		}
		t := time.NewTimer(pressurePoll)
		select {
		case <-g.b.ctx.Done():
			t.Stop()
			return 0, false, false
		case <-t.C:
		}
	}
}

// take removes from the queue the oldest transaction and every later one
// that may join it, in the order the request must list them. Leased
// transactions go one request at a time, a second only with a full group
// or when one of them is not patient (its lease was just granted, and
// runs out while it waits): sessions made or moved together, on the home
// lease, then share requests of up to groupMax, not of what arrived within
// half a round trip, and etcd and the servers spend less per session
// (docs/BENCHMARKS.md, "The opening's CPU, session by session"), while the
// other slot still serves the lock calls.
func (g *grouper) take(leasedOnly bool) []*pending {
	g.mu.Lock()
	defer g.mu.Unlock()
	leasedOK := g.leasedFlying == 0 || g.nLeased >= groupMax || g.nUrgent > 0
	h := 0
	switch {
	case leasedOnly && !leasedOK:
		return nil
	case leasedOnly:
		h = g.first(true)
	case !leasedOK:
		h = g.first(false)
	}
	if h < 0 || h >= len(g.q) {
		return nil
	}
	group := []*pending{g.q[h]}
	size, size8 := g.q[h].size, g.q[h].bytes
	rest := g.q[:h] // what stays is written over what was taken
	for i, p := range g.q[h+1:] {
		full := len(group) == groupMax || size >= groupOps || size8 >= groupBytes
		if full || group[0].alone {
			rest = append(rest, g.q[h+1+i:]...)
			break
		}
		if p.alone || p.leased != group[0].leased || size+p.size > groupOps || size8+p.bytes > groupBytes || !joins(group, p) {
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
	if group[0].leased {
		g.leasedFlying++
		for _, p := range group {
			g.count(p, -1)
		}
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

// dispatch sends group and waits for etcd's answer, or for stall, after
// which the request goes on alone and its slot takes the next one.
func (g *grouper) dispatch(group []*pending, stall time.Duration) {
	if h := g.hold.Load(); h != nil {
		// A request held here (tests) is not sent yet, and does not keep
		// the other leased transactions waiting (take): one sent holds
		// them up to its stall at most.
		leased := group[0].leased
		if leased {
			g.landed()
		}
		(*h)()
		if leased {
			g.mu.Lock()
			g.leasedFlying++
			g.mu.Unlock()
		}
	}
	done := make(chan struct{})
	g.b.wg.Add(1) // this runner counts too: Close's Wait has not returned
	go func() {
		defer g.b.wg.Done()
		defer close(done)
		g.send(group)
	}()
	t := time.NewTimer(stall)
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
	if len(group) == 1 {
		g.sendOne(ctx, group[0])
		return
	}
	g.requests.Add(1)
	g.txns.Add(uint64(len(group)))
	g.grouped.Add(1)
	var resp *clientv3.TxnResponse
	var err error
	if req, ok := groupRequest(group); ok {
		resp, err = sendRequest(ctx, b.cli, g.kv, req)
	} else {
		nested := make([]clientv3.Op, len(group))
		for i, p := range group {
			nested[i] = clientv3.OpTxn(p.cmps, p.ops, p.els)
		}
		resp, err = b.cli.Txn(ctx).Then(nested...).Commit()
	}
	if err != nil && group[0].leased && errors.Is(rpctypes.Error(err), rpctypes.ErrLeaseNotFound) {
		// One of the leases is gone, and etcd wrote nothing: each goes
		// alone, and only the one of that lease fails.
		for _, p := range group {
			g.singles.Add(1)
			g.sendOne(ctx, p)
		}
		return
	}
	if err == nil && len(resp.Responses) != len(group) {
		err = fmt.Errorf("etcd backend: %d answers to a request of %d transactions", len(resp.Responses), len(group))
	}
	err = g.err(ctx, err)
	for i, p := range group {
		if err != nil {
			p.err = err
		} else {
			p.rev = resp.Header.Revision
			p.resp = resp.Responses[i].GetResponseTxn()
			p.ok = p.resp.GetSucceeded()
		}
		close(p.ready)
	}
}

// sendOne makes a request of p alone and hands it its outcome.
func (g *grouper) sendOne(ctx context.Context, p *pending) {
	g.requests.Add(1)
	g.txns.Add(1)
	var resp *clientv3.TxnResponse
	var err error
	if req, ok := txnRequest(p); ok {
		resp, err = sendRequest(ctx, g.b.cli, g.kv, req)
	} else {
		resp, err = g.b.cli.Txn(ctx).If(p.cmps...).Then(p.ops...).Else(p.els...).Commit()
	}
	if err = g.err(ctx, err); err != nil {
		p.err = err
	} else {
		p.ok, p.rev, p.resp = resp.Succeeded, resp.Header.Revision, (*pb.TxnResponse)(resp)
	}
	close(p.ready)
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
