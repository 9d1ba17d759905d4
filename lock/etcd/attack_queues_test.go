package etcd

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"

	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
)

// watchKiller ends, on demand, the watch streams a client has open: the
// client's watch then ends with an error, and the backend opens it again
// from the revision after the last one it applied (watch.go follow).
type watchKiller struct {
	mu      sync.Mutex
	cancels []context.CancelFunc
}

func (k *watchKiller) intercept(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	if !strings.HasSuffix(method, "/Watch") {
		return streamer(ctx, desc, cc, method, opts...)
	}
	ctx, cancel := context.WithCancel(ctx)
	k.mu.Lock()
	k.cancels = append(k.cancels, cancel)
	k.mu.Unlock()
	return streamer(ctx, desc, cc, method, opts...)
}

func (k *watchKiller) kill() {
	k.mu.Lock()
	cancels := k.cancels
	k.cancels = nil
	k.mu.Unlock()
	for _, c := range cancels {
		c()
	}
}

// checkKeptQueues checks every queue b's watch keeps for revision R (rev
// above 0: offered to a transaction that read the key's record at R)
// against etcd at R: the key's record was written at R, counts the kept
// waiters, and the queue etcd had at R is the kept one, waiter for waiter
// (docs/DESIGN.md, "One round trip for a warm call"). A revision etcd has
// compacted since is skipped. It returns the number of queues checked.
func checkKeptQueues(t *testing.T, ctx context.Context, cli *clientv3.Client, b *Backend, who string) int {
	type kept struct {
		id  string
		rev int64
		ws  []seqWait
	}
	var all []kept
	b.qs.mu.RLock()
	for id, e := range b.qs.m {
		if e.rev > 0 {
			all = append(all, kept{id, e.rev, slices.Clone(e.ws)})
		}
	}
	b.qs.mu.RUnlock()
	checked := 0
	for _, k := range all {
		rec, err := cli.Get(ctx, b.n.keys()+k.id, clientv3.WithRev(k.rev))
		if errors.Is(err, rpctypes.ErrCompacted) {
			continue
		}
		if err != nil {
			if ctx.Err() != nil {
				return checked
			}
			t.Errorf("%s: reading the record of %s at %d: %v", who, k.id, k.rev, err)
			continue
		}
		q, err := cli.Get(ctx, b.qs.qp+k.id+"/", clientv3.WithPrefix(), clientv3.WithRev(k.rev), clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend))
		if errors.Is(err, rpctypes.ErrCompacted) {
			continue
		}
		if err != nil {
			if ctx.Err() != nil {
				return checked
			}
			t.Errorf("%s: reading the queue of %s at %d: %v", who, k.id, k.rev, err)
			continue
		}
		checked++
		if len(rec.Kvs) == 0 || rec.Kvs[0].ModRevision != k.rev {
			t.Errorf("%s: the queue of %s kept for revision %d, where its record was not written: %v", who, k.id, k.rev, rec.Kvs)
			continue
		}
		r, err := decodeKey(rec.Kvs[0].Value)
		if err != nil || r.Queue != len(k.ws) {
			t.Errorf("%s: the queue of %s kept for revision %d has %d waiters, its record counts %d (%v)", who, k.id, k.rev, len(k.ws), r.Queue, err)
		}
		var want []string
		for _, kv := range q.Kvs {
			_, seq, _ := b.qs.waitOf(string(kv.Key))
			want = append(want, fmt.Sprintf("%d=%s", seq, kv.Value))
		}
		var got []string
		for _, w := range k.ws {
			got = append(got, fmt.Sprintf("%d=%s", w.seq, encode(&w.waitRec)))
		}
		if !slices.Equal(got, want) {
			t.Errorf("%s: the queue of %s kept for revision %d:\n  %v\netcd had:\n  %v", who, k.id, k.rev, got, want)
		}
	}
	return checked
}

