package etcd_test

// Attacks on the queue indexes a success leaves (docs/DESIGN.md, "Queue
// indexes a success leaves") through the differential test's histories:
// the operators' view, which reads a node's queue index from the cache and
// checks it against the watch's queue (inspect.go, indexLive), must agree
// with the memory engine's as the answers and events do.

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/dlock/dlock/lock"
)

// TestDifferentialLeftIndexesInspect runs TestDifferentialLeftIndexes's
// histories and, after every step, asks each engine's servers for each
// node's keys (InspectKeys with the node filter): the keys it holds, waits
// for, or completed last. With every success leaving its waiters' indexes
// and no sweep, a node whose index is stale must not be shown waiting, on
// either etcd server; with the sweep at once, the sweep must not take away
// a waiter's index.
func TestDifferentialLeftIndexesInspect(t *testing.T) {
	runLeftIndexes(t, 101, 106, 120, compareNodeKeys)
}

// compareNodeKeys compares, for every node, the keys each server of each
// engine shows for it: the memory engine's one against each etcd server.
func compareNodeKeys(d *diff) {
	d.t.Helper()
	ctx := d.t.Context()
	for n := range d.nodes {
		node := nodeName(n)
		want := nodeKeys(ctx, d.t, d.sides[0].bs[0], node)
		for i, b := range d.sides[1].bs {
			if got := nodeKeys(ctx, d.t, b, node); !slices.Equal(got, want) {
				d.t.Fatalf("seed %d: after step %d, %s's keys on etcd server %d:\n\t%s\nmemory:\n\t%s\nhistory:\n%s",
					d.seed, len(d.steps), node, i+1, strings.Join(got, "\n\t"), strings.Join(want, "\n\t"), d.history())
			}
		}
	}
}

// nodeKeys is what InspectKeys shows of node's keys, each key with its
// holder and queue, sorted.
func nodeKeys(ctx context.Context, t *testing.T, lb lock.Backend, node string) []string {
	t.Helper()
	b, ok := lb.(lock.Inspector)
	if !ok {
		t.Fatalf("%T is no lock.Inspector", lb)
	}
	var out []string
	q := lock.KeyQuery{Node: node, Limit: lock.MaxInspectLimit}
	for {
		page, err := b.InspectKeys(ctx, q)
		if err != nil {
			t.Fatalf("InspectKeys %s: %v", node, err)
		}
		for _, v := range page.Keys {
			var ws []string
			for _, w := range v.Queue {
				ws = append(ws, w.Node)
			}
			out = append(out, fmt.Sprintf("%v holder=%q queue=%d %v", v.Key, v.Holder, v.QueueLength, ws))
		}
		if page.Next == "" {
			break
		}
		q.Cursor = page.Next
	}
	slices.Sort(out)
	return out
}
