// Package etcd is a lock.Backend that keeps every piece of lock state in
// etcd, so that any number of dlock servers pointed at one etcd cluster act
// as one lock service: any server answers any request for any key, with no
// leader among them and no replication of dlock's own (docs/DESIGN.md, "An
// etcd backend"). Each change is one etcd transaction guarded by the mod
// revisions of what it read; sessions are etcd leases; every server derives
// the events of every change from one watch, so that event ids are the same
// on every server and a stream resumes anywhere with Last-Event-ID.
//
// How it maps onto lock.Backend's methods:
//
//   - TryLock, Unlock, Cancel, Status: one etcd transaction per call on the
//     key's record ("<prefix>/k/<type>/<resource>": holder, token, leases,
//     waiter count, completion) and its queue keys, guarded by the mod
//     revisions of everything read and tried again on conflict. A refusal is
//     decided on linearizable reads under the same guard.
//   - Sessions are etcd leases ("<prefix>/s/<node>" attached to a lease kept
//     alive by whichever server holds one of the node's streams); a session's
//     end, seen by the watch, makes one server hand its holds on.
//   - Subscribe: every server derives every change's events from one watch,
//     with ids = revision × 8 + index, the same on every server, so that
//     Last-Event-ID resumes anywhere.
//   - Timers: every server races to act on a due deadline; the guarded
//     transaction lets one win.
//   - Epoch: stored once per data set ("<prefix>/epoch").
//
// docs/DESIGN.md, "An etcd backend", has the records key by key and why
// each operation is safe.
package etcd

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/maphash"
	"log/slog"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/lock"
)

// DefaultPrefix is where a data set's records live unless told otherwise.
const DefaultPrefix = "/dlock/"

// Backend is the etcd lock.Backend. Make one with New.
type Backend struct {
	cli         *clientv3.Client
	leases      pb.LeaseClient // for grants of a lease id the backend chose (grantID)
	n           names
	cfg         Config
	log         *slog.Logger
	refCounting bool
	epoch       string
	// versionsChecked is closed once checkVersions has asked every
	// member's version (version.go).
	versionsChecked chan struct{}
	graceTTL        int64 // the session lease's TTL in seconds
	seed            maphash.Seed
	stripes         [256]chan struct{} // a mutex per stripe of resources that a context can give up on
	comb            combiner
	g               *grouper // sends the transactions of a moment together (group.go)

	ctx    context.Context // ends at Close
	cancel context.CancelFunc
	wg     sync.WaitGroup
	closed atomic.Bool

	lastCommit atomic.Int64 // the newest revision this backend committed
	lastQuorum atomic.Int64 // when etcd last answered the readiness probe, Unix ns

	w      *watcher
	rc     *recCache // the records calls read first (cache.go)
	qs     *queues   // the queues of the keys with waiters, as the watch saw them (queues.go)
	s      *sessions
	keeper *keeper

	// The operators' view (inspect.go): nothing while nobody looks.
	vw   *viewer
	ops  opTable
	pres *presence

	ix *indexSweeper // the queue indexes a success left (indexes.go)

	grants, handoffs, expiries, sessionsLost, slowStreams  atomic.Uint64
	sessionsClosed                                         atomic.Uint64
	refusedSessions, refusedNodeStreams, refusedQueue      atomic.Uint64
	refusedKeys, refusedWatchers, truncatedErrors, replays atomic.Uint64
	conflicts                                              atomic.Uint64
	promotions                                             atomic.Uint64 // sessions given their own lease (promote)
	rehomes                                                atomic.Uint64 // sessions moved onto this server's home lease (rehome)
	cacheStale                                             atomic.Uint64 // first attempts the cache misled
}

var _ lock.Backend = (*Backend)(nil)

// Config configures a Backend: the rules every backend honours, and what
// only this engine has. Every server of one data set runs with the same
// Config. Start from DefaultConfig.
type Config struct {
	lock.Rules

	// Prefix is where the data set's records live (DefaultPrefix when
	// empty): servers that share it are one lock service.
	Prefix string
	// RefCounting turns server-side reference counting on. The references
	// live in etcd, each beside the keys whose rules read it
	// (docs/DESIGN.md, "An etcd backend").
	RefCounting bool
	// Logger receives session losses (info) and etcd's trouble: failed
	// keepalives, a watch compacted or ended, a timer or sweep that failed
	// (warn). Nil discards.
	Logger *slog.Logger
}

// DefaultConfig returns the defaults of docs/RUNNING.md, "Configuration".
func DefaultConfig() Config { return Config{Rules: lock.DefaultRules()} }

