package etcd

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
)

// Attacks on the operators' view (inspect.go, viewer.go, presence.go) that
// need its insides; the others are in inspect_test.go.

// putCompletions writes n keys' records with a completion each straight to
// etcd, as n unlocks would have left them: key i's completion is by
// node(i), at (now - i ms), and its holder, if any, holder(i). A server
// that opens the data set afterwards lists them.
func putCompletions(tb testing.TB, cli *clientv3.Client, prefix string, n int, node, holder func(int) string) {
	tb.Helper()
	nm := names{p: prefix}
	now := time.Now()
	var ops []clientv3.Op
	flush := func() {
		if _, err := cli.Txn(context.Background()).Then(ops...).Commit(); err != nil {
			tb.Fatal(err)
		}
		ops = ops[:0]
	}
	for i := range n {
		k := lock.Key{Type: lock.Pull, Resource: fmt.Sprintf("sha256:%064x", i)}
		r := keyRec{Token: uint64(2 * (i + 1)), Done: &done{Node: node(i), Token: uint64(2*i + 1), OK: true, At: now.Add(-time.Duration(i) * time.Millisecond).UnixNano()}}
		if h := holder(i); h != "" {
			r.Holder, r.Lease, r.Acquired, r.TTL = h, uint8(lock.LeaseTTL), now.UnixNano(), now.Add(time.Hour).UnixNano()
		}
		ops = append(ops, clientv3.OpPut(nm.key(k), encode(&r)))
		if len(ops) == 128 {
			flush()
		}
	}
	if len(ops) > 0 {
		flush()
	}
}

// TestRecentCompletionsByNode: the completions of one node are the newest
// first of those it completed, up to the limit, whatever else names it
// (a key it holds now, which another node completed), and as the resource
// filter allows.
func TestRecentCompletionsByNode(t *testing.T) {
	srv := etcdtest.Shared(t)
	cli := srv.Client(t)
	cfg := DefaultConfig()
	cfg.Prefix = etcdtest.Prefix(t)
	const n = 600
	// Every third key completed by "x"; every key x did not complete
	// held by x now, so that its record names x too.
	node := func(i int) string {
		if i%3 == 0 {
			return "x"
		}
		return fmt.Sprint("n", i%7)
	}
	holder := func(i int) string {
		if i%3 != 0 {
			return "x"
		}
		return ""
	}
	putCompletions(t, cli, cfg.Prefix, n, node, holder)
	b, err := New(context.Background(), cli, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	for _, q := range []lock.KeyQuery{
		{Node: "x"}, {Node: "x", Limit: lock.MaxInspectLimit}, {Node: "x", Limit: 7},
		{Node: "x", Resource: "5"}, {Node: "n3"}, {Node: "nobody"}, {Node: "x\""},
	} {
		var want []string
		for i := range n {
			k := lock.Key{Type: lock.Pull, Resource: fmt.Sprintf("sha256:%064x", i)}
			if node(i) == q.Node && (q.Resource == "" || strings.Contains(k.Resource, q.Resource)) && len(want) < pageLimit(q.Limit) {
				want = append(want, fmt.Sprintf("%v by %s", k, q.Node))
			}
		}
		list, err := b.RecentCompletions(context.Background(), q)
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, c := range list {
			got = append(got, fmt.Sprintf("%v by %s", c.Key, c.Node))
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("completions of %+v:\n got %d %v\nwant %d %v", q, len(got), got, len(want), want)
		}
	}
}

// BenchmarkRecentCompletionsByNode: the completions an operator reads with
// a node filter, on a data set of 100,000 retained completion records
// (CompletedMax), of a node that completed 100 of them and of one that
// completed none: how long a page takes, and the longest a goroutine
// waited for the watcher's mutex meanwhile (ms-watch-wait), which the
// watch needs to apply each revision. It decoded every record under the
// watcher's mutex and the cache's lock: 0.7 to 1.7 s without -race.
//
//	go test -run '^$' -bench RecentCompletionsByNode -benchtime 10x ./lock/etcd
func BenchmarkRecentCompletionsByNode(b *testing.B) {
	const n = 100000
	cli := etcdtest.Shared(b).Client(b)
	cfg := DefaultConfig()
	cfg.Prefix = etcdtest.Prefix(b)
	putCompletions(b, cli, cfg.Prefix, n, func(i int) string { return fmt.Sprint("node-", i%1000) }, func(int) string { return "" })
	be, err := New(context.Background(), cli, cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer be.Close()
	for _, node := range []string{"node-7", "nobody"} {
		b.Run(node, func(b *testing.B) {
			var stop atomic.Bool
			var longest atomic.Int64
			var wg sync.WaitGroup
			wg.Go(func() {
				for !stop.Load() {
					t0 := time.Now()
					be.w.mu.Lock()
					d := int64(time.Since(t0))
					be.w.mu.Unlock()
					if d > longest.Load() {
						longest.Store(d)
					}
					time.Sleep(100 * time.Microsecond)
				}
			})
			for b.Loop() {
				list, err := be.RecentCompletions(context.Background(), lock.KeyQuery{Node: node})
				if err != nil {
					b.Fatal(err)
				}
				if want := map[string]int{"node-7": lock.DefaultInspectLimit, "nobody": 0}[node]; len(list) != want {
					b.Fatalf("%d completions of %s, want %d", len(list), node, want)
				}
			}
			stop.Store(true)
			wg.Wait()
			b.ReportMetric(float64(longest.Load())/1e6, "ms-watch-wait")
		})
	}
}

// slowCounts is an etcd that takes delay to answer each transaction that
// writes a server's stream counts (P/ui/n/), or until the request's
// deadline.
type slowCounts struct{ delay time.Duration }

func (s *slowCounts) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if r, ok := req.(*pb.TxnRequest); ok && writesMarked(r, "/ui/n/") {
		select {
		case <-time.After(s.delay):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return invoker(ctx, method, req, reply, cc, opts...)
}

// TestAttackViewCountsConverge: a server whose streams are many, on an
// etcd slow enough that writing all their counts takes longer than one
// call's bound (782 transactions of 128 counts for 100,000 sessions, at
// 13 ms each; here 3 of 4 s), still gets them written once someone looks
// through another server. The whole write had one callTimeout: it ran
// out, the writer dropped its lease and what it had written, and began
// again with every count a second later, forever: the operator saw those
// sessions in grace, and etcd took the same burst of writes every 11 s
// while anyone looked.
func TestAttackViewCountsConverge(t *testing.T) {
	const nodes = 300 // three transactions of counts
	slow := &slowCounts{delay: 4 * time.Second}
	cli := etcdtest.Shared(t).Client(t, grpc.WithChainUnaryInterceptor(slow.intercept))
	cfg := DefaultConfig()
	cfg.Prefix = etcdtest.Prefix(t)
	cfg.SessionGrace = time.Hour
	streaming, err := New(context.Background(), cli, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer streaming.Close()
	looking, err := New(context.Background(), etcdtest.Shared(t).Client(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer looking.Close()
	for i := range nodes {
		st, _, err := streaming.Subscribe(context.Background(), lock.SubscribeRequest{Node: fmt.Sprintf("n%03d", i)})
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
	}
	kit.WaitFor(t, "every session's stream on the other server to show", func() bool {
		shown := 0
		q := lock.SessionQuery{Limit: lock.MaxInspectLimit}
		for {
			pg, err := looking.InspectSessions(context.Background(), q)
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range pg.Sessions {
				if s.Streams == 1 {
					shown++
				}
			}
			if q.Cursor = pg.Next; q.Cursor == "" {
				break
			}
		}
		return shown == nodes
	})
}
