package etcd_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/etcd"
)

// heapMiB is the live heap after two collections.
func heapMiB() float64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return float64(ms.HeapAlloc) / (1 << 20)
}

// BenchmarkInspect100k: the operators' view of a server whose data set has
// 100,000 held keys (1,000 of them with 5 waiters each), held by 1,000
// nodes: what looking costs in memory (the index of the keys, built at the
// first look), how long a page takes, and a whole walk. The server
// measured is a fresh one that listed the keys, not the one that took
// them. The heap is the whole test process's, etcd's included: the
// numbers that matter are the differences.
//
//	go test -run '^$' -bench Inspect100k -benchtime 20x -timeout 30m -v ./lock/etcd
func BenchmarkInspect100k(b *testing.B) {
	const keys, queued, waiters, nodes = 100000, 1000, 5, 1000
	cfg := func(c *etcd.Config) { c.LockTTL = time.Hour; c.MaxQueue = 0 }
	// The server that takes the keys is closed before the measurement, and
	// not kept by a cleanup: its cache is not the measured server's.
	p := etcdtest.Prefix(b)
	c := etcd.DefaultConfig()
	cfg(&c)
	c.Prefix = p
	taker, err := etcd.New(context.Background(), etcdtest.Shared(b).Client(b), c)
	if err != nil {
		b.Fatal(err)
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for range 64 {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= keys {
					return
				}
				// Digests, as image layers are; the keys with waiters
				// sort first.
				res := fmt.Sprintf("sha256:%x", sha256.Sum256(fmt.Append(nil, i)))
				if i < queued {
					res = fmt.Sprintf("layer-%04d", i)
				}
				req := lock.LockRequest{Type: lock.Pull, Resource: res, Node: fmt.Sprint("node-", i%nodes), Lease: lock.LeaseTTL}
				if _, err := taker.TryLock(context.Background(), req); err != nil {
					b.Error(err)
					return
				}
				if i < queued {
					for w := range waiters {
						req.Node = fmt.Sprintf("waiter-%d-%d", i, w)
						if _, err := taker.TryLock(context.Background(), req); err != nil {
							b.Error(err)
							return
						}
					}
				}
			}
		})
	}
	wg.Wait()
	if b.Failed() {
		b.FailNow()
	}
	b.Logf("%d keys taken in %v", keys, time.Since(start).Round(time.Second))
	taker.Close()
	srv := openAt(b, p, cfg)
	idle := heapMiB()
	if looking, indexed, built := etcd.ViewForTest(srv); looking || indexed || built != 0 {
		b.Fatalf("looking before anyone looked: %v %v %d", looking, indexed, built)
	}
	ctx := context.Background()
	page := func(q lock.KeyQuery) lock.KeyPage {
		pg, err := srv.InspectKeys(ctx, q)
		if err != nil {
			b.Fatal(err)
		}
		return pg
	}
	t0 := time.Now()
	if got := len(page(lock.KeyQuery{}).Keys); got != lock.DefaultInspectLimit {
		b.Fatalf("first page: %d keys", got)
	}
	first := time.Since(t0)
	looking := heapMiB()
	b.Logf("the index of the %d keys holds %.2f MiB; first page, with the index built, in %v", keys,
		float64(etcd.ViewBytesForTest(srv))/(1<<20), first.Round(time.Millisecond))
	b.Logf("live heap (the whole process, etcd's included): %.1f MiB before anyone looked, %.1f MiB looking", idle, looking)

	b.Run("index+page", func(b *testing.B) {
		for b.Loop() {
			etcd.DropViewForTest(srv)
			page(lock.KeyQuery{})
		}
	})
	b.Run("page", func(b *testing.B) {
		for b.Loop() {
			page(lock.KeyQuery{})
		}
	})
	b.Run("page-of-queues", func(b *testing.B) {
		for b.Loop() {
			// The keys with waiters come first: each page reads 50 queues.
			pg := page(lock.KeyQuery{Limit: 50})
			if pg.Keys[0].QueueLength != waiters || len(pg.Keys[0].Queue) != waiters {
				b.Fatalf("queue %+v", pg.Keys[0])
			}
		}
	})
	b.Run("page-filtered-by-node", func(b *testing.B) {
		for b.Loop() {
			// node-7 holds every 1,000th key: a page of its keys reads
			// the whole budget of 65,536 keys, and goes on from there.
			pg := page(lock.KeyQuery{Node: "node-7"})
			if pg.Next == "" || pg.Scanned == 0 {
				b.Fatalf("page %d keys, scanned %d", len(pg.Keys), pg.Scanned)
			}
		}
	})
	b.Run("walk", func(b *testing.B) {
		for b.Loop() {
			n, pages, cursor := 0, 0, ""
			for {
				pg := page(lock.KeyQuery{Limit: lock.MaxInspectLimit, Cursor: cursor})
				n, pages = n+len(pg.Keys), pages+1
				if cursor = pg.Next; cursor == "" {
					break
				}
			}
			if n != keys {
				b.Fatalf("walk saw %d keys", n)
			}
			b.ReportMetric(float64(pages), "pages/op")
		}
	})
	b.Run("completions+sessions", func(b *testing.B) {
		for b.Loop() {
			if _, err := srv.RecentCompletions(ctx, lock.KeyQuery{}); err != nil {
				b.Fatal(err)
			}
			if _, err := srv.InspectSessions(ctx, lock.SessionQuery{}); err != nil {
				b.Fatal(err)
			}
		}
	})
	etcd.DropViewForTest(srv)
	b.Logf("live heap once the index is dropped: %.1f MiB", heapMiB())
}
