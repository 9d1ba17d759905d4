package etcd_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock/dlock/lock"
)

// Benchmarks on the shared embedded etcd, in this process (fsync off):
// they count dlock's round trips and work, not a disk. `dlock bench`
// measures a deployment (docs/BENCHMARKS.md).

// BenchmarkLockUnlock: a lock and its unlock, each goroutine on keys of its
// own.
func BenchmarkLockUnlock(b *testing.B) {
	be, _ := open(b, nil)
	ctx := context.Background()
	var n atomic.Int64
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		node := fmt.Sprint("n", n.Add(1))
		i := 0
		for pb.Next() {
			res := fmt.Sprintf("%s-%d", node, i%64)
			i++
			if _, err := be.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: res, Node: node}); err != nil {
				b.Fatal(err)
			}
			if _, err := be.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: res, Node: node, Error: "x"}); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkHandoff: the time from a failed unlock to the waiter's
// lock_assigned on its stream, on a second server.
func BenchmarkHandoff(b *testing.B) {
	b1, p := open(b, nil)
	b2 := openAt(b, p, nil)
	ctx := context.Background()
	st, _, err := b2.Subscribe(ctx, lock.SubscribeRequest{Node: "w"})
	if err != nil {
		b.Fatal(err)
	}
	defer st.Close()
	var total time.Duration
	for i := 0; i < b.N; i++ {
		res := fmt.Sprint("h", i)
		if _, err := b1.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: res, Node: "h"}); err != nil {
			b.Fatal(err)
		}
		if _, err := b2.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: res, Node: "w"}); err != nil {
			b.Fatal(err)
		}
		start := time.Now()
		if _, err := b1.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: res, Node: "h", Error: "x"}); err != nil {
			b.Fatal(err)
		}
		for got := false; !got; {
			<-st.Ready()
			for _, d := range st.Take(nil) {
				got = got || (d.Event.Name == lock.EventLockAssigned && d.Event.Key.Resource == res)
			}
		}
		total += time.Since(start)
	}
	b.ReportMetric(float64(total.Microseconds())/float64(b.N), "us/handoff")
}

// BenchmarkFanout: one success telling 1,000 waiters (DLOCK_BENCH_WAITERS),
// each with a stream, spread over two servers; the time until every stream
// has its event, and until the success's call answered, which is the time
// its transaction took: the rest is the watches' and the streams'.
func BenchmarkFanout(b *testing.B) {
	waiters := benchCount(b, "DLOCK_BENCH_WAITERS", 1000)
	b1, p := open(b, nil)
	b2 := openAt(b, p, nil)
	ctx := context.Background()
	streams := make([]lock.Stream, waiters)
	for i := range streams {
		be := b1
		if i%2 == 1 {
			be = b2
		}
		st, _, err := be.Subscribe(ctx, lock.SubscribeRequest{Node: fmt.Sprint("w", i)})
		if err != nil {
			b.Fatal(err)
		}
		defer st.Close()
		streams[i] = st
	}
	var total, answers time.Duration
	for i := 0; i < b.N; i++ {
		res := fmt.Sprint("f", i)
		if _, err := b1.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: res, Node: "h"}); err != nil {
			b.Fatal(err)
		}
		for j := range waiters {
			if _, err := b2.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: res, Node: fmt.Sprint("w", j)}); err != nil {
				b.Fatal(err)
			}
		}
		start := time.Now()
		if _, err := b1.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: res, Node: "h", Success: true}); err != nil {
			b.Fatal(err)
		}
		answers += time.Since(start)
		for _, st := range streams {
			for got := false; !got; {
				for _, d := range st.Take(nil) {
					got = got || d.Event.Key.Resource == res
				}
				if !got {
					<-st.Ready()
				}
			}
		}
		total += time.Since(start)
	}
	b.ReportMetric(float64(total.Milliseconds())/float64(b.N), "ms/fanout")
	b.ReportMetric(float64(answers.Milliseconds())/float64(b.N), "ms/answer")
}