// TestAttackKeptQueues races nodes on a few keys through three servers of
// one data set (ttl and session waiters that expire or are lost, cancels,
// hand-offs, successes, refusals at promotion, transactions of several
// keys in one request), while their watches are ended and etcd compacted
// past them, so that they list the state again in the middle of the
// servers' own write-throughs, and servers are replaced by new ones. All
// along, every queue a server's watch offers as the queue of a record's
// revision must be etcd's queue at that revision: the record's guard is
// all that ties a hand-off to it (docs/DESIGN.md, "One round trip for a
// warm call").
func TestAttackKeptQueues(t *testing.T) {
	srv := etcdtest.StartEmbedded(t)
	p := etcdtest.Prefix(t)
	cfg := DefaultConfig()
	cfg.Prefix = p
	cfg.RefCounting = true
	cfg.LockTTL = time.Second
	cfg.SessionGrace = time.Second
	cfg.ClaimTimeout = 500 * time.Millisecond
	cfg.CompletedRetention = time.Second

	g := newRelistRig(t, srv, cfg, nil)
	cli := srv.Client(t)
	keys := keysOf([]string{"a", "b"}, lock.Pull, lock.Update, lock.Delete)

	ctx, stop := context.WithTimeout(t.Context(), 4*time.Second) // the run's length
	defer stop()
	var wg sync.WaitGroup
	// The nodes.
	g.race(ctx, &wg, 12, keys, func(r *rand.Rand, b *Backend, k lock.Key, node string) error {
		var err error
		switch op := r.IntN(100); {
		case op < 40:
			lease := lock.LeaseTTL
			if r.IntN(4) == 0 {
				lease = lock.LeaseSession // no stream keeps it: lost after its grace
			}
			_, err = b.TryLock(ctx, lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: node, Lease: lease})
		case op < 65:
			_, err = b.Unlock(ctx, lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: node, Success: r.IntN(3) == 0, Error: "boom"})
		case op < 80:
			_, err = b.Cancel(ctx, k.Type, k.Resource, node)
		default:
			_, err = b.Status(ctx, k.Type, k.Resource, node)
		}
		return err
	})
	// The watches ended, and etcd compacted past them before they open
	// again (follow waits 100 ms): each server lists the state again.
	// Now and then a server is replaced by a new one, which lists the
	// state while the others change it.
	wg.Go(func() { g.relist(ctx, cli, p, 3) })
	// The checker.
	var checked atomic.Int64
	wg.Go(func() {
		for ctx.Err() == nil {
			for i, s := range g.now() {
				checked.Add(int64(checkKeptQueues(t, ctx, cli, s.b, fmt.Sprint("server ", i))))
			}
		}
	})
	wg.Wait()

	var fromWatch uint64
	for _, s := range g.now() {
		w, _ := s.b.qs.stats()
		fromWatch += w
	}
	t.Logf("%d relists, %d kept queues checked, %d queue reads served by the watches", g.relists.Load(), checked.Load(), fromWatch)
	if g.relists.Load() == 0 || checked.Load() == 0 || fromWatch == 0 {
		t.Fatal("the run exercised nothing: no relist, no kept queue checked, or none read")
	}
}

// TestAttackBatchWriteThrough: many nodes queue for one key through one
// server at once, so that their calls share transactions (batch.go) and
// some, past batchOps, are put back for the next one (restore); half of
// them make a session lease in the call (a leased transaction). What the
// server writes through after each commit, the key's record in the cache
// and its queue, must be what etcd has; the hand-offs that follow, made
// through either server, go in the order of the places answered.
func TestAttackBatchWriteThrough(t *testing.T) {
	p := etcdtest.Prefix(t)
	cfg := DefaultConfig()
	// The session-leased waiters have no stream: with the default grace
	// (5 s), a run slowed past it by a loaded machine saw a waiter's
	// session end and the hand-off pass it over.
	cfg.SessionGrace = time.Hour
	b1, _ := countingBackend(t, p, cfg)
	b2, _ := countingBackend(t, p, cfg)
	HoldRequestsForTest(b1, 5*time.Millisecond)
	ctx := t.Context()
	cli := etcdtest.Shared(t).Client(t)
	k := lock.Key{Type: lock.Pull, Resource: "sha256:batch"}
	lockAs(t, b1, k, "h", "acquired")

	const n = 120
	places := make([]int, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			lease := lock.LeaseTTL
			if i%2 == 0 {
				lease = lock.LeaseSession
			}
			r, err := b1.TryLock(ctx, lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: fmt.Sprint("w", i), Lease: lease})
			if err != nil || !r.Queued {
				t.Errorf("w%d: %+v %v", i, r, err)
				return
			}
			places[i] = r.Position
		})
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	order := make([]string, n)
	for i, pos := range places {
		if pos < 1 || pos > n || order[pos-1] != "" {
			t.Fatalf("w%d answered place %d: %v", i, pos, places)
		}
		order[pos-1] = fmt.Sprint("w", i)
	}
	kk := b1.n.key(k)
	// What b1 wrote through, before its watch has the commits or after.
	for _, when := range []string{"written through", "watched"} {
		if when == "watched" {
			caughtUp(t, b1)
		}
		resp, err := cli.Get(ctx, kk)
		if err != nil || len(resp.Kvs) == 0 {
			t.Fatal(resp, err)
		}
		want, err := decodeKey(resp.Kvs[0].Value)
		if err != nil {
			t.Fatal(err)
		}
		want.X = nil
		e := cachedCopy(b1, kk)
		if e.mod() == resp.Kvs[0].ModRevision {
			got, err := e.val.record()
			if err != nil || !reflect.DeepEqual(got, want) {
				t.Errorf("%s: the cache has %+v (%v), etcd %+v", when, got, err, want)
			}
		}
		if e := keptCopy(b1, b1.qs.recID(kk)); e == nil || e.rev != resp.Kvs[0].ModRevision {
			t.Errorf("%s: no queue kept for the record at %d (%+v)", when, resp.Kvs[0].ModRevision, e)
		}
		checkKeptQueues(t, ctx, cli, b1, when)
	}
	holder := "h"
	for i, next := range order {
		b := []*Backend{b1, b2}[i%2]
		res, err := b.Unlock(ctx, lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: holder, Error: "failed"})
		if err != nil || res.NextHolder != next {
			t.Fatalf("hand-off %d from %s: %+v %v, want %s next", i, holder, res, err, next)
		}
		holder = next
		if i%10 == 0 {
			checkKeptQueues(t, ctx, cli, b1, "b1")
			checkKeptQueues(t, ctx, cli, b2, "b2")
		}
	}
}
