package etcd

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/lock"
)

// sessions keeps alive, from this server, the etcd leases of the sessions
// whose streams are here. Any server holding one of a node's streams keeps
// its lease alive; when none does, etcd ends it one TTL after the last
// keepalive: the grace (docs/DESIGN.md, "An etcd backend").
type sessions struct {
	b     *Backend
	mu    sync.Mutex
	local map[string]*localSession
	alive time.Time     // the last keepalive answered, or the first kept since none were
	ttl   time.Duration // the lease TTL etcd answered (it may raise the one asked for)
}

// silence reports how long no keepalive of this server was answered, and
// the sessions' lease TTL; false when it keeps no session alive.
func (s *sessions) silence() (time.Duration, time.Duration, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.local) == 0 {
		return 0, 0, false
	}
	ttl := s.ttl
	if ttl == 0 {
		ttl = time.Duration(s.b.graceTTL) * time.Second
	}
	return time.Since(s.alive), ttl, true
}

func (s *sessions) answered(ttl int64) {
	s.mu.Lock()
	s.alive = time.Now()
	s.ttl = max(s.ttl, time.Duration(ttl)*time.Second)
	s.mu.Unlock()
}

type localSession struct {
	lease   int64
	streams int
}

func newSessions(b *Backend) *sessions {
	return &sessions{b: b, local: map[string]*localSession{}}
}

