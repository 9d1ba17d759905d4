package lock

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
)

// BenchmarkUncontended: lock + unlock(success) pairs on distinct keys, from
// every core at once. One op is one pair.
func BenchmarkUncontended(b *testing.B) {
	m := newManager(b, nil)
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
			if _, err := m.TryLock(ctx, LockRequest{Type: Pull, Resource: r, Node: node}); err != nil {
				b.Fatal(err)
			}
			if _, err := m.Unlock(ctx, UnlockRequest{Type: Pull, Resource: r, Node: node, Success: true}); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkHandoff: one hot key, two nodes; each op queues a node behind the
// holder and hands the key to it with a failed unlock. The manager keeps a
// token ceiling (in memory here), as dlock serve does in its data dir.
func BenchmarkHandoff(b *testing.B) {
	handoff(b, newManager(b, func(c *Config) { c.TokenCeiling = &memCeiling{} }))
}

// BenchmarkHandoffClockOnly is BenchmarkHandoff without a token ceiling:
// tokens rest on the clock, so one key cannot be granted more than once per
// microsecond (docs/DESIGN.md, "Fencing tokens"), and this measures that
// bound as soon as the key has used its startWait of headroom.
func BenchmarkHandoffClockOnly(b *testing.B) {
	handoff(b, newManager(b, nil))
}

func handoff(b *testing.B, m *Manager) {
	ctx := context.Background()
	nodes := [2]string{"a", "b"}
	if _, err := m.TryLock(ctx, LockRequest{Type: Pull, Resource: "hot", Node: "a"}); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		holder, waiter := nodes[i%2], nodes[(i+1)%2]
		if _, err := m.TryLock(ctx, LockRequest{Type: Pull, Resource: "hot", Node: waiter}); err != nil {
			b.Fatal(err)
		}
		r, err := m.Unlock(ctx, UnlockRequest{Type: Pull, Resource: "hot", Node: holder, Error: "x"})
		if err != nil || r.NextHolder != waiter {
			b.Fatal(r, err)
		}
	}
}
