package etcd_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/etcd"
)

// TestAttackEtcdGone closes a private etcd under a backend: every call
// answers (lock.ErrUnavailable, or an error of its own context) within a
// bound, with a context that never ends, and Close returns.
func TestAttackEtcdGone(t *testing.T) {
	srv := etcdtest.StartEmbedded(t)
	// A client of its own: srv.Close closes the clients it made, and this
	// one must stay, as a server's client does when etcd goes away.
	cli, err := clientv3.New(clientv3.Config{Endpoints: srv.Endpoints(), DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	cfg := etcd.DefaultConfig()
	cfg.RefCounting = true
	b := newBackend(t, cli, etcdtest.Prefix(t), cfg)
	tryLock(t, b, ttlReq("r", "a"))
	st := subscribe(t, b, "a")
	_ = st
	srv.Close()
	ctx := context.Background()
	// One resource a call: calls of one resource wait for each other, and
	// each for up to its bound (TestAttackEtcdGoneQueued).
	calls := map[string]func() error{
		"TryLock": func() error { _, err := b.TryLock(ctx, ttlReq("r1", "b")); return err },
		"TryLock session": func() error {
			_, err := b.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: "s", Node: "c", Lease: lock.LeaseSession})
			return err
		},
		"Unlock": func() error {
			_, err := b.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: "r2", Node: "a", Success: true})
			return err
		},
		"Cancel":         func() error { _, err := b.Cancel(ctx, lock.Pull, "r3", "a"); return err },
		"Status":         func() error { _, err := b.Status(ctx, lock.Pull, "r4", "a"); return err },
		"RefCount":       func() error { _, err := b.RefCount(ctx, "r"); return err },
		"RefAdd":         func() error { _, err := b.RefAdd(ctx, "r5", "a"); return err },
		"RefRelease":     func() error { _, err := b.RefRelease(ctx, "r6", "a"); return err },
		"RefReleaseNode": func() error { _, err := b.RefReleaseNode(ctx, "a"); return err },
		"Subscribe": func() error {
			st, _, err := b.Subscribe(ctx, lock.SubscribeRequest{Node: "z"})
			if err == nil {
				st.Close()
			}
			return err
		},
		"Subscribe with last id": func() error {
			// An observer needs nothing of etcd to open; it may.
			st, _, err := b.Subscribe(ctx, lock.SubscribeRequest{Observe: &lock.Key{Type: lock.Pull, Resource: "r"}, HasLast: true, LastID: 1 << 20})
			if err == nil {
				st.Close()
			}
			return err
		},
	}
	var wg sync.WaitGroup
	for name, call := range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			done := make(chan error, 1)
			go func() { done <- call() }()
			select {
			case err := <-done:
				if !errors.Is(err, lock.ErrUnavailable) && !(name == "Subscribe with last id" && err == nil) {
					t.Errorf("%s with etcd gone: %v, want ErrUnavailable", name, err)
				}
			case <-time.After(45 * time.Second):
				t.Errorf("%s with etcd gone: no answer after 45 s", name)
				<-done // let Close below end it, for goleak
			}
		}()
	}
	waitAll := make(chan struct{})
	go func() { wg.Wait(); close(waitAll) }()
	select {
	case <-waitAll:
	case <-time.After(60 * time.Second):
		b.Close() // ends the calls that hang, for goleak
		<-waitAll
	}
	if err := b.Close(); err != nil && !errors.Is(err, lock.ErrClosed) {
		t.Fatalf("Close: %v", err)
	}
	if _, err := b.TryLock(ctx, ttlReq("r", "b")); !errors.Is(err, lock.ErrClosed) {
		t.Fatalf("TryLock after Close: %v, want ErrClosed", err)
	}
}

// TestAttackEtcdGoneQueued queues calls of one resource behind each other
// with etcd gone: each answers within a bound of its own, not one per call
// before it.
func TestAttackEtcdGoneQueued(t *testing.T) {
	srv := etcdtest.StartEmbedded(t)
	cli, err := clientv3.New(clientv3.Config{Endpoints: srv.Endpoints(), DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	b := newBackend(t, cli, etcdtest.Prefix(t), etcd.DefaultConfig())
	tryLock(t, b, ttlReq("r", "a"))
	srv.Close()
	const n = 4
	errs := make(chan error, n)
	start := time.Now()
	for i := range n {
		go func() {
			_, err := b.Status(context.Background(), lock.Pull, "r", fmt.Sprint("n", i))
			errs <- err
		}()
	}
	for range n {
		select {
		case err := <-errs:
			if !errors.Is(err, lock.ErrUnavailable) {
				t.Errorf("Status with etcd gone: %v, want ErrUnavailable", err)
			}
		case <-time.After(45 * time.Second):
			b.Close()
			t.Fatalf("%d calls of one resource queued with etcd gone: not all answered after %v", n, time.Since(start))
		}
	}
}