// New opens the data set cfg.Prefix names on cli, which stays the
// caller's to close after the backend.
func New(ctx context.Context, cli *clientv3.Client, cfg Config) (*Backend, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", lock.ErrInvalid, err)
	}
	prefix := cfg.Prefix
	if prefix == "" {
		prefix = DefaultPrefix
	}
	if !strings.HasSuffix(prefix, "/") {
		prefix += "/"
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	b := &Backend{
		cli:         cli,
		leases:      clientv3.RetryLeaseClient(cli),
		n:           names{p: prefix},
		cfg:         cfg,
		log:         log,
		refCounting: cfg.RefCounting,
		graceTTL:    max(1, int64(math.Ceil(cfg.SessionGrace.Seconds()))),
		seed:        maphash.MakeSeed(),

		versionsChecked: make(chan struct{}),
	}
	b.rc = newRecCache(b.n)
	b.qs = newQueues(b.n)
	for i := range b.stripes {
		b.stripes[i] = make(chan struct{}, 1)
	}
	var err error
	if b.epoch, err = b.loadEpoch(ctx); err != nil {
		return nil, err
	}
	b.ctx, b.cancel = context.WithCancel(context.Background())
	b.s = newSessions(b)
	b.keeper = newKeeper(b)
	b.vw, b.ops.b, b.pres = newViewer(b), b, newPresence(b)
	b.ix = newIndexSweeper(b) // before the watch, whose list schedules sweeps
	// The grouper is there before the watch starts: a session that ends
	// while the watch warms up is ended through it (its runners start
	// below, and its requests wait for them).
	b.g = newGrouper(b)
	b.w = newWatcher(b)
	if err := b.w.start(ctx); err != nil {
		b.cancel()
		b.wg.Wait()
		return nil, err
	}
	b.lastQuorum.Store(time.Now().UnixNano()) // New read etcd just now
	b.wg.Add(5 + groupFlight)
	go b.probe()
	for i := range groupFlight {
		go b.g.run(i)
	}
	go b.keeper.run()
	go b.timers()
	go b.sweepOrphans()
	go b.health()
	b.wg.Add(3)
	go b.pres.run()
	go b.checkVersions()
	go b.ix.run()
	return b, nil
}

// loadEpoch reads the data set's epoch, made by the first server that
// opens it.
func (b *Backend) loadEpoch(ctx context.Context) (string, error) {
	var raw [8]byte
	_, _ = rand.Read(raw[:])
	mine := hex.EncodeToString(raw[:])
	key := b.n.epoch()
	resp, err := b.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
		Then(clientv3.OpPut(key, mine)).Else(clientv3.OpGet(key)).Commit()
	if err != nil {
		return "", b.etcdErr("reading the epoch", err)
	}
	if resp.Succeeded {
		return mine, nil
	}
	kvs := resp.Responses[0].GetResponseRange().GetKvs()
	if len(kvs) == 0 {
		return "", fmt.Errorf("etcd backend: the epoch vanished while read")
	}
	return string(kvs[0].Value), nil
}

// Info describes the backend: the epoch is the data set's, the same on
// every server.
func (b *Backend) Info() lock.Info {
	return lock.Info{Epoch: b.epoch, RefCounting: b.refCounting, LockTTL: b.cfg.LockTTL}
}

// Stats returns the cluster's gauges, as this server's watch has seen them
// (after the changes this backend made), and this server's counters.
func (b *Backend) Stats() lock.Stats {
	b.w.caughtUp(b.lastCommit.Load(), time.Second)
	st := b.w.stats()
	st.Grants = b.grants.Load()
	st.Handoffs = b.handoffs.Load()
	st.Expiries = b.expiries.Load()
	st.SessionsLost = b.sessionsLost.Load()
	st.SessionsClosed = b.sessionsClosed.Load()
	st.SlowStreams = b.slowStreams.Load()
	st.RefusedSessions = b.refusedSessions.Load()
	st.RefusedNodeStreams = b.refusedNodeStreams.Load()
	st.RefusedQueue = b.refusedQueue.Load()
	st.RefusedKeys = b.refusedKeys.Load()
	st.RefusedWatchers = b.refusedWatchers.Load()
	st.TruncatedErrors = b.truncatedErrors.Load()
	st.ReplayGaps = b.replays.Load()
	return st
}

// Close ends every stream and timer of this server. The state stays in
// etcd: holds, queues and sessions go on, and a session whose streams were
// here lives on while its node reconnects to another server within the
// grace. It does not close the etcd client.
func (b *Backend) Close() error {
	if b.closed.Swap(true) {
		return lock.ErrClosed
	}
	b.cancel()
	// currentRev starts its reader, if b.ctx had not ended, under revMu:
	// one started before this has been added to wg before Wait below.
	b.s.revMu.Lock()
	//lint:ignore SA2001 a barrier, not a critical section
	b.s.revMu.Unlock()
	b.s.closeAll()
	b.vw.stop()
	b.w.mu.Lock()
	b.ops.endAll()
	b.w.mu.Unlock()
	b.w.closeAll()
	b.wg.Wait()
	return nil
}

func (b *Backend) alive() error {
	if b.closed.Load() {
		return lock.ErrClosed
	}
	return nil
}

// committed notes a revision this backend wrote, so that Stats and
// Subscribe can wait until the watch has seen it.
func (b *Backend) committed(rev int64) {
	for {
		old := b.lastCommit.Load()
		if rev <= old || b.lastCommit.CompareAndSwap(old, rev) {
			return
		}
	}
}

