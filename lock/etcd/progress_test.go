package etcd_test

import (
	"testing"
	"time"

	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/etcd"
)

// TestSubscribeWhileEtcdMovesOnElsewhere: a node's stream moves to another
// server of its data set while etcd's revision has moved on for keys
// outside the data set (another data set on the same etcd, another user
// of it) and nothing in the data set changed. The server's watch hears
// only of its prefix, so it must ask etcd how far it has come (a progress
// notification) rather than wait for a change of its own: else the stream
// waits until the next change in the data set, or 10 s and then 503, and
// a node moving off a failed server loses its holds (found by dlock bench
// --scenario cutoff, etcd-server-off-etcd, on an etcd shared by earlier
// rounds).
func TestSubscribeWhileEtcdMovesOnElsewhere(t *testing.T) {
	srv := etcdtest.Shared(t)
	p := etcdtest.Prefix(t)
	// Two servers: each its own etcd client, as dlock serve processes have.
	cli := srv.Client(t)
	b1 := newBackend(t, cli, p, etcd.DefaultConfig())
	b2 := newBackend(t, srv.Client(t), p, etcd.DefaultConfig())
	ctx := t.Context()
	s1, sub, err := b1.Subscribe(ctx, lock.SubscribeRequest{Node: "n"})
	if err != nil {
		t.Fatal(err)
	}
	defer s1.Close()
	if r, err := b1.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "n", Lease: lock.LeaseSession}); err != nil || !r.Acquired {
		t.Fatalf("lock: %+v %v", r, err)
	}
	// etcd moves on, outside the data set only.
	for i := range 5 {
		if _, err := cli.Put(ctx, "/elsewhere"+p, time.Now().String()); err != nil {
			t.Fatal(err, i)
		}
	}
	start := time.Now()
	s2, _, err := b2.Subscribe(ctx, lock.SubscribeRequest{Node: "n", LastID: sub.ID, HasLast: true})
	took := time.Since(start)
	if err != nil {
		t.Fatalf("the stream on the second server, after %v: %v", took, err)
	}
	defer s2.Close()
	// A bound on waiting for etcd's answer, not a measure of speed: the
	// bug waited 10 s.
	if took > 3*time.Second {
		t.Fatalf("the stream on the second server took %v to open", took)
	}
	st, err := b2.Status(ctx, lock.Pull, "r", "n")
	if err != nil || st.Holder != "n" {
		t.Fatalf("the hold after the move: %+v %v", st, err)
	}
}
