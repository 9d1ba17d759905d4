package memory

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock/dlock/lock"
)

// BenchmarkUncontended: lock + unlock(success) pairs on distinct keys, from
// every core at once. One op is one pair.
func BenchmarkUncontended(b *testing.B) {
	m := newMemory(b, nil)
	ctx := context.Background()
	var next atomic.Int64
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		g := next.Add(1)
		node := "node-" + strconv.FormatInt(g, 10)
		res := make([]string, 1024)
		for i := range res {
			res[i] = "sha256:" + strconv.FormatInt(g, 10) + "-" + strconv.Itoa(i)
		}
		i := 0
		for pb.Next() {
			r := res[i%len(res)]
			i++
			if _, err := m.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: r, Node: node}); err != nil {
				b.Fatal(err)
			}
			if _, err := m.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: r, Node: node, Success: true}); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkHandoff: one hot key, two nodes; each op queues a node behind the
// holder and hands the key to it with a failed unlock. The manager keeps a
// token ceiling (in memory here), as dlock serve does in its data dir.
func BenchmarkHandoff(b *testing.B) {
	handoff(b, newMemory(b, func(c *Config) { c.TokenCeiling = &memCeiling{} }))
}

// BenchmarkHandoffClockOnly is BenchmarkHandoff without a token ceiling:
// tokens rest on the clock, so one key cannot be granted more than once per
// microsecond (docs/DESIGN.md, "Fencing tokens"), and this measures that
// bound as soon as the key has used its startWait of headroom.
func BenchmarkHandoffClockOnly(b *testing.B) {
	handoff(b, newMemory(b, nil))
}

func handoff(b *testing.B, m *Backend) {
	ctx := context.Background()
	nodes := [2]string{"a", "b"}
	if _, err := m.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: "hot", Node: "a"}); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		holder, waiter := nodes[i%2], nodes[(i+1)%2]
		if _, err := m.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: "hot", Node: waiter}); err != nil {
			b.Fatal(err)
		}
		r, err := m.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: "hot", Node: holder, Error: "x"})
		if err != nil || r.NextHolder != waiter {
			b.Fatal(r, err)
		}
	}
}

// BenchmarkSessionLoss: 100,000 sessions queued on one key lose their
// streams at once; while their grace runs out and they are released, another
// key of the same shard is locked and unlocked in a loop. max-ns/lock is the
// worst latency of that loop, the stall a mass session loss inflicts on its
// neighbours (docs/DESIGN.md: releasing N sessions costs O(N log N));
// idle-max-ns/lock is the same loop's worst before the loss, the noise of
// the machine.
func BenchmarkSessionLoss(b *testing.B) {
	const n = 100_000
	const grace = 500 * time.Millisecond
	other := "other"
	for i := 0; ShardIndex(other, 32) != ShardIndex("hot", 32); i++ {
		other = "other-" + strconv.Itoa(i)
	}
	ctx := context.Background()
	var worst, idle, total time.Duration
	for b.Loop() {
		b.StopTimer()
		m := newMemory(b, func(c *Config) { c.SessionGrace = grace })
		if _, err := m.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: "hot", Node: "holder", Lease: lock.LeaseTTL}); err != nil {
			b.Fatal(err)
		}
		streams := make([]lock.Stream, n)
		for i := range streams {
			node := "n" + strconv.Itoa(i)
			st, _, err := m.Subscribe(b.Context(), lock.SubscribeRequest{Node: node})
			if err != nil {
				b.Fatal(err)
			}
			streams[i] = st
			if _, err := m.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: "hot", Node: node}); err != nil {
				b.Fatal(err)
			}
		}
		// The same loop with nothing else going on: the machine's noise.
		for t1 := time.Now(); time.Since(t1) < 200*time.Millisecond; {
			t0 := time.Now()
			if _, err := m.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: other, Node: "x", Lease: lock.LeaseTTL}); err != nil {
				b.Fatal(err)
			}
			if _, err := m.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: other, Node: "x", Success: true}); err != nil {
				b.Fatal(err)
			}
			idle = max(idle, time.Since(t0))
			time.Sleep(100 * time.Microsecond)
		}
		b.StartTimer()
		start := time.Now()
		for _, st := range streams {
			st.Close()
		}
		for {
			t0 := time.Now()
			if _, err := m.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: other, Node: "x", Lease: lock.LeaseTTL}); err != nil {
				b.Fatal(err)
			}
			if _, err := m.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: other, Node: "x", Success: true}); err != nil {
				b.Fatal(err)
			}
			worst = max(worst, time.Since(t0))
			if st := m.Stats(); st.SessionsLost == n && st.Queued == 0 {
				break
			}
			time.Sleep(100 * time.Microsecond)
		}
		total += time.Since(start)
		b.StopTimer()
		_ = m.Close()
		b.StartTimer()
	}
	b.ReportMetric(float64(worst.Nanoseconds()), "max-ns/lock")
	b.ReportMetric(float64(idle.Nanoseconds()), "idle-max-ns/lock")
	b.ReportMetric(float64(total.Nanoseconds())/float64(b.N), "release-ns/op")
}
