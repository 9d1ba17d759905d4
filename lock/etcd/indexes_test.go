package etcd

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
)

// indexNodes returns the nodes with a queue index of k in etcd, at rev (0:
// now), sorted.
func indexNodes(t *testing.T, cli *clientv3.Client, b *Backend, k lock.Key, rev int64) []string {
	t.Helper()
	opts := []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithKeysOnly()}
	if rev != 0 {
		opts = append(opts, clientv3.WithRev(rev))
	}
	resp, err := cli.Get(t.Context(), b.n.queueNodes(k), opts...)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, kv := range resp.Kvs {
		out = append(out, string(kv.Key[len(b.n.queueNodes(k)):]))
	}
	slices.Sort(out)
	return out
}

// Eventually waits, at most a minute, until cond holds: a state a rule
// must reach (a liveness bound, not a timing assertion). The package's
// outside tests use it too.
func Eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after a minute: %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// leavingServers opens n servers of one new data set, with rules, whose
// successes with more than over waiters leave their indexes, swept after
// about after.
func leavingServers(t *testing.T, n int, rules lock.Rules, over int, after time.Duration) (*clientv3.Client, string, []*Backend) {
	t.Helper()
	srv := etcdtest.Shared(t)
	p := etcdtest.Prefix(t)
	var bs []*Backend
	for range n {
		b, err := New(t.Context(), srv.Client(t), Config{Rules: rules, Prefix: p})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { b.Close() })
		LeaveIndexesForTest(b, over, after)
		bs = append(bs, b)
	}
	return srv.Client(t), p, bs
}

// TestSuccessLeavesIndexes: a success with more waiters than
// leaveIndexesOver deletes their queue entries, which tells them, and
// leaves their queue indexes, which a sweep deletes a moment later; one
// with fewer deletes both itself (docs/DESIGN.md, "Queue indexes a success
// leaves").
func TestSuccessLeavesIndexes(t *testing.T) {
	cli, p, bs := leavingServers(t, 2, lock.DefaultRules(), 3, 20*time.Millisecond)
	for _, waiters := range []int{3, 4, 9} {
		t.Run(fmt.Sprintf("waiters=%d", waiters), func(t *testing.T) {
			k := lock.Key{Type: lock.Pull, Resource: fmt.Sprintf("sha256:left-%d", waiters)}
			lockAs(t, bs[0], k, "h", "acquired")
			var nodes []string
			for i := range waiters {
				nodes = append(nodes, fmt.Sprintf("w%d", i))
				lockAs(t, bs[i%2], k, nodes[i], "queued")
			}
			slices.Sort(nodes)
			before := bs[0].ix.sweeps.Load() + bs[1].ix.sweeps.Load()
			if _, err := bs[1].Unlock(t.Context(), lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: "h", Success: true}); err != nil {
				t.Fatal(err)
			}
			rev := bs[1].lastCommit.Load()
			resp, err := cli.Get(t.Context(), bs[0].n.queue(k), clientv3.WithPrefix(), clientv3.WithCountOnly(), clientv3.WithRev(rev))
			if err != nil || resp.Count != 0 {
				t.Fatalf("queue entries after the success: %v %v", resp, err)
			}
			left := indexNodes(t, cli, bs[0], k, rev)
			rec, err := cli.Get(t.Context(), bs[0].n.key(k), clientv3.WithRev(rev))
			if err != nil || len(rec.Kvs) != 1 {
				t.Fatalf("the record at the success: %v %v", rec, err)
			}
			r, err := decodeKey(rec.Kvs[0].Value)
			if err != nil || r.X == nil || !r.X.Skip || r.Queue != 0 {
				t.Fatalf("the success's record: %+v %v", r, err)
			}
			if waiters <= 3 {
				if len(left) != 0 || r.X.Left {
					t.Fatalf("a success with %d waiters left indexes %v (Left %v)", waiters, left, r.X.Left)
				}
				return
			}
			if !slices.Equal(left, nodes) || !r.X.Left {
				t.Fatalf("a success with %d waiters left indexes %v (Left %v), want %v", waiters, left, r.X.Left, nodes)
			}
			for i, n := range nodes {
				if st, err := bs[i%2].Status(t.Context(), k.Type, k.Resource, n); err != nil || st.Position != 0 || st.QueueLength != 0 {
					t.Fatalf("%s's status with its index left: %+v %v", n, st, err)
				}
			}
			Eventually(t, "the indexes the success left swept", func() bool {
				return len(indexNodes(t, cli, bs[0], k, 0)) == 0
			})
			// The sweep is counted once its transaction has returned,
			// after etcd shows its deletes.
			Eventually(t, "the indexes went with no sweep counted", func() bool {
				return bs[0].ix.sweeps.Load()+bs[1].ix.sweeps.Load() > before
			})
		})
	}
	for i, b := range bs {
		caughtUp(t, b, bs...)
		checkKeptQueues(t, t.Context(), cli, b, fmt.Sprint("server ", i))
		checkCacheIsEtcd(t, t.Context(), cli, b, p, fmt.Sprint("server ", i))
	}
}

