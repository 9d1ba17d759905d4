package etcd

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
)

// checkWatchView holds b's watch to etcd at the revision it has applied:
// each of keys has in the watch's table what its record in etcd gives
// (info), the counts are those of the records, and the marked keys are
// the plainly held ones, as many as the table counts. A deadline a timer
// postponed (watcher.postpone) may be later than its record's. It returns
// the number of keys marked, -1 if it did not check (etcd compacted the
// revision, or b has not listed yet).
func checkWatchView(t *testing.T, ctx context.Context, cli *clientv3.Client, b *Backend, keys []lock.Key, who string) int {
	t.Helper()
	w := b.w
	type view struct {
		ki keyInfo
		ok bool
	}
	got := map[lock.Key]view{}
	w.mu.Lock()
	rev := w.processed
	for _, k := range keys {
		ki, ok := w.keys.getKey(k)
		got[k] = view{ki, ok}
	}
	nKeys, nHeld, nQd, nDone := w.nKeys, w.nHeld, w.nQd, w.nDone
	plain, count, size := w.keys.plainKeys(nil), w.keys.plain, w.keys.len()
	w.mu.Unlock()
	if rev == 0 {
		return -1
	}
	resp, err := cli.Get(ctx, b.n.keys(), clientv3.WithPrefix(), clientv3.WithRev(rev))
	switch {
	case errors.Is(err, rpctypes.ErrCompacted) || ctx.Err() != nil:
		return -1
	case err != nil:
		t.Errorf("%s: reading etcd at %d: %v", who, rev, err)
		return -1
	}
	truth := map[lock.Key]keyInfo{}
	var wKeys, wHeld, wQd, wDone int
	var wantPlain []string
	for _, kv := range resp.Kvs {
		k, ok := b.n.parseKey(string(kv.Key))
		r, err := decodeKey(kv.Value)
		if !ok || err != nil {
			continue
		}
		ki := info(&r, b.cfg.CompletedRetention)
		truth[k] = ki
		wKeys, wHeld, wQd, wDone = wKeys+b2i(ki.kept), wHeld+b2i(ki.held), wQd+int(ki.queue), wDone+b2i(ki.doneAt != 0)
		if ki == plainHeld {
			wantPlain = append(wantPlain, string(kv.Key))
		}
	}
	for _, k := range keys {
		want, wok := truth[k]
		g := got[k]
		postponed := want.deadline != 0 && g.ki.deadline > want.deadline
		if postponed {
			g.ki.deadline = want.deadline
		}
		if g.ki != want || g.ok != wok {
			t.Errorf("%s at %d: the watch has %v as %+v %v, etcd's record gives %+v %v", who, rev, k, got[k].ki, got[k].ok, want, wok)
		}
	}
	if nKeys != wKeys || nHeld != wHeld || nQd != wQd || nDone != wDone || size != len(truth) {
		t.Errorf("%s at %d: the watch counts keys %d held %d queued %d done %d in a table of %d, etcd's records %d %d %d %d of %d",
			who, rev, nKeys, nHeld, nQd, nDone, size, wKeys, wHeld, wQd, wDone, len(truth))
	}
	slices.Sort(plain)
	slices.Sort(wantPlain)
	if len(plain) != count || !slices.Equal(plain, wantPlain) {
		t.Errorf("%s at %d: marked %q (the table counts %d), etcd's plainly held %q", who, rev, plain, count, wantPlain)
	}
	return len(plain)
}

// laggingWatch holds each message of a client's watch streams back a
// random moment of up to d: a watch that lags behind the server's own
// write-throughs, as a loaded one does.
type laggingWatch struct{ d time.Duration }

func (l laggingWatch) intercept(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	cs, err := streamer(ctx, desc, cc, method, opts...)
	if err != nil || !strings.HasSuffix(method, "/Watch") {
		return cs, err
	}
	return laggingStream{cs, l.d}, nil
}

type laggingStream struct {
	grpc.ClientStream
	d time.Duration
}

