package etcd

// Attacks on the queue indexes a success leaves to a sweep (docs/DESIGN.md,
// "Queue indexes a success leaves"; indexes.go): the sweep's guard against
// a node that queues again while it reads, an index left stale across the
// drop of its key's record (whose seqs start at 0 again), the sweep of a
// server whose watch missed the success and lists the state again, sweeps
// sharing requests with other keys' transactions, and three servers
// sweeping while nodes race on the keys.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"

	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
)

// watchGate holds back a client's watch while shut: each message of its
// watch streams, once received, and each watch stream it opens, until the
// gate is opened again. A watch that lags, for exactly as long as a test
// wants.
type watchGate struct {
	mu   sync.Mutex
	open chan struct{} // closed while the gate is open
}

func newWatchGate() *watchGate {
	g := &watchGate{open: make(chan struct{})}
	close(g.open)
	return g
}

func (g *watchGate) shut() {
	g.mu.Lock()
	defer g.mu.Unlock()
	select {
	case <-g.open:
		g.open = make(chan struct{})
	default:
	}
}

func (g *watchGate) release() {
	g.mu.Lock()
	defer g.mu.Unlock()
	select {
	case <-g.open:
	default:
		close(g.open)
	}
}

func (g *watchGate) wait(ctx context.Context) {
	g.mu.Lock()
	ch := g.open
	g.mu.Unlock()
	select {
	case <-ch:
	case <-ctx.Done():
	}
}

func (g *watchGate) intercept(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	if !strings.HasSuffix(method, "/Watch") {
		return streamer(ctx, desc, cc, method, opts...)
	}
	g.wait(ctx)
	cs, err := streamer(ctx, desc, cc, method, opts...)
	if err != nil {
		return cs, err
	}
	return gatedStream{cs, g}, nil
}

type gatedStream struct {
	grpc.ClientStream
	g *watchGate
}

func (s gatedStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	s.g.wait(s.Context())
	return err
}

