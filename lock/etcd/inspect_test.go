package etcd_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/etcd"
)

// The operators' view on etcd beyond what every backend passes
// (locktest's Inspector group): a walk within its budget, an index that
// follows other servers' changes, other servers' streams, and nothing
// kept or built while nobody looks.

func mustLock(t testing.TB, b lock.Backend, req lock.LockRequest) lock.LockResult {
	t.Helper()
	res, err := b.TryLock(context.Background(), req)
	if err != nil {
		t.Fatalf("lock %v %s %s: %v", req.Type, req.Resource, req.Node, err)
	}
	return res
}

func inspectAll(t *testing.T, in lock.Inspector, q lock.KeyQuery) []string {
	t.Helper()
	var out []string
	for {
		p, err := in.InspectKeys(t.Context(), q)
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range p.Keys {
			out = append(out, k.Key.String())
		}
		if p.Next == "" {
			return out
		}
		q.Cursor = p.Next
	}
}

// lockMany takes keys on b from a few goroutines.
func lockMany(t *testing.T, b lock.Backend, reqs []lock.LockRequest) {
	t.Helper()
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := w; i < len(reqs); i += 8 {
				if _, err := b.TryLock(context.Background(), reqs[i]); err != nil {
					t.Errorf("lock %v %s %s: %v", reqs[i].Type, reqs[i].Resource, reqs[i].Node, err)
					return
				}
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
}

// TestInspectWalk: a walk visits every held key once, in order, whatever
// the page size and however short the scan budget makes the pages, and
// no call examines more keys than its budget.
func TestInspectWalk(t *testing.T) {
	b, _ := open(t, nil)
	const n = 300
	var reqs []lock.LockRequest
	var want []string
	for i := range n {
		res := fmt.Sprintf("res-%04d", i)
		reqs = append(reqs, lock.LockRequest{Type: lock.Pull, Resource: res, Node: "h"})
		want = append(want, "pull:"+res)
		if i%3 == 0 {
			reqs = append(reqs, lock.LockRequest{Type: lock.Update, Resource: res, Node: "h"})
			want = append(want, "update:"+res)
		}
	}
	for i := range 60 { // free keys with records are not listed
		reqs = append(reqs, lock.LockRequest{Type: lock.Pull, Resource: fmt.Sprint("gone-", i), Node: "g"})
	}
	lockMany(t, b, reqs)
	for i := range 60 {
		if _, err := b.Unlock(t.Context(), lock.UnlockRequest{Type: lock.Pull, Resource: fmt.Sprint("gone-", i), Node: "g", Success: true}); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct{ limit, budget int }{{200, 1 << 16}, {37, 1 << 16}, {1000, 1 << 16}, {50, 40}, {7, 3}} {
		t.Run(fmt.Sprintf("limit=%d,budget=%d", c.limit, c.budget), func(t *testing.T) {
			defer etcd.SetScanBudgetForTest(c.budget)()
			var seen []string
			cursor, pages := "", 0
			for {
				p, err := b.InspectKeys(t.Context(), lock.KeyQuery{Cursor: cursor, Limit: c.limit})
				if err != nil {
					t.Fatal(err)
				}
				pages++
				if len(p.Keys) > min(c.limit, lock.MaxInspectLimit) || p.Scanned > c.budget {
					t.Fatalf("page of %d keys, %d examined: limit %d, budget %d", len(p.Keys), p.Scanned, c.limit, c.budget)
				}
				for _, k := range p.Keys {
					seen = append(seen, k.Key.String())
				}
				if p.Next == "" {
					break
				}
				cursor = p.Next
			}
			// In order: by resource, then type.
			if !slices.Equal(seen, want) {
				t.Fatalf("walk saw %d keys in %d pages, want %d in order", len(seen), pages, len(want))
			}
		})
	}
	// A filter that matches one key in the last part of the walk: the
	// pages before it are short, and their cursors lead to it.
	defer etcd.SetScanBudgetForTest(50)()
	if got := inspectAll(t, b, lock.KeyQuery{Resource: "res-0299"}); !slices.Equal(got, []string{"pull:res-0299"}) {
		t.Fatalf("filtered walk: %v", got)
	}
}

// TestInspectFollowsOtherServers: the keys another server grants, hands on
// and frees show in this server's pages once its watch has them, and the
// index this server built for them follows.
func TestInspectFollowsOtherServers(t *testing.T) {
	b1, p := open(t, nil)
	b2 := openAt(t, p, nil)
	mustLock(t, b1, lock.LockRequest{Type: lock.Pull, Resource: "a", Node: "x"})
	if got := inspectAll(t, b1, lock.KeyQuery{}); !slices.Equal(got, []string{"pull:a"}) {
		t.Fatalf("keys %v", got)
	}
	mustLock(t, b2, lock.LockRequest{Type: lock.Pull, Resource: "b", Node: "y"})
	mustLock(t, b2, lock.LockRequest{Type: lock.Pull, Resource: "b", Node: "z"})
	etcd.Eventually(t, "b1 shows the key b2 granted, with its waiter", func() bool {
		p, err := b1.InspectKeys(t.Context(), lock.KeyQuery{Node: "z"})
		return err == nil && len(p.Keys) == 1 && p.Keys[0].Holder == "y" && len(p.Keys[0].Queue) == 1 && p.Keys[0].Queue[0].Node == "z"
	})
	if _, err := b2.Unlock(t.Context(), lock.UnlockRequest{Type: lock.Pull, Resource: "a", Node: "x", Success: true}); err != nil {
		t.Fatal(err)
	}
	etcd.Eventually(t, "b1 drops the key b2 freed", func() bool {
		got := inspectAll(t, b1, lock.KeyQuery{})
		return slices.Equal(got, []string{"pull:b"})
	})
	cs, err := b1.RecentCompletions(t.Context(), lock.KeyQuery{Node: "x"})
	if err != nil || len(cs) != 1 || cs[0].Key.Resource != "a" || !cs[0].Success {
		t.Fatalf("completions %+v %v", cs, err)
	}
}

// uiKeys lists the records of the view's presence under prefix p.
func uiKeys(t *testing.T, cli *clientv3.Client, p string) []string {
	t.Helper()
	resp, err := cli.Get(t.Context(), p+"ui/", clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, kv := range resp.Kvs {
		out = append(out, string(kv.Key[len(p):]))
	}
	return out
}

func session(t *testing.T, in lock.Inspector, node string) lock.SessionView {
	t.Helper()
	p, err := in.InspectSessions(t.Context(), lock.SessionQuery{Node: node})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range p.Sessions {
		if s.Node == node {
			return s
		}
	}
	return lock.SessionView{Node: "none"}
}

// TestInspectCostsNothingUnwatched: while nobody looks, no server keeps an
// index, builds an operator event or writes to etcd for the view; while
// one looks, it sees the streams nodes have on other servers; once it
// stops looking, all of that goes.
func TestInspectCostsNothingUnwatched(t *testing.T) {
	defer etcd.SetViewIdleForTest(200 * time.Millisecond)()
	noGrace := func(c *etcd.Config) { c.SessionGrace = time.Hour }
	b1, p := open(t, noGrace)
	b2 := openAt(t, p, noGrace)
	cli := etcdtest.Shared(t).Client(t)
	work := func(node string) {
		st, _, err := b2.Subscribe(t.Context(), lock.SubscribeRequest{Node: node})
		if err != nil {
			t.Fatal(err)
		}
		mustLock(t, b1, lock.LockRequest{Type: lock.Pull, Resource: "r-" + node, Node: node, Lease: lock.LeaseSession})
		mustLock(t, b2, lock.LockRequest{Type: lock.Pull, Resource: "r-" + node, Node: "w"})
		if _, err := b1.Unlock(t.Context(), lock.UnlockRequest{Type: lock.Pull, Resource: "r-" + node, Node: node, Success: true}); err != nil {
			t.Fatal(err)
		}
		st.Close()
	}
	quiet := func(what string) {
		t.Helper()
		for i, b := range []*etcd.Backend{b1, b2} {
			if looking, indexed, built := etcd.ViewForTest(b); looking || indexed || built != 0 {
				t.Fatalf("%s: server %d looking=%v indexed=%v built=%d", what, i+1, looking, indexed, built)
			}
		}
		if keys := uiKeys(t, cli, p); len(keys) != 0 {
			t.Fatalf("%s: etcd holds %v", what, keys)
		}
	}
	work("a")
	quiet("before anyone looked")

	ops, err := b1.WatchOps(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	st, _, err := b2.Subscribe(t.Context(), lock.SubscribeRequest{Node: "n"})
	if err != nil {
		t.Fatal(err)
	}
	etcd.Eventually(t, "b1 to see n's stream on b2", func() bool {
		s := session(t, b1, "n")
		return s.Streams == 1 && !s.InGrace
	})
	// The feed was told: n has a stream (on b2).
	etcd.Eventually(t, "b1's feed to tell n's stream", func() bool {
		for _, ev := range ops.Take(nil) {
			if c := ev.Session; c != nil && c.Node == "n" && c.Streams == 1 {
				return true
			}
		}
		return false
	})
	st.Close()
	etcd.Eventually(t, "b1 to see n in grace", func() bool {
		s := session(t, b1, "n")
		return s.Streams == 0 && s.InGrace
	})
	ops.Close()
	etcd.Eventually(t, "both servers to stop looking", func() bool {
		l1, i1, _ := etcd.ViewForTest(b1)
		l2, i2, _ := etcd.ViewForTest(b2)
		return !l1 && !i1 && !l2 && !i2 && len(uiKeys(t, cli, p)) == 0
	})
	_, _, built1 := etcd.ViewForTest(b1)
	_, _, built2 := etcd.ViewForTest(b2)
	work("b")
	if _, _, n := etcd.ViewForTest(b1); n != built1 {
		t.Fatalf("b1 built %d more after nobody looked", n-built1)
	}
	if _, _, n := etcd.ViewForTest(b2); n != built2 {
		t.Fatalf("b2 built %d more after nobody looked", n-built2)
	}
	if keys := uiKeys(t, cli, p); len(keys) != 0 {
		t.Fatalf("etcd holds %v after nobody looked", keys)
	}
}