// Subscribe opens a node's session stream and/or an observer of one key.
func (b *Backend) Subscribe(ctx context.Context, req lock.SubscribeRequest) (lock.Stream, lock.Subscription, error) {
	if req.Node == "" && req.Observe == nil {
		return nil, lock.Subscription{}, fmt.Errorf("%w: a stream needs a node_id, a key to observe, or both", lock.ErrInvalid)
	}
	if req.Node != "" {
		if err := lock.ValidateNode(req.Node); err != nil {
			return nil, lock.Subscription{}, err
		}
	}
	if o := req.Observe; o != nil {
		if err := lock.ValidateKey(o.Type, o.Resource, "-"); err != nil {
			return nil, lock.Subscription{}, err
		}
	}
	if err := b.alive(); err != nil {
		return nil, lock.Subscription{}, err
	}
	w := b.w
	if req.Observe != nil && b.cfg.MaxWatchers > 0 {
		w.mu.Lock()
		n := w.nWatchers
		w.mu.Unlock()
		if n >= b.cfg.MaxWatchers {
			b.refusedWatchers.Add(1)
			return nil, lock.Subscription{}, fmt.Errorf("%w: %d observers, at most %d are allowed", lock.ErrTooManyWatchers, n, b.cfg.MaxWatchers)
		}
	}
	// Every wait on etcd below is bounded, and ends at Close.
	parent := ctx
	ctx, cancel := b.bound(ctx)
	defer cancel()
	f := newFeed(b, req.Node, req.Observe)
	var lease int64
	if req.Node != "" {
		var rev int64
		var err error
		if lease, rev, err = b.s.acquire(ctx, req.Node); err != nil {
			return nil, lock.Subscription{}, b.boundErr(parent, ctx, err)
		}
		f.lease = lease
		// The watch must have seen the session before the stream joins,
		// so that the session's log is the one the stream replays.
		if !w.caughtUp(rev, 10*time.Second) {
			b.s.releaseNode(req.Node, lease)
			if err := b.alive(); err != nil {
				return nil, lock.Subscription{}, err
			}
			return nil, lock.Subscription{}, fmt.Errorf("%w: the watch of the lock state is behind", lock.ErrUnavailable)
		}
	}
	// A last event id from another server that is ahead of this one: wait
	// until this server has seen it too.
	last := normID(req.LastID)
	if req.HasLast {
		if rev := idRev(last); rev > 0 {
			if cur, err := b.currentRev(ctx); err == nil && rev <= cur {
				w.caughtUp(rev, 5*time.Second)
			}
		}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if err := b.alive(); err != nil {
		if req.Node != "" {
			b.s.releaseNode(req.Node, lease)
		}
		return nil, lock.Subscription{}, err
	}
	// Checked again where the count grows: observers that passed the
	// check above together must not all open.
	if req.Observe != nil && b.cfg.MaxWatchers > 0 && w.nWatchers >= b.cfg.MaxWatchers {
		if req.Node != "" {
			b.s.releaseNode(req.Node, lease)
		}
		b.refusedWatchers.Add(1)
		return nil, lock.Subscription{}, fmt.Errorf("%w: %d observers, at most %d are allowed", lock.ErrTooManyWatchers, w.nWatchers, b.cfg.MaxWatchers)
	}
	counter := revID(w.processed+1) - 1
	sub := lock.Subscription{ID: counter}
	if req.Node != "" {
		s := w.sessions[req.Node]
		if s == nil || s.lease != lease {
			b.s.releaseNode(req.Node, lease)
			return nil, lock.Subscription{}, fmt.Errorf("%w: the session of %s ended while its stream opened", lock.ErrUnavailable, req.Node)
		}
		if req.HasLast && last <= counter {
			if last >= s.dropped {
				sub.ID = last
				for _, d := range s.log {
					if d.ID > last {
						sub.Replay = append(sub.Replay, d)
					}
				}
			} else {
				sub.ID, sub.Missed = s.dropped, true
				sub.Replay = append([]lock.Delivery(nil), s.log...)
				b.replays.Add(1)
			}
		}
		w.streams[req.Node] = append(w.streams[req.Node][:len(w.streams[req.Node]):len(w.streams[req.Node])], f)
		b.ops.streamsChanged(req.Node, len(w.streams[req.Node]))
	}
	if o := req.Observe; o != nil {
		l := w.observers[*o]
		w.observers[*o] = append(l[:len(l):len(l)], f)
		w.nWatchers++
	}
	return f, sub, nil
}

func (b *Backend) currentRev(ctx context.Context) (int64, error) {
	resp, err := b.cli.Get(ctx, b.n.epoch())
	if err != nil {
		return 0, b.etcdErr("reading the revision", err)
	}
	return resp.Header.Revision, nil
}

// acquire counts one more stream of node on this server, finding or making
// its session and keeping its lease alive. It returns the lease and a
// revision at which the session exists.
func (s *sessions) acquire(ctx context.Context, node string) (int64, int64, error) {
	b := s.b
	s.mu.Lock()
	if ls := s.local[node]; ls != nil && b.cfg.MaxSessionsPerNode > 0 && ls.streams >= b.cfg.MaxSessionsPerNode {
		s.mu.Unlock()
		b.refusedNodeStreams.Add(1)
		return 0, 0, fmt.Errorf("%w: %s has %d streams, at most %d are allowed", lock.ErrTooManySessions, node, ls.streams, b.cfg.MaxSessionsPerNode)
	}
	s.mu.Unlock()
	for attempt := 0; ; attempt++ {
		if err := ctx.Err(); err != nil {
			return 0, 0, err
		}
		resp, err := b.cli.Get(ctx, b.n.session(node))
		if err != nil {
			return 0, 0, b.etcdErr("reading a session", err)
		}
		var lease, rev int64
		if len(resp.Kvs) > 0 {
			var sr sessRec
			if err := jsonUnmarshal(resp.Kvs[0].Value, &sr); err != nil {
				return 0, 0, err
			}
			lease, rev = sr.Lease, resp.Header.Revision
		} else {
			if err := b.roomForSession(); err != nil {
				return 0, 0, err
			}
			g, err := b.cli.Grant(ctx, b.graceTTL)
			if err != nil {
				return 0, 0, b.etcdErr("granting a session lease", err)
			}
			key := b.n.session(node)
			tr, err := b.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
				Then(clientv3.OpPut(key, encode(sessRec{Lease: int64(g.ID)}), clientv3.WithLease(g.ID))).Commit()
			if err != nil || !tr.Succeeded {
				b.revokeLater(int64(g.ID))
				if err != nil {
					return 0, 0, b.etcdErr("making a session", err)
				}
				continue // another server made it first
			}
			b.committed(tr.Header.Revision)
			lease, rev = int64(g.ID), tr.Header.Revision
		}
		ok, err := s.keep(node, lease)
		if err != nil {
			return 0, 0, err
		}
		if !ok {
			continue // the lease ended between the read and the keepalive
		}
		return lease, rev, nil
	}
}

// keep counts a stream of node with lease and keeps the lease alive from
// this server; false when the lease no longer exists.
func (s *sessions) keep(node string, lease int64) (bool, error) {
	b := s.b
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := b.alive(); err != nil {
		return false, err
	}
	if ls := s.local[node]; ls != nil && ls.lease == lease {
		// Checked again here, where the count grows: streams that
		// passed acquire's check together must not all open.
		if b.cfg.MaxSessionsPerNode > 0 && ls.streams >= b.cfg.MaxSessionsPerNode {
			b.refusedNodeStreams.Add(1)
			return false, fmt.Errorf("%w: %s has %d streams, at most %d are allowed", lock.ErrTooManySessions, node, ls.streams, b.cfg.MaxSessionsPerNode)
		}
		ls.streams++
		return true, nil
	}
	ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
	sent := time.Now()
	ka, err := b.cli.KeepAliveOnce(ctx, clientv3.LeaseID(lease))
	cancel()
	if errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return false, nil
	}
	if err != nil {
		return false, b.etcdErr("keeping a session alive", err)
	}
	if old := s.local[node]; old != nil {
		b.keeper.remove(old.lease) // a session that ended and began anew
	}
	b.keeper.add(lease, sent, sent.Add(time.Duration(ka.TTL)*time.Second))
	if len(s.local) == 0 {
		s.alive = time.Now()
	}
	s.local[node] = &localSession{lease: lease, streams: 1}
	return true, nil
}