// gatedBackend opens a server of the data set under p on the shared etcd
// whose client's watch goes through a gate, and, after the gate, through
// more.
func gatedBackend(t *testing.T, cfg Config, more ...grpc.StreamClientInterceptor) (*Backend, *watchGate) {
	t.Helper()
	g := newWatchGate()
	cli := etcdtest.Shared(t).Client(t, grpc.WithChainStreamInterceptor(append([]grpc.StreamClientInterceptor{g.intercept}, more...)...))
	b, err := New(t.Context(), cli, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b, g
}

// checkIndexes checks the queues and queue indexes of the data set of b at
// one revision of etcd (the current one when rev is 0, else rev): every
// waiter has its index, naming its seq, and is in its key's queue once;
// every record counts its waiters; an index whose node waits names that
// node's seq (any other index is stale: its node does not wait). It
// returns the stale indexes, by key, and the revision it read.
func checkIndexes(t *testing.T, ctx context.Context, cli *clientv3.Client, b *Backend, who string) (map[string][]string, int64) {
	t.Helper()
	resp, err := cli.Get(ctx, b.n.p, clientv3.WithPrefix())
	if err != nil {
		if ctx.Err() == nil {
			t.Errorf("%s: reading the data set: %v", who, err)
		}
		return nil, 0
	}
	rev := resp.Header.Revision
	type qkey struct{ id, node string }
	seqs := map[qkey][]uint64{} // a waiter's seqs, from the queue
	index := map[qkey]uint64{}  // a node's index
	counts := map[string]int{}  // the waiters of a key, from the queue
	records := map[string]int{} // the waiters a record counts
	for _, kv := range resp.Kvs {
		key := string(kv.Key)
		switch {
		case strings.HasPrefix(key, b.n.keys()):
			r, err := decodeKey(kv.Value)
			if err != nil {
				t.Errorf("%s at %d: %s: %v", who, rev, key, err)
				continue
			}
			records[b.qs.recID(key)] = r.Queue
		case strings.HasPrefix(key, b.n.p+"q/"):
			id, seq, ok := b.qs.waitOf(key)
			i := strings.LastIndexByte(key, '/')
			if !ok || i < 0 {
				t.Errorf("%s at %d: a queue entry not ours: %s", who, rev, key)
				continue
			}
			seqs[qkey{id, key[i+1:]}] = append(seqs[qkey{id, key[i+1:]}], seq)
			counts[id]++
		case strings.HasPrefix(key, b.n.p+"qn/"):
			id, ok := b.n.indexID(key)
			seq, err := strconv.ParseUint(string(kv.Value), 16, 64)
			if !ok || err != nil {
				t.Errorf("%s at %d: a queue index not ours: %s = %s", who, rev, key, kv.Value)
				continue
			}
			index[qkey{id, key[strings.LastIndexByte(key, '/')+1:]}] = seq
		}
	}
	for w, ss := range seqs {
		if len(ss) != 1 {
			t.Errorf("%s at %d: %s waits for %s %d times: %v", who, rev, w.node, w.id, len(ss), ss)
			continue
		}
		if s, ok := index[w]; !ok || s != ss[0] {
			t.Errorf("%s at %d: %s waits for %s at %d, its index is %d (there: %v)", who, rev, w.node, w.id, ss[0], s, ok)
		}
	}
	for id, n := range counts {
		if records[id] != n {
			t.Errorf("%s at %d: %s has %d waiters, its record counts %d", who, rev, id, n, records[id])
		}
	}
	for id, n := range records {
		if counts[id] != n {
			t.Errorf("%s at %d: %s's record counts %d waiters, it has %d", who, rev, id, n, counts[id])
		}
	}
	stale := map[string][]string{}
	for w := range index {
		if _, ok := seqs[w]; !ok {
			stale[w.id] = append(stale[w.id], w.node)
		}
	}
	return stale, rev
}

// seqOf is node's seq in k's queue as etcd has it now, -1 for none.
func seqOf(t *testing.T, cli *clientv3.Client, b *Backend, k lock.Key, node string) int64 {
	t.Helper()
	resp, err := cli.Get(t.Context(), b.n.queue(k), clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		t.Fatal(err)
	}
	for _, kv := range resp.Kvs {
		if _, seq, ok := b.qs.waitOf(string(kv.Key)); ok && strings.HasSuffix(string(kv.Key), "/"+esc(node)) {
			return int64(seq)
		}
	}
	return -1
}

// queueIndexOf is node's queue index of k as etcd has it now, -1 for none.
func queueIndexOf(t *testing.T, cli *clientv3.Client, b *Backend, k lock.Key, node string) int64 {
	t.Helper()
	resp, err := cli.Get(t.Context(), b.n.queueNode(k, node))
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		return -1
	}
	seq, err := strconv.ParseUint(string(resp.Kvs[0].Value), 16, 64)
	if err != nil {
		t.Fatal(err)
	}
	return int64(seq)
}