// etcdErr wraps an error of the etcd client: a closed backend's calls end
// with lock.ErrClosed, an etcd cluster out of reach or without quorum with
// lock.ErrUnavailable (503: try again, maybe on another server), a context
// that ended with its own error.
func (b *Backend) etcdErr(what string, err error) error {
	if b.closed.Load() {
		return lock.ErrClosed
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	code := codes.Unknown
	// The client turns etcd's own errors ("request timed out", "no
	// leader", "leader changed": an election) into rpctypes.EtcdError,
	// which is no gRPC status; both carry the code.
	var ee rpctypes.EtcdError
	if errors.As(err, &ee) {
		code = ee.Code()
	} else if s, ok := status.FromError(err); ok {
		code = s.Code()
		// A member without a quorum holds a request until the deadline
		// the client sent with it, then answers that deadline's error,
		// which gRPC carries as Unknown (TestHAEtcdGoneAnswered).
		if code == codes.Unknown && s.Message() == context.DeadlineExceeded.Error() {
			code = codes.DeadlineExceeded
		}
	}
	switch code {
	case codes.Unavailable, codes.DeadlineExceeded, codes.Canceled, codes.Aborted, codes.ResourceExhausted:
		return fmt.Errorf("%w: etcd: %s: %v", lock.ErrUnavailable, what, err)
	}
	return fmt.Errorf("etcd backend: %s: %w", what, err)
}

// revokeLater revokes a lease this backend granted and did not use.
func (b *Backend) revokeLater(id int64) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, _ = b.cli.Revoke(ctx, clientv3.LeaseID(id))
}

func jsonUnmarshal(v []byte, out any) error {
	if err := json.Unmarshal(v, out); err != nil {
		return fmt.Errorf("etcd backend: a record that is not ours: %w", err)
	}
	return nil
}

// Ready says whether etcd answered a quorum read of this server within
// readyWithin (lock.Checker): a server cut off from its etcd cluster, or
// from its quorum, answers its calls 503 and should get none
// (docs/DESIGN.md, "An etcd backend").
func (b *Backend) Ready() error {
	if err := b.alive(); err != nil {
		return err
	}
	last := time.Unix(0, b.lastQuorum.Load())
	if d := time.Since(last); d > readyWithin {
		return fmt.Errorf("%w: etcd has not answered a quorum read for %v", lock.ErrUnavailable, d.Round(100*time.Millisecond))
	}
	return nil
}

// readyWithin is how recent the last quorum read must be for Ready; the
// probe reads every readyEvery.
const (
	readyWithin = 3 * time.Second
	readyEvery  = time.Second
)

// probe reads the epoch with a quorum read every readyEvery, for Ready.
// Each read goes on its own, at most readyWithin/readyEvery at once: one
// that a member holds until its deadline (a member without a quorum holds
// a read so) does not hold back the next ones, which the client sends to
// the other members in turn. Read one after the other, each read sent to
// such a member stopped the probe for readyWithin, and every server that
// reaches the same members answered 503 about one second in four
// (TestAttackReadyzOneMemberHolds).
func (b *Backend) probe() {
	defer b.wg.Done()
	t := time.NewTicker(readyEvery)
	defer t.Stop()
	var inflight atomic.Int32
	for {
		if inflight.Load() < int32(readyWithin/readyEvery) {
			inflight.Add(1)
			b.wg.Add(1) // probe counts too: Close's Wait has not returned
			go func() {
				defer b.wg.Done()
				defer inflight.Add(-1)
				ctx, cancel := context.WithTimeout(b.ctx, readyWithin)
				defer cancel()
				if _, err := b.cli.Get(ctx, b.n.epoch(), clientv3.WithCountOnly()); err == nil {
					now := time.Now().UnixNano()
					for {
						old := b.lastQuorum.Load()
						if now <= old || b.lastQuorum.CompareAndSwap(old, now) {
							break
						}
					}
				}
			}()
		}
		select {
		case <-b.ctx.Done():
			return
		case <-t.C:
		}
	}
}

// health watches what this server hears from etcd. A server cut off from
// etcd (or from its quorum) cannot keep its nodes' sessions alive: when
// etcd answered none of its keepalives, and its watch brought nothing, for
// two thirds of the session lease's TTL, it ends its streams, so that
// their clients move to a server that can, before etcd ends their sessions
// (docs/DESIGN.md, "An etcd backend"). Any answer is progress: a slow
// lease, or an etcd that is slow for every server alike, is no reason to
// move (the keeper sends a keepalive every third of the TTL, and etcd
// answers each).
func (b *Backend) health() {
	defer b.wg.Done()
	dropped := false
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-b.ctx.Done():
			return
		case <-t.C:
		}
		silent, ttl, ok := b.keeper.silence(time.Now())
		switch {
		case !ok || silent < ttl*2/3:
			dropped = false
		case !dropped:
			dropped = true
			n := b.w.endStreams()
			b.log.Warn("etcd backend: no keepalive answered; ended this server's streams so that their nodes move to another server", "silent", silent.Round(time.Millisecond), "streams", n)
		}
	}
}