// TestStaleIndexIsNoPlace: an index a success left is no place in the
// queue that forms after it, on either server: its node is not queued, its
// cancel dequeues nothing, and its lock queues it anew at the end; the
// sweep then deletes only the stale indexes, never a waiter's.
func TestStaleIndexIsNoPlace(t *testing.T) {
	// Every success leaves them; none is swept by itself.
	cli, p, bs := leavingServers(t, 2, lock.DefaultRules(), 0, time.Hour)
	ctx := t.Context()
	k := lock.Key{Type: lock.Pull, Resource: "sha256:stale"}
	lockAs(t, bs[0], k, "h", "acquired")
	lockAs(t, bs[1], k, "a", "queued")
	lockAs(t, bs[0], k, "b", "queued")
	if _, err := bs[0].Unlock(ctx, lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: "h", Success: true}); err != nil {
		t.Fatal(err)
	}
	if got := indexNodes(t, cli, bs[0], k, 0); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("indexes left: %v", got)
	}
	// A new round on the key: x holds, y waits; a's and b's indexes are
	// still there.
	lockAs(t, bs[1], k, "x", "acquired")
	lockAs(t, bs[0], k, "y", "queued")
	for i, b := range bs {
		if i == 1 {
			caughtUp(t, b, bs...)
		}
		st, err := b.Status(ctx, k.Type, k.Resource, "a")
		if err != nil || st.Position != 0 || st.QueueLength != 1 {
			t.Fatalf("server %d: a's status with a stale index: %+v %v", i, st, err)
		}
		c, err := b.Cancel(ctx, k.Type, k.Resource, "b")
		if err != nil || c.Dequeued || c.Released {
			t.Fatalf("server %d: b's cancel with a stale index: %+v %v", i, c, err)
		}
	}
	r, err := bs[1].TryLock(ctx, lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: "a", Lease: lock.LeaseTTL})
	if err != nil || !r.Queued || r.Position != 2 {
		t.Fatalf("a's lock with a stale index: %+v %v, want queued second", r, err)
	}
	if st := mustStatus(t, bs[0], k, "y"); st.Position != 1 || st.QueueLength != 2 {
		t.Fatalf("y's status: %+v", st)
	}
	// The sweep: b's index is stale, a's is a's place again, y's is y's.
	if more, err := bs[0].sweepIndexes(k); err != nil || more {
		t.Fatalf("sweep: more %v, %v", more, err)
	}
	if got := indexNodes(t, cli, bs[0], k, 0); !slices.Equal(got, []string{"a", "y"}) {
		t.Fatalf("indexes after the sweep: %v, want a and y", got)
	}
	// The queue goes on as if no index had been left.
	if _, err := bs[1].Unlock(ctx, lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: "x", Error: "failed"}); err != nil {
		t.Fatal(err)
	}
	if st := mustStatus(t, bs[0], k, "y"); st.Holder != "y" {
		t.Fatalf("after x failed: %+v, want y holding", st)
	}
	if st := mustStatus(t, bs[1], k, "a"); st.Position != 1 || st.QueueLength != 1 {
		t.Fatalf("a's status: %+v", st)
	}
	for i, b := range bs {
		caughtUp(t, b, bs...)
		checkKeptQueues(t, ctx, cli, b, fmt.Sprint("server ", i))
		checkCacheIsEtcd(t, ctx, cli, b, p, fmt.Sprint("server ", i))
	}
}