// TestAttackSweepGuard: a node queues again, on another server, after the
// sweeping server's watch last told it anything: the sweep reads the key's
// record and queue from a cache that misses the new waiter, and would
// delete its index as stale. The guard of the record it read fails the
// sweep, which reads etcd again and leaves the new waiter's index; with no
// waiter left (one range delete of every index) and with a queue formed
// again (the indexes no waiter has), docs/DESIGN.md, "Queue indexes a
// success leaves".
func TestAttackSweepGuard(t *testing.T) {
	cli := etcdtest.Shared(t).Client(t)
	p := etcdtest.Prefix(t)
	cfg := Config{Rules: lock.DefaultRules(), Prefix: p}
	a, gate := gatedBackend(t, cfg)
	b, err := New(t.Context(), etcdtest.Shared(t).Client(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	for _, s := range []*Backend{a, b} {
		LeaveIndexesForTest(s, 0, time.Hour) // swept here, by the test, only
	}
	ctx := t.Context()
	for _, formed := range []bool{false, true} {
		t.Run(fmt.Sprintf("queueFormedAgain=%v", formed), func(t *testing.T) {
			k := lock.Key{Type: lock.Pull, Resource: fmt.Sprintf("sha256:guard-%v", formed)}
			succeedOver(t, b, k, "w1", "w2", "w3")
			lockAs(t, b, k, "x", "acquired")
			want := []string{"w1"} // the waiters after the node that queues again
			again := "w1"
			if formed {
				lockAs(t, b, k, "y", "queued")
				again, want = "w2", []string{"w2", "y"}
			}
			caughtUp(t, a, b)
			if !a.rc.mayHoldGroup(a.n.queueNodes(k)) {
				t.Fatal("the sweeping server's cache has no index of the key")
			}
			// From here a's watch tells it nothing.
			gate.shut()
			defer gate.release()
			lockAs(t, b, k, again, "queued")
			conflicts := a.conflicts.Load()
			if more, err := a.sweepIndexes(k); err != nil || more {
				t.Fatalf("the sweep: more %v, %v", more, err)
			}
			gate.release()
			if got := indexNodes(t, cli, a, k, 0); !slices.Equal(got, want) {
				t.Fatalf("indexes after the sweep: %v, want %v", got, want)
			}
			if a.conflicts.Load() == conflicts {
				t.Fatal("the sweep did not read the stale cache first: the attack missed")
			}
			if s, i := seqOf(t, cli, a, k, again), queueIndexOf(t, cli, a, k, again); s < 0 || s != i {
				t.Fatalf("%s waits at %d, its index is %d", again, s, i)
			}
			for i, s := range []*Backend{a, b} {
				caughtUp(t, s, a, b)
				if st := mustStatus(t, s, k, again); st.Position != len(want) || st.QueueLength != len(want) {
					t.Fatalf("server %d: %s's status after the sweep: %+v", i, again, st)
				}
				checkKeptQueues(t, ctx, cli, s, fmt.Sprint("server ", i))
				checkCacheIsEtcd(t, ctx, cli, s, p, fmt.Sprint("server ", i))
			}
			if stale, rev := checkIndexes(t, ctx, cli, a, "etcd"); len(stale) != 0 {
				t.Fatalf("stale indexes at %d after the sweep: %v", rev, stale)
			}
		})
	}
}

// TestAttackStaleIndexAfterDrop: a success with no completion kept leaves
// its key's record bare, and its timer drops it, stale indexes and all; the
// key's next record numbers its waiters from 0 again, so that a stale index
// names the seq of another node's entry. That entry is not the node's: its
// status, its cancel and the end of its session find no place, whether the
// entry is read from the watch's queue or from etcd, and its lock queues it
// at the end (docs/DESIGN.md, "Queue indexes a success leaves": "An entry at
// a stale index's seq is never the node's unless its index says so").
func TestAttackStaleIndexAfterDrop(t *testing.T) {
	rules := lock.DefaultRules()
	rules.CompletedRetention = 0 // no completion kept: the record is bare after the success
	cli, p, bs := leavingServers(t, 2, rules, 0, time.Hour)
	ctx := t.Context()
	k := lock.Key{Type: lock.Pull, Resource: "sha256:dropped"}
	lockAs(t, bs[0], k, "h", "acquired")
	// a waits at 0 under a session lease, b at 1.
	if r, err := bs[0].TryLock(ctx, lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: "a", Lease: lock.LeaseSession}); err != nil || !r.Queued {
		t.Fatalf("a's lock: %+v %v", r, err)
	}
	lockAs(t, bs[1], k, "b", "queued")
	if s := seqOf(t, cli, bs[0], k, "a"); s != 0 {
		t.Fatalf("a waits at %d, want 0", s)
	}
	if _, err := bs[1].Unlock(ctx, lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: "h", Success: true}); err != nil {
		t.Fatal(err)
	}
	Eventually(t, "the bare record dropped", func() bool {
		resp, err := cli.Get(ctx, bs[0].n.key(k))
		return err == nil && len(resp.Kvs) == 0
	})
	if got := indexNodes(t, cli, bs[0], k, 0); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("indexes after the drop: %v", got)
	}
	// The next record: b waits at 0, where a's stale index points, c at 1.
	lockAs(t, bs[1], k, "x", "acquired")
	lockAs(t, bs[0], k, "b", "queued")
	lockAs(t, bs[1], k, "c", "queued")
	if s, i := seqOf(t, cli, bs[0], k, "b"), queueIndexOf(t, cli, bs[0], k, "a"); s != 0 || i != 0 {
		t.Fatalf("b waits at %d, a's stale index is %d: want both 0", s, i)
	}
	rec, _, ok := sessionOf(t, cli, bs[0], "a")
	if !ok {
		t.Fatal("a has no session")
	}
	lease := rec.Lease
	id := bs[0].qs.recID(bs[0].n.key(k))
	for i, b := range bs {
		for _, fromEtcd := range []bool{false, true} {
			caughtUp(t, b, bs...)
			if fromEtcd {
				// The watch's queue is not vouched for: the entries
				// are read from etcd.
				b.qs.mu.Lock()
				if e := b.qs.m[id]; e != nil {
					e.rev = -1
				}
				b.qs.mu.Unlock()
			}
			_, before := b.qs.stats()
			who := fmt.Sprintf("server %d, queue from etcd %v", i, fromEtcd)
			if st := mustStatus(t, b, k, "a"); st.Position != 0 || st.QueueLength != 2 {
				t.Fatalf("%s: a's status with its stale index: %+v", who, st)
			}
			if c, err := b.Cancel(ctx, k.Type, k.Resource, "a"); err != nil || c.Dequeued || c.Released {
				t.Fatalf("%s: a's cancel with its stale index: %+v %v", who, c, err)
			}
			// The session's index names the key (the end of the session
			// drops it each time).
			if _, err := cli.Put(ctx, b.n.nodeKey("a", k), strconv.FormatInt(lease, 16)); err != nil {
				t.Fatal(err)
			}
			if n, err := b.endSession(ctx, "a", lease); err != nil || n != 1 {
				t.Fatalf("%s: the end of a's session: %d keys, %v", who, n, err)
			}
			if _, after := b.qs.stats(); fromEtcd && after == before {
				t.Fatalf("%s: no queue read went to etcd: the attack missed", who)
			}
			if st := mustStatus(t, b, k, "b"); st.Position != 1 || st.QueueLength != 2 {
				t.Fatalf("%s: b's status: %+v", who, st)
			}
		}
	}
	r, err := bs[0].TryLock(ctx, lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: "a", Lease: lock.LeaseTTL})
	if err != nil || !r.Queued || r.Position != 3 {
		t.Fatalf("a's lock with its stale index: %+v %v, want queued third", r, err)
	}
	if more, err := bs[1].sweepIndexes(k); err != nil || more {
		t.Fatalf("the sweep: more %v, %v", more, err)
	}
	if got := indexNodes(t, cli, bs[0], k, 0); !slices.Equal(got, []string{"a", "b", "c"}) {
		t.Fatalf("indexes after the sweep: %v", got)
	}
	for i, b := range bs {
		caughtUp(t, b, bs...)
		checkKeptQueues(t, ctx, cli, b, fmt.Sprint("server ", i))
		checkCacheIsEtcd(t, ctx, cli, b, p, fmt.Sprint("server ", i))
	}
	if stale, rev := checkIndexes(t, ctx, cli, bs[0], "etcd"); len(stale) != 0 {
		t.Fatalf("stale indexes at %d: %v", rev, stale)
	}
}