// release counts one stream of f's node less, once per stream.
func (s *sessions) release(f *feed) {
	if f.node == "" {
		return
	}
	if f.released.CompareAndSwap(false, true) {
		s.releaseNode(f.node, f.lease)
	}
}

// releaseNode counts one stream of node's session with lease less. A
// stream of a session that ended counts for none: the node's new session,
// made here since, keeps its own count.
func (s *sessions) releaseNode(node string, lease int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ls := s.local[node]
	if ls == nil || ls.lease != lease {
		return
	}
	if ls.streams--; ls.streams <= 0 {
		s.b.keeper.remove(ls.lease)
		delete(s.local, node)
	}
}

// closeAll stops every keepalive of this server (Close). The leases run
// out one TTL later unless another server keeps them.
func (s *sessions) closeAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	clear(s.local)
	s.b.keeper.removeAll()
}

// sessionEnded ends, once in the cluster, what a lost session leased: its
// queue places, then its holds, handed on as failures with "session lost"
// (docs/DESIGN.md, "Leases"). The server whose claim is made first does it
// and counts the loss; a claim of a server that dies with it is let go
// with the server's own lease, and the orphan sweep finishes the work.
func (b *Backend) sessionEnded(node string, lease int64) {
	if b.ctx.Err() != nil {
		return
	}
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		ctx, cancel := context.WithTimeout(b.ctx, time.Minute)
		defer cancel()
		claim := b.n.lost(node, lease)
		g, err := b.cli.Grant(ctx, 60)
		if err != nil {
			return
		}
		tr, err := b.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(claim), "=", 0)).
			Then(clientv3.OpPut(claim, "", clientv3.WithLease(g.ID))).Commit()
		if err != nil || !tr.Succeeded {
			b.revokeLater(int64(g.ID))
			return
		}
		switch n, err := b.endSession(ctx, node, lease); {
		case err != nil:
			b.sessionsLost.Add(1)
			b.log.Warn("etcd backend: ending a lost session", "node", node, "err", err)
		case n == 0:
			// A clean end: the node closed its streams holding nothing.
			b.sessionsClosed.Add(1)
			b.log.Debug("session ended", "node", node)
		default:
			b.sessionsLost.Add(1)
			b.log.Info("session lost", "node", node, "keys", n)
		}
		_, _ = b.cli.Revoke(ctx, g.ID)
	}()
}

