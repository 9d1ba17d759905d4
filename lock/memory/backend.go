package memory

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dlock/dlock/lock"
)

// Backend is the in-memory lock.Backend: a sharded lock manager whose state lives in
// this process. It is safe for concurrent use.
type Backend struct {
	cfg       Config
	log       *slog.Logger
	epoch     string
	start     time.Time // origin of the manager's monotonic clock (mono)
	startUS   uint64    // start in Unix microseconds
	shards    []*shard
	recordCap int // completion records kept per shard

	sess  sessionTable
	grace graceHeap
	obs   observerTable
	seq   atomic.Uint64 // event ids, shared by every stream
	keys  atomic.Int64  // keys with state, over every shard (Config.MaxKeys)
	tok   tokenClock

	ops opTable // the operator feed (opfeed.go)

	refVersion atomic.Uint64 // last version given to a reference change

	sessionsLost, sessionsClosed atomic.Uint64
	slowStreams                  atomic.Uint64

	refusedSessions, refusedNodeStreams, refusedQueue, refusedKeys, refusedWatchers atomic.Uint64
	watchers                                                                        atomic.Int64 // observer and operator streams (Config.MaxWatchers)
	truncatedErrors, replayGaps                                                     atomic.Uint64

	// closeMu is held for reading by every timer callback, so that Close,
	// holding it for writing, knows no callback is running after it.
	closeMu sync.RWMutex
	closed  atomic.Bool
}