// TestAttackSweepAfterRelist: a server whose watch never sees a success
// that left indexes (its watch was down, and etcd compacted past the
// success before it came back) lists the state again, finds more indexes
// than waiters, and sweeps them, though the server of the success never
// does (docs/DESIGN.md, "Queue indexes a success leaves": "every list of
// the state for each key whose indexes outnumber its waiters").
func TestAttackSweepAfterRelist(t *testing.T) {
	srv := etcdtest.Shared(t)
	cli := srv.Client(t)
	p := etcdtest.Prefix(t)
	cfg := Config{Rules: lock.DefaultRules(), Prefix: p}
	kill := &watchKiller{}
	a, gate := gatedBackend(t, cfg, kill.intercept)
	b, err := New(t.Context(), srv.Client(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	LeaveIndexesForTest(a, 0, time.Hour)
	LeaveIndexesForTest(b, 0, time.Hour) // b never sweeps in the test's time
	ctx := t.Context()
	k := lock.Key{Type: lock.Pull, Resource: "sha256:relisted"}
	lockAs(t, b, k, "h", "acquired")
	for _, w := range []string{"w1", "w2", "w3"} {
		lockAs(t, b, k, w, "queued")
	}
	// A waiter that stays: the list's count of waiters is not 0.
	k2 := lock.Key{Type: lock.Pull, Resource: "sha256:relisted-2"}
	lockAs(t, b, k2, "h", "acquired")
	lockAs(t, b, k2, "v", "queued")
	caughtUp(t, a, b)
	// a's watch ends, and opens again only once etcd has compacted past
	// the success.
	gate.shut()
	kill.kill()
	if _, err := b.Unlock(ctx, lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: "h", Success: true}); err != nil {
		t.Fatal(err)
	}
	lockAs(t, b, k, "x", "acquired")
	lockAs(t, b, k, "w2", "queued") // one of them queues again
	resp, err := cli.Put(ctx, p+"bump", "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Compact(ctx, resp.Header.Revision); err != nil {
		t.Fatal(err)
	}
	sweeps := a.ix.sweeps.Load()
	a.ix.after.Store(int64(10 * time.Millisecond))
	gate.release()
	Eventually(t, "a's sweep after its list", func() bool {
		return a.ix.sweeps.Load() > sweeps && slices.Equal(indexNodes(t, cli, a, k, 0), []string{"w2"})
	})
	if got := indexNodes(t, cli, a, k2, 0); !slices.Equal(got, []string{"v"}) {
		t.Fatalf("the other key's indexes: %v", got)
	}
	if n := b.ix.sweeps.Load(); n != 0 {
		t.Fatalf("b swept %d times", n)
	}
	for i, s := range []*Backend{a, b} {
		caughtUp(t, s, a, b)
		checkKeptQueues(t, ctx, cli, s, fmt.Sprint("server ", i))
		checkCacheIsEtcd(t, ctx, cli, s, p, fmt.Sprint("server ", i))
	}
	if st := mustStatus(t, a, k, "w2"); st.Position != 1 {
		t.Fatalf("w2's status: %+v", st)
	}
}

// TestAttackSweepGrouped: sweeps of many keys at once share requests with
// each other and with other keys' calls (group.go), each sweep's one range
// delete in a request with the others' writes. A sweep deletes its own
// key's stale indexes and nothing else: not those of a key whose resource
// begins with its resource ("r1" and "r1x"), whose waiters' indexes stay.
func TestAttackSweepGrouped(t *testing.T) {
	cli, p, bs := leavingServers(t, 1, lock.DefaultRules(), 0, time.Hour)
	b := bs[0]
	ctx := t.Context()
	const n = 12
	var keys []lock.Key
	live := map[lock.Key][]string{}
	for i := range n {
		for _, suffix := range []string{"", "x"} {
			k := lock.Key{Type: lock.Pull, Resource: fmt.Sprintf("r%d%s", i, suffix)}
			keys = append(keys, k)
			succeedOver(t, b, k, "w1", "w2", "w3")
			lockAs(t, b, k, "x", "acquired")
			if suffix == "x" || i%2 == 0 {
				// A queue again: the sweep keeps its waiters' indexes.
				lockAs(t, b, k, "w2", "queued")
				lockAs(t, b, k, "y", "queued")
				live[k] = []string{"w2", "y"}
			}
		}
	}
	caughtUp(t, b)
	HoldRequestsForTest(b, 3*time.Millisecond) // what arrives meanwhile shares the request
	grouped := GroupedRequestsForTest(b)
	var wg sync.WaitGroup
	errs := make(chan error, 4*len(keys))
	for _, k := range keys {
		wg.Go(func() {
			if _, err := b.sweepIndexes(k); err != nil {
				errs <- fmt.Errorf("sweeping %v: %w", k, err)
			}
		})
		// Calls of other keys, made with them.
		wg.Go(func() {
			o := lock.Key{Type: lock.Update, Resource: k.Resource}
			if _, err := b.TryLock(ctx, lock.LockRequest{Type: o.Type, Resource: o.Resource, Node: "u", Lease: lock.LeaseTTL}); err != nil {
				errs <- fmt.Errorf("locking %v: %w", o, err)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if GroupedRequestsForTest(b) == grouped {
		t.Fatal("no request was shared: the attack missed")
	}
	for _, k := range keys {
		if got := indexNodes(t, cli, b, k, 0); !slices.Equal(got, live[k]) {
			t.Errorf("%v's indexes after the sweeps: %v, want %v", k, got, live[k])
		}
	}
	caughtUp(t, b)
	checkKeptQueues(t, ctx, cli, b, "server")
	checkCacheIsEtcd(t, ctx, cli, b, p, "server")
	if stale, rev := checkIndexes(t, ctx, cli, b, "etcd"); len(stale) != 0 {
		t.Fatalf("stale indexes at %d: %v", rev, stale)
	}
}

// TestAttackSweepRace races nodes on keys of two resources (every type, so
// that a success writes its siblings' records too; references counted)
// through three servers that leave the indexes of every success with
// waiters and sweep them at once, while each server also sweeps keys at
// random and has its watch ended and etcd compacted past it (a list, which
// schedules sweeps too), and servers are replaced. At every revision the
// checker reads, each waiter has its index and the index its seq, and each
// record counts its waiters; at the end, the sweeps leave no stale index,
// and each server's kept queues and cache are etcd's.
func TestAttackSweepRace(t *testing.T) {
	srv := etcdtest.StartEmbedded(t)
	p := etcdtest.Prefix(t)
	cfg := DefaultConfig()
	cfg.Prefix = p
	cfg.RefCounting = true
	cfg.LockTTL = time.Second
	cfg.SessionGrace = time.Second
	cfg.ClaimTimeout = 500 * time.Millisecond
	cfg.CompletedRetention = 200 * time.Millisecond // records dropped, seqs from 0 again
	// Swept 50 to 100 ms after each success: long enough for nodes to
	// call on the stale indexes meanwhile.
	g := newRelistRig(t, srv, cfg, func(b *Backend) { LeaveIndexesForTest(b, 0, 50*time.Millisecond) })
	cli := srv.Client(t)
	keys := keysOf([]string{"a", "b"}, lock.Pull, lock.Update, lock.Delete)
	ctx, stop := context.WithTimeout(t.Context(), 5*time.Second)
	defer stop()
	var wg sync.WaitGroup
	var successes atomic.Int64
	g.race(ctx, &wg, 10, keys, func(r *rand.Rand, b *Backend, k lock.Key, node string) error {
		var err error
		switch op := r.IntN(100); {
		case op < 45:
			lease := lock.LeaseTTL
			if r.IntN(4) == 0 {
				lease = lock.LeaseSession // no stream keeps it: lost after its grace
			}
			var res lock.LockResult
			res, err = b.TryLock(ctx, lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: node, Lease: lease})
			if err == nil && res.Acquired && r.IntN(2) == 0 {
				// Most holds end at once, most in a success, so that
				// queues are told and their indexes left.
				var ur lock.UnlockResult
				success := r.IntN(4) != 0
				ur, err = b.Unlock(ctx, lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: node, Success: success, Error: "boom", Token: res.Token})
				if err == nil && success && !ur.Replayed {
					successes.Add(1)
				}
			}
		case op < 65:
			var res lock.UnlockResult
			success := r.IntN(3) != 0
			res, err = b.Unlock(ctx, lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: node, Success: success, Error: "boom"})
			if err == nil && success && !res.Replayed {
				successes.Add(1)
			}
		case op < 75:
			_, err = b.Cancel(ctx, k.Type, k.Resource, node)
		case op < 85:
			if _, err = b.sweepIndexes(k); err != nil && b.ctx.Err() != nil {
				err = nil // a server replaced meanwhile: its sweep ends with its context
			}
		default:
			_, err = b.Status(ctx, k.Type, k.Resource, node)
		}
		return err
	})
	wg.Go(func() { g.relist(ctx, cli, p, 4) })
	var checked, sawStale atomic.Int64
	wg.Go(func() {
		for ctx.Err() == nil && !t.Failed() {
			if stale, rev := checkIndexes(t, ctx, cli, g.now()[0].b, "etcd"); rev != 0 {
				checked.Add(1)
				if len(stale) > 0 {
					sawStale.Add(1)
				}
			}
		}
	})
	wg.Wait()
	t.Logf("%d successes, %d relists, %d revisions checked, %d with stale indexes", successes.Load(), g.relists.Load(), checked.Load(), sawStale.Load())
	if successes.Load() == 0 || checked.Load() == 0 || sawStale.Load() == 0 {
		t.Fatal("the run exercised nothing: no success, no revision checked, or no stale index seen")
	}
	b0 := g.now()[0].b
	Eventually(t, "the sweeps to leave no stale index", func() bool {
		stale, _ := checkIndexes(t, t.Context(), cli, b0, "etcd at the end")
		return len(stale) == 0
	})
	for i, s := range g.now() {
		who := fmt.Sprint("server ", i, " at the end")
		resp, err := cli.Get(t.Context(), p+"bump")
		if err != nil {
			t.Fatal(err)
		}
		Eventually(t, who+"'s watch to catch up", func() bool { return s.b.w.caughtUp(resp.Header.Revision, time.Second) })
		checkKeptQueues(t, t.Context(), cli, s.b, who)
		checkCacheIsEtcd(t, t.Context(), cli, s.b, p, who)
	}
}

// TestAttackStaleIndexOperatorsView: the operators' view finds a node's
// waits by its queue index in the cache (InspectKeys' node filter, a
// session's keys): a stale index, with a queue formed again on its key,
// shows no wait there, on either server, until the node queues again
// (docs/DESIGN.md, "What a server keeps": "a node waits for a key when
// the cache has its queue index and the watch's queue has the node at
// that index's place"); also when the key's record was dropped in
// between, and another node waits at the stale index's seq.
func TestAttackStaleIndexOperatorsView(t *testing.T) {
	rules := lock.DefaultRules()
	rules.CompletedRetention = 0 // the record bare after the success, and dropped
	cli, _, bs := leavingServers(t, 2, rules, 0, time.Hour)
	ctx := t.Context()
	k := lock.Key{Type: lock.Pull, Resource: "sha256:viewed"}
	lockSession := func(b *Backend, node, want string) {
		t.Helper()
		r, err := b.TryLock(ctx, lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: node, Lease: lock.LeaseSession})
		if err != nil || (want == "queued") != r.Queued || (want == "acquired") != r.Acquired {
			t.Fatalf("%s's lock: %+v %v, want %s", node, r, err, want)
		}
	}
	// view is what server b shows of node a: the keys of its node filter,
	// and its session's keys.
	view := func(b *Backend) (keys []string, sessionKeys int) {
		t.Helper()
		page, err := b.InspectKeys(ctx, lock.KeyQuery{Node: "a"})
		if err != nil {
			t.Fatal(err)
		}
		for _, v := range page.Keys {
			keys = append(keys, v.Key.String())
		}
		sp, err := b.InspectSessions(ctx, lock.SessionQuery{Node: "a"})
		if err != nil || len(sp.Sessions) != 1 {
			t.Fatalf("a's session: %+v %v", sp, err)
		}
		return keys, sp.Sessions[0].Keys
	}
	check := func(what string, want []string, wantSession int) {
		t.Helper()
		for i, b := range bs {
			caughtUp(t, b, bs...)
			if keys, n := view(b); !slices.Equal(keys, want) || n != wantSession {
				t.Fatalf("%s, server %d: a's keys %v, its session's %d; want %v and %d", what, i, keys, n, want, wantSession)
			}
		}
	}
	lockAs(t, bs[1], k, "h", "acquired")
	lockSession(bs[0], "a", "queued")
	lockAs(t, bs[1], k, "b", "queued")
	check("a waiting", []string{k.String()}, 1)
	if _, err := bs[1].Unlock(ctx, lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: "h", Success: true}); err != nil {
		t.Fatal(err)
	}
	Eventually(t, "the bare record dropped", func() bool {
		resp, err := cli.Get(ctx, bs[0].n.key(k))
		return err == nil && len(resp.Kvs) == 0
	})
	lockAs(t, bs[0], k, "x", "acquired")
	lockAs(t, bs[1], k, "y", "queued")
	if got := indexNodes(t, cli, bs[0], k, 0); !slices.Equal(got, []string{"a", "b", "y"}) {
		t.Fatalf("indexes: %v", got)
	}
	if s, i := seqOf(t, cli, bs[0], k, "y"), queueIndexOf(t, cli, bs[0], k, "a"); s != i {
		t.Fatalf("y waits at %d, a's stale index is %d: want them alike", s, i)
	}
	check("a's index stale", nil, 0)
	lockSession(bs[1], "a", "queued")
	check("a waiting again", []string{k.String()}, 1)
}