// endSession removes node's waits, then releases its holds, of the session
// with lease, and drops their index entries. It returns how many keys the
// session had a hold or a place on.
func (b *Backend) endSession(ctx context.Context, node string, lease int64) (int, error) {
	var keys []lock.Key
	err := b.w.page(ctx, b.n.nodeIndex(node), 0, func(kv kvLike) {
		if v, err := strconv.ParseInt(string(kv.Value), 16, 64); err != nil || v != lease {
			return
		}
		if _, k, ok := b.n.parseNodeIndex(string(kv.Key)); ok {
			keys = append(keys, k)
		}
	})
	if err != nil {
		return 0, err
	}
	// Waiters first, so that no hold is handed to a waiter that is leaving
	// too.
	for _, holds := range []bool{false, true} {
		for _, k := range keys {
			var expired, handed bool
			_, err := b.run(ctx, k, func(t *tx) error {
				expired, handed = false, false
				if holds {
					if t.rec.Holder != node || t.rec.Lease != uint8(lock.LeaseSession) || t.rec.SLease != lease {
						return nil
					}
					next, err := t.end(false, "session lost", false, true, time.Now())
					expired, handed = true, next != ""
					return err
				}
				seq, ok, err := t.waiting(node)
				if err != nil || !ok {
					return err
				}
				wr, err := t.wait(seq, node)
				if err != nil || wr.Lease != uint8(lock.LeaseSession) || wr.SLease != lease {
					return err
				}
				t.dequeue(seq, node)
				t.rec.Queue--
				if t.rec.Queue == 0 {
					t.rec.WaitTTL = 0
				}
				t.put(nil)
				return nil
			})
			if err != nil {
				return 0, err
			}
			if expired {
				b.expiries.Add(1)
			}
			if handed {
				b.grants.Add(1)
				b.handoffs.Add(1)
			}
		}
	}
	v := strconv.FormatInt(lease, 16)
	for _, k := range keys {
		key := b.n.nodeKey(node, k)
		if _, err := b.cli.Txn(ctx).If(clientv3.Compare(clientv3.Value(key), "=", v)).Then(clientv3.OpDelete(key)).Commit(); err != nil {
			return 0, b.etcdErr("dropping a session's index", err)
		}
	}
	return len(keys), nil
}

// sweepOrphans ends, every grace or so, the index entries of sessions that
// no longer exist: a session that ended while no server was up, or whose
// ending server died halfway.
func (b *Backend) sweepOrphans() {
	defer b.wg.Done()
	every := max(5*time.Second, time.Duration(b.graceTTL)*time.Second)
	t := time.NewTimer(every)
	defer t.Stop()
	for {
		select {
		case <-b.ctx.Done():
			return
		case <-t.C:
		}
		b.sweepOnce()
		t.Reset(every)
	}
}

func (b *Backend) sweepOnce() {
	ctx, cancel := context.WithTimeout(b.ctx, time.Minute)
	defer cancel()
	type orphan struct {
		node  string
		lease int64
	}
	seen := map[orphan]bool{}
	err := b.w.page(ctx, b.n.nodeIndexes(), 0, func(kv kvLike) {
		node, _, ok := b.n.parseNodeIndex(string(kv.Key))
		v, err := strconv.ParseInt(string(kv.Value), 16, 64)
		if !ok || err != nil {
			return
		}
		seen[orphan{node, v}] = true
	})
	if err != nil {
		return
	}
	for o := range seen {
		resp, err := b.cli.Get(ctx, b.n.session(o.node))
		if err != nil {
			return
		}
		if len(resp.Kvs) > 0 {
			var sr sessRec
			if jsonUnmarshal(resp.Kvs[0].Value, &sr) == nil && sr.Lease == o.lease {
				continue // alive
			}
		}
		claim := b.n.lost(o.node, o.lease)
		if c, err := b.cli.Get(ctx, claim); err != nil || len(c.Kvs) > 0 {
			continue // a server is at it
		}
		if _, err := b.endSession(ctx, o.node, o.lease); err != nil {
			b.log.Warn("etcd backend: ending an orphaned session", "node", o.node, "err", err)
		}
	}
}