// TestSweepManyStale: with waiters on the key, the stale indexes are
// deleted sweepBatch a transaction, until none is left.
func TestSweepManyStale(t *testing.T) {
	cli, _, bs := leavingServers(t, 1, lock.DefaultRules(), 0, time.Hour)
	b := bs[0]
	k := lock.Key{Type: lock.Pull, Resource: "sha256:many"}
	n := sweepBatch + 30
	var waiters []string
	for i := range n {
		waiters = append(waiters, fmt.Sprintf("w%03d", i))
	}
	succeedOver(t, b, k, waiters...)
	lockAs(t, b, k, "x", "acquired")
	lockAs(t, b, k, "w007", "queued")
	more, err := b.sweepIndexes(k)
	if err != nil || !more {
		t.Fatalf("the first sweep: more %v, %v", more, err)
	}
	if got := len(indexNodes(t, cli, b, k, 0)); got != n-sweepBatch {
		t.Fatalf("%d indexes after the first sweep, want %d", got, n-sweepBatch)
	}
	if more, err = b.sweepIndexes(k); err != nil || more {
		t.Fatalf("the second sweep: more %v, %v", more, err)
	}
	if got := indexNodes(t, cli, b, k, 0); !slices.Equal(got, []string{"w007"}) {
		t.Fatalf("indexes after the sweeps: %v", got)
	}
	if st := mustStatus(t, b, k, "w007"); st.Position != 1 {
		t.Fatalf("w007's status: %+v", st)
	}
}

// TestStaleIndexesSweptByTheNextServer: a server that stops right after a
// success, before its sweep, leaves the indexes to the servers that list
// the state after it.
func TestStaleIndexesSweptByTheNextServer(t *testing.T) {
	srv := etcdtest.Shared(t)
	cli := srv.Client(t)
	p := etcdtest.Prefix(t)
	b, err := New(t.Context(), srv.Client(t), Config{Rules: lock.DefaultRules(), Prefix: p})
	if err != nil {
		t.Fatal(err)
	}
	LeaveIndexesForTest(b, 0, time.Hour)
	k := lock.Key{Type: lock.Pull, Resource: "sha256:orphan"}
	lockAs(t, b, k, "h", "acquired")
	lockAs(t, b, k, "w", "queued")
	if _, err := b.Unlock(t.Context(), lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: "h", Success: true}); err != nil {
		t.Fatal(err)
	}
	b.Close()
	if got := indexNodes(t, cli, b, k, 0); !slices.Equal(got, []string{"w"}) {
		t.Fatalf("indexes left: %v", got)
	}
	next, err := New(context.Background(), srv.Client(t), Config{Rules: lock.DefaultRules(), Prefix: p})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { next.Close() })
	Eventually(t, "the next server swept the indexes", func() bool {
		return len(indexNodes(t, cli, next, k, 0)) == 0
	})
}

// succeedOver has h take k, waiters queue behind it, and h succeed: on the
// servers of leavingServers, the success leaves the waiters' indexes.
func succeedOver(t *testing.T, b *Backend, k lock.Key, waiters ...string) {
	t.Helper()
	lockAs(t, b, k, "h", "acquired")
	for _, w := range waiters {
		lockAs(t, b, k, w, "queued")
	}
	if _, err := b.Unlock(t.Context(), lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: "h", Success: true}); err != nil {
		t.Fatal(err)
	}
}

func mustStatus(t *testing.T, b *Backend, k lock.Key, node string) lock.Status {
	t.Helper()
	st, err := b.Status(t.Context(), k.Type, k.Resource, node)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// TestTakeDue: the sweeper takes every key due at once, leaves the others,
// says how long until the next, and keeps a key's soonest time.
func TestTakeDue(t *testing.T) {
	s := newIndexSweeper(nil)
	now := time.Unix(1000, 0)
	a, b, c := lock.Key{Type: lock.Pull, Resource: "a"}, lock.Key{Type: lock.Pull, Resource: "b"}, lock.Key{Type: lock.Pull, Resource: "c"}
	s.schedule(a, now.Add(-time.Second))
	s.schedule(b, now.Add(5*time.Second))
	s.schedule(b, now.Add(2*time.Second)) // the sooner wins
	s.schedule(b, now.Add(9*time.Second)) // a later one does not
	s.schedule(c, now)
	keys, wait := s.takeDue(now)
	slices.SortFunc(keys, func(x, y lock.Key) int { return strings.Compare(x.String(), y.String()) })
	if !slices.Equal(keys, []lock.Key{a, c}) || wait != 2*time.Second {
		t.Fatalf("due now: %v, next in %v; want [a c] and 2s", keys, wait)
	}
	if keys, wait := s.takeDue(now); len(keys) != 0 || wait != 2*time.Second {
		t.Fatalf("due again: %v, next in %v; want none and 2s", keys, wait)
	}
	if keys, wait := s.takeDue(now.Add(2 * time.Second)); !slices.Equal(keys, []lock.Key{b}) || wait != time.Hour {
		t.Fatalf("due at +2s: %v, next in %v; want [b] and an hour", keys, wait)
	}
}