func (s laggingStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	time.Sleep(rand.N(s.d))
	return err
}

// TestAttackMarksMatchEtcd races nodes on a few keys through three
// servers of one data set, holds under session leases (plainly held:
// marks on the cache's entries) among holds with deadlines, waiters,
// completions and deletes, while each server writes its own commits
// through ahead of its watch (which lags), its cache is made stale at random
// (StaleCacheForTest), its operators' view reads the marked keys, its
// watch is ended and etcd compacted past it (a relist amid the
// write-throughs), and servers are replaced. All along and at the end,
// every server's watch has, at the revision it applied, the table and
// counts etcd's records give there, and its marks are exactly the keys
// plainly held (docs/DESIGN.md, "What a server keeps").
func TestAttackMarksMatchEtcd(t *testing.T) {
	srv := etcdtest.StartEmbedded(t)
	p := etcdtest.Prefix(t)
	cfg := DefaultConfig()
	cfg.Prefix = p
	cfg.LockTTL = time.Second
	cfg.SessionGrace = 2 * time.Second
	cfg.ClaimTimeout = 500 * time.Millisecond
	cfg.CompletedRetention = 100 * time.Millisecond // completions gone soon: keys plainly held again
	cfg.CompletedMax = 2                            // completion records dropped at once (dropDone)

	g := newRelistRig(t, srv, cfg, func(b *Backend) {
		t.Cleanup(func() { staleHists.Delete(b) })
	}, laggingWatch{5 * time.Millisecond}.intercept)
	cli := srv.Client(t)
	keys := keysOf([]string{"a", "b", "c/d", "e", "f", "g", "h", "i%j"}, lock.Pull, lock.Update)

	ctx, stop := context.WithTimeout(t.Context(), 4*time.Second)
	defer stop()
	var wg sync.WaitGroup
	g.race(ctx, &wg, 12, keys, func(r *rand.Rand, b *Backend, k lock.Key, node string) error {
		var err error
		switch op := r.IntN(100); {
		case op < 45:
			lease := lock.LeaseSession
			if r.IntN(4) == 0 {
				lease = lock.LeaseTTL
			}
			var res lock.LockResult
			res, err = b.TryLock(ctx, lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: node, Lease: lease})
			if err == nil && res.Queued && r.IntN(4) != 0 {
				// Most do not wait: keys stay plainly held.
				_, err = b.Cancel(ctx, k.Type, k.Resource, node)
			}
		case op < 75:
			_, err = b.Unlock(ctx, lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: node, Success: r.IntN(3) == 0, Error: "boom"})
		case op < 85:
			_, err = b.Cancel(ctx, k.Type, k.Resource, node)
		case op < 92:
			StaleCacheForTest(b, r)
		default:
			_, err = b.InspectKeys(ctx, lock.KeyQuery{})
		}
		return err
	})
	wg.Go(func() { g.relist(ctx, cli, p, 4) })
	var checked, marked atomic.Int64
	wg.Go(func() {
		for ctx.Err() == nil {
			for i, s := range g.now() {
				if n := checkWatchView(t, ctx, cli, s.b, keys, fmt.Sprint("server ", i)); n >= 0 {
					checked.Add(1)
					marked.Add(int64(n))
				}
			}
		}
	})
	wg.Wait()
	// A watch the last compaction passed lists the state again first.
	for i, s := range g.now() {
		kit.WaitFor(t, fmt.Sprint("server ", i, "'s watch to pass the last compaction"), func() bool {
			return checkWatchView(t, t.Context(), cli, s.b, keys, fmt.Sprint("server ", i, " at the end")) >= 0
		})
	}
	t.Logf("%d relists, %d views checked, holding %d marks in all", g.relists.Load(), checked.Load(), marked.Load())
	if g.relists.Load() == 0 || checked.Load() == 0 || marked.Load() == 0 {
		t.Fatal("the run exercised nothing: no relist, no view checked, or no key marked")
	}
}
