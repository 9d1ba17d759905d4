package etcdtest

import (
	"context"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"
)

// TestMain checks that the servers, the shared one included, leave no
// goroutine behind.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(M(m), GoleakOptions()...)
}

// exercise puts and gets, takes a key in a transaction as a lock would,
// keeps a lease alive past its TTL and watches a prefix, all under prefix.
func exercise(t *testing.T, c *clientv3.Client, prefix string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()

	// Put and get.
	if _, err := c.Put(ctx, prefix+"k", "v"); err != nil {
		t.Fatalf("put: %v", err)
	}
	r, err := c.Get(ctx, prefix+"k")
	if err != nil || len(r.Kvs) != 1 || string(r.Kvs[0].Value) != "v" {
		t.Fatalf("get: %+v %v", r, err)
	}

	// A watch from the next revision sees the next put.
	w := c.Watch(clientv3.WithRequireLeader(ctx), prefix+"w/", clientv3.WithPrefix(), clientv3.WithRev(r.Header.Revision+1))
	if _, err := c.Put(ctx, prefix+"w/a", "1"); err != nil {
		t.Fatalf("put: %v", err)
	}
	select {
	case wr := <-w:
		if err := wr.Err(); err != nil || len(wr.Events) != 1 || string(wr.Events[0].Kv.Key) != prefix+"w/a" {
			t.Fatalf("watch: %+v %v", wr, err)
		}
	case <-ctx.Done():
		t.Fatal("watch: no event")
	}

	// A lease kept alive past its TTL holds a key taken in a transaction
	// (create revision 0: nobody has it), which a second try does not take.
	lease, err := c.Grant(ctx, 2)
	if err != nil {
		t.Fatalf("grant: %v", err)
	}
	kctx, stopKeepAlive := context.WithCancel(ctx)
	defer stopKeepAlive()
	ka, err := c.KeepAlive(kctx, lease.ID)
	if err != nil {
		t.Fatalf("keepalive: %v", err)
	}
	take := func() bool {
		t.Helper()
		tr, err := c.Txn(ctx).
			If(clientv3.Compare(clientv3.CreateRevision(prefix+"lock"), "=", 0)).
			Then(clientv3.OpPut(prefix+"lock", "me", clientv3.WithLease(lease.ID))).
			Commit()
		if err != nil {
			t.Fatalf("txn: %v", err)
		}
		return tr.Succeeded
	}
	if !take() {
		t.Fatal("txn: the free key was not taken")
	}
	if take() {
		t.Fatal("txn: the taken key was taken again")
	}
	deadline := time.After(3 * time.Second) // past the TTL
	answers := 0
	for waiting := true; waiting; {
		select {
		case _, ok := <-ka:
			if !ok {
				t.Fatal("keepalive: the channel closed")
			}
			answers++
		case <-deadline:
			waiting = false
		}
	}
	if answers < 2 {
		t.Fatalf("keepalive: %d answers in 3s for a 2s lease", answers)
	}
	if r, err := c.Get(ctx, prefix+"lock"); err != nil || len(r.Kvs) != 1 || r.Kvs[0].Lease != int64(lease.ID) {
		t.Fatalf("the leased key after the TTL: %+v %v", r, err)
	}
	if _, err := c.Revoke(ctx, lease.ID); err != nil {
		t.Fatalf("revoke: %v", err)
	}
	if r, err := c.Get(ctx, prefix+"lock"); err != nil || len(r.Kvs) != 0 {
		t.Fatalf("the leased key after the revoke: %+v %v", r, err)
	}
}

func TestEmbedded(t *testing.T) {
	start := time.Now()
	s := StartEmbedded(t)
	t.Logf("embedded etcd ready in %v at %v", time.Since(start), s.Endpoints())
	exercise(t, s.Client(t), Prefix(t))
	s.Close()
	s.Close() // idempotent
}

// TestEmbeddedDir: a server on a given data directory, restarted on it,
// has the data of the first.
func TestEmbeddedDir(t *testing.T) {
	dir := t.TempDir()
	s := StartEmbeddedWith(t, Options{Dir: dir})
	p := Prefix(t)
	if _, err := s.Client(t).Put(t.Context(), p+"k", "v"); err != nil {
		t.Fatal(err)
	}
	s.Close()
	s = StartEmbeddedWith(t, Options{Dir: dir})
	if r, err := s.Client(t).Get(t.Context(), p+"k"); err != nil || len(r.Kvs) != 1 {
		t.Fatalf("after the restart: %+v %v", r, err)
	}
}

// TestShared: tests share one server and keep apart by prefix.
func TestShared(t *testing.T) {
	start := time.Now()
	s := Shared(t)
	t.Logf("shared etcd ready in %v at %v", time.Since(start), s.Endpoints())
	for _, name := range []string{"a", "b"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			if Shared(t) != s {
				t.Fatal("a second shared server")
			}
			exercise(t, s.Client(t), Prefix(t))
		})
	}
}

// TestCloseLeavesNothing: Close, with a watch and a lease's keepalive still
// open on the server's client, leaves no goroutine of the server or the
// client behind, at once (not only by TestMain's check).
func TestCloseLeavesNothing(t *testing.T) {
	ignore := goleak.IgnoreCurrent()
	s := StartEmbedded(t)
	c := s.Client(t)
	ctx := context.Background() // nothing but Close ends them
	w := c.Watch(ctx, Prefix(t), clientv3.WithPrefix())
	lease, err := c.Grant(ctx, 5)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.KeepAlive(ctx, lease.ID); err != nil {
		t.Fatal(err)
	}
	s.Close()
	for range w { // the client's close ends the watch
	}
	if err := goleak.Find(append(GoleakOptions(), ignore)...); err != nil {
		t.Fatal(err)
	}
}