// New returns a Backend. With cfg.RefStore set it loads the stored references.
func New(ctx context.Context, cfg Config) (*Backend, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("lock: %w", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	var b [8]byte
	_, _ = rand.Read(b[:])
	m := &Backend{
		cfg:    cfg,
		log:    log,
		epoch:  hex.EncodeToString(b[:]),
		shards: make([]*shard, cfg.Shards),
	}
	floor, err := m.startTokens()
	if err != nil {
		return nil, err
	}
	m.sess.m = make(map[string]*session)
	m.obs.m = make(map[lock.Key][]*stream)
	if cfg.CompletedRetention > 0 && cfg.CompletedMax > 0 {
		m.recordCap = max(1, cfg.CompletedMax/cfg.Shards)
	}
	for i := range m.shards {
		m.shards[i] = &shard{m: m, keys: newKeyTable(), tokenFloor: floor - 1}
		if cfg.RefStore != nil {
			m.shards[i].refs = make(map[string]*refState)
		}
	}
	if cfg.RefStore != nil {
		if err := m.loadRefs(ctx); err != nil {
			return nil, err
		}
	}
	m.keepTokens()
	return m, nil
}

// mono is a time on the manager's monotonic clock: the time since
// Backend.start. Reading it costs half of time.Now, which reads the wall
// clock too, and the hot path reads it on every call.
type mono time.Duration

func (t mono) add(d time.Duration) mono { return t + mono(d) }

func (m *Backend) now() mono { return mono(time.Since(m.start)) }

func (m *Backend) wall(t mono) time.Time { return m.start.Add(time.Duration(t)) }

// micros is t in Unix microseconds, the floor of a fencing token.
func (m *Backend) micros(t mono) uint64 { return m.startUS + uint64(time.Duration(t)/time.Microsecond) }

// Info describes the manager. Its epoch is a random id chosen when the
// manager was created: its state lives in this process, and a client that
// sees the epoch change knows that every hold, queue entry and session is gone.
func (m *Backend) Info() lock.Info {
	return lock.Info{Epoch: m.epoch, RefCounting: m.cfg.RefStore != nil, LockTTL: m.cfg.LockTTL}
}

// Config returns the configuration the manager runs with.
func (m *Backend) Config() Config { return m.cfg }

// Close stops every timer and closes every stream. Calls after Close return
// ErrClosed. It does not close the RefStore.
func (m *Backend) Close() error {
	m.closeMu.Lock()
	already := m.closed.Swap(true)
	m.closeMu.Unlock()
	if already {
		return nil
	}
	m.stopTokens()
	for _, s := range m.shards {
		s.mu.Lock()
		if s.timer != nil {
			s.timer.Stop()
		}
		s.mu.Unlock()
	}
	m.grace.mu.Lock()
	if m.grace.timer != nil {
		m.grace.timer.Stop()
	}
	m.grace.mu.Unlock()
	m.sess.mu.Lock()
	var streams []*stream
	for _, s := range m.sess.m {
		s.mu.Lock()
		streams = append(streams, s.streams...)
		s.mu.Unlock()
	}
	m.sess.mu.Unlock()
	m.obs.mu.RLock()
	for _, l := range m.obs.m {
		streams = append(streams, l...)
	}
	m.obs.mu.RUnlock()
	for _, st := range streams {
		st.Close()
	}
	m.closeOps()
	return nil
}

func (m *Backend) shardFor(resource string) *shard {
	if len(m.shards) == 1 {
		return m.shards[0]
	}
	return m.shards[ShardIndex(resource, len(m.shards))]
}

// ShardIndex is FNV-1a-32 of the resource modulo n (docs/RUNNING.md, "Configuration": --shards).
func ShardIndex(resource string, n int) int {
	const offset32, prime32 = 2166136261, 16777619
	h := uint32(offset32)
	for i := 0; i < len(resource); i++ {
		h ^= uint32(resource[i])
		h *= prime32
	}
	return int(h % uint32(n))
}

// TryLock grants, queues or refuses a lock request (docs/DESIGN.md, "TryLock"). It blocks only
// to make a reference change durable, never to wait for the lock.
func (m *Backend) TryLock(ctx context.Context, req lock.LockRequest) (lock.LockResult, error) {
	if err := req.Validate(); err != nil {
		return lock.LockResult{}, err
	}
	if m.closed.Load() {
		return lock.LockResult{}, lock.ErrClosed
	}
	s := m.shardFor(req.Resource)
	k := req.Key()
	s.mu.Lock()
	t := s.begin()
	ks := s.key(k)
	if ks != nil {
		if h := ks.holder; h != nil && h.node() == req.Node {
			// A retry whose answer was lost, a renewal, or the confirmation
			// of a hand-off grant.
			if err := s.renew(h, req.Lease); err != nil {
				s.mu.Unlock()
				return lock.LockResult{}, err
			}
			ks.unclaimed = false
			s.schedule(h, t.now)
			res := lock.LockResult{Acquired: true, Token: ks.lastToken, Holder: h.node(), Guaranteed: s.guaranteed(h, t.now)}
			s.commit(ctx, t)
			return res, nil
		}
		if e := ks.waiter(req.Node); e != nil {
			if err := s.renew(e, req.Lease); err != nil {
				s.mu.Unlock()
				return lock.LockResult{}, err
			}
			s.schedule(e, t.now)
			res := lock.LockResult{Queued: true, Holder: ks.holderNode(), Position: ks.wq.position(e)}
			s.commit(ctx, t)
			return res, nil
		}
	}
	if s.refs != nil {
		if err := s.refConflict(k); err != nil {
			s.mu.Unlock()
			return lock.LockResult{}, err
		}
	}
	if req.SkipRecent && k.Type != lock.Update && ks != nil && ks.holder == nil && ks.recentSuccess(t.now, m.cfg.CompletedRetention) {
		res := lock.LockResult{Skip: true}
		s.mu.Unlock()
		return res, nil
	}
	// A key reserved by its lock delay is refused as a held one: it is
	// not this node's to take, and the mode queues no one.
	if ks != nil && (ks.holder != nil || ks.delayed()) && !m.cfg.AllowMultiNodeDownload {
		holder := ks.holderNode()
		s.mu.Unlock()
		return lock.LockResult{}, &lock.HeldError{Holder: holder}
	}
	// Limits (docs/SECURITY.md): checked before anything changes.
	newKey := ks == nil
	if newKey {
		if max := m.cfg.MaxKeys; max > 0 && m.keys.Load() >= int64(max) {
			s.mu.Unlock()
			m.refusedKeys.Add(1)
			return lock.LockResult{}, fmt.Errorf("%w: %d keys have state, at most %d are allowed", lock.ErrTooManyKeys, m.keys.Load(), max)
		}
		// The key's resource never changes: a session's end reads it
		// without the shard's mutex (endSessions).
		ks = &keyState{res: s.keys.resource(k.Resource), typ: k.Type, lastToken: s.tokenFloor}
	} else if max := m.cfg.MaxQueue; (ks.holder != nil || ks.delayed()) && max > 0 && ks.qlen() >= max {
		n := ks.qlen()
		s.mu.Unlock()
		m.refusedQueue.Add(1)
		return lock.LockResult{}, fmt.Errorf("%w: %v has %d waiters, at most %d are allowed", lock.ErrQueueFull, k, n, max)
	}
	e := s.newEntry(ks)
	if err := s.attach(e, req.Node, req.Lease); err != nil {
		s.recycle(e)
		s.mu.Unlock()
		return lock.LockResult{}, err
	}
	if newKey {
		s.addKey(ks)
	}
	var res lock.LockResult
	if ks.holder == nil && !ks.delayed() {
		s.grant(&t, ks, e, false)
		res = lock.LockResult{Acquired: true, Token: ks.lastToken, Holder: e.node(), Guaranteed: s.guaranteed(e, t.now)}
	} else {
		// Held, or reserved by its lock delay: the delay protects a
		// holder whose lease ran out but that may still be running, so a
		// newcomer waits behind the queue (docs/DESIGN.md, "Leases").
		s.enqueue(&t, ks, e)
		res = lock.LockResult{Queued: true, Holder: ks.holderNode(), Position: ks.qlen()}
	}
	s.commit(ctx, t)
	return res, nil
}

// Unlock ends a hold (docs/DESIGN.md, "Unlock"): success of any type but update clears the queue
// and tells every waiter the work is done; anything else hands the lock to
// the queue head.
func (m *Backend) Unlock(ctx context.Context, req lock.UnlockRequest) (lock.UnlockResult, error) {
	if err := req.Validate(); err != nil {
		return lock.UnlockResult{}, err
	}
	if m.closed.Load() {
		return lock.UnlockResult{}, lock.ErrClosed
	}
	s := m.shardFor(req.Resource)
	s.mu.Lock()
	t := s.begin()
	ks := s.key(req.Key())
	if ks == nil || ks.holder == nil || ks.holder.node() != req.Node {
		if ks != nil && ks.replays(req, t.now, m.cfg.CompletedRetention) {
			res := lock.UnlockResult{NextHolder: ks.rec.next, Replayed: true}
			s.mu.Unlock()
			return res, nil
		}
		s.mu.Unlock()
		return lock.UnlockResult{}, lock.ErrNotHolder
	}
	if req.Token != 0 && req.Token != ks.lastToken {
		s.mu.Unlock()
		return lock.UnlockResult{}, fmt.Errorf("%w: sent %d, current grant is %d", lock.ErrStaleToken, req.Token, ks.lastToken)
	}
	errMsg, cut := lock.TruncateError(req.Error)
	if cut {
		m.truncatedErrors.Add(1)
	}
	next := s.release(&t, ks, req.Success, errMsg, true, false)
	err := s.commit(ctx, t)
	return lock.UnlockResult{NextHolder: next}, err
}

// Cancel removes node from the key's queue, or, if node holds the key,
// releases it as a failure with error "cancelled" (docs/DESIGN.md, "Cancel").
func (m *Backend) Cancel(ctx context.Context, t lock.Type, resource, node string) (lock.CancelResult, error) {
	if err := lock.ValidateKey(t, resource, node); err != nil {
		return lock.CancelResult{}, err
	}
	if m.closed.Load() {
		return lock.CancelResult{}, lock.ErrClosed
	}
	s := m.shardFor(resource)
	s.mu.Lock()
	tx := s.begin()
	ks := s.key(lock.Key{Type: t, Resource: resource})
	var res lock.CancelResult
	switch {
	case ks == nil:
	case ks.holder != nil && ks.holder.node() == node:
		s.release(&tx, ks, false, "cancelled", false, false)
		res.Released = true
	case ks.waiter(node) != nil:
		s.dequeue(ks, ks.waiter(node))
		res.Dequeued = true
	}
	err := s.commit(ctx, tx)
	return res, err
}

// Status describes a key (docs/DESIGN.md, "Status"). A non-empty node renews that node's ttl lease on
// the key, as a /lock would, and gets its queue position.
func (m *Backend) Status(ctx context.Context, t lock.Type, resource, node string) (lock.Status, error) {
	if err := ctx.Err(); err != nil {
		return lock.Status{}, err
	}
	if err := lock.ValidateKey(t, resource, "-"); err != nil {
		return lock.Status{}, err
	}
	if node != "" {
		if err := lock.ValidateNode(node); err != nil {
			return lock.Status{}, err
		}
	}
	if m.closed.Load() {
		return lock.Status{}, lock.ErrClosed
	}
	k := lock.Key{Type: t, Resource: resource}
	s := m.shardFor(resource)
	s.mu.Lock()
	defer s.mu.Unlock()
	st := lock.Status{Key: k}
	ks := s.key(k)
	if ks == nil {
		return st, nil
	}
	now := m.now()
	st.Token = ks.lastToken
	st.QueueLength = ks.qlen()
	if h := ks.holder; h != nil {
		st.Held, st.Holder, st.AcquiredAt = true, h.node(), m.wall(h.grantedAt)
		if node == h.node() {
			if h.sess == nil {
				s.schedule(h, now)
			}
			st.Guaranteed = s.guaranteed(h, now)
		}
	}
	if e := ks.waiter(node); e != nil {
		st.Position = ks.wq.position(e)
		if e.sess == nil {
			s.schedule(e, now)
		}
	}
	if ks.hasRec && ks.rec.retained(now, m.cfg.CompletedRetention) {
		c := ks.rec.Completion
		st.LastCompleted = &c
	}
	return st, nil
}

// Stats returns current gauges and counters.
func (m *Backend) Stats() lock.Stats {
	var st lock.Stats
	for _, s := range m.shards {
		s.mu.Lock()
		st.Keys += s.keys.n
		st.Held += s.held
		st.Queued += s.queued
		st.Grants += s.grants
		st.Handoffs += s.handoffs
		st.Expiries += s.expiries
		s.mu.Unlock()
	}
	st.Sessions = int(m.sess.n.Load())
	st.SessionsLost = m.sessionsLost.Load()
	st.SessionsClosed = m.sessionsClosed.Load()
	st.SlowStreams = m.slowStreams.Load()
	st.RefusedSessions = m.refusedSessions.Load()
	st.RefusedNodeStreams = m.refusedNodeStreams.Load()
	st.RefusedQueue = m.refusedQueue.Load()
	st.RefusedKeys = m.refusedKeys.Load()
	st.RefusedWatchers = m.refusedWatchers.Load()
	st.TruncatedErrors = m.truncatedErrors.Load()
	st.ReplayGaps = m.replayGaps.Load()
	return st
}

var (
	_ lock.Backend   = (*Backend)(nil)
	_ lock.Inspector = (*Backend)(nil)
)
