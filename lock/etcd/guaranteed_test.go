package etcd_test

import (
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/internal/netfault"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/etcd"
)

// TestGuaranteeOutlivesPartition: a server cut off from etcd while it keeps
// a holder's session alive vouched, before the cut, for no more than etcd
// then honours: the key is handed on (by another server, which reaches
// etcd) no sooner than the last guarantee, counted from before the call
// that got it (docs/DESIGN.md, "The holder stops first"). The cut is a
// black hole between the server and etcd: nothing is closed, etcd's
// answers stop.
func TestGuaranteeOutlivesPartition(t *testing.T) {
	srv := etcdtest.Shared(t)
	px := netfault.NewProxy(t, srv.Endpoints()[0][len("http://"):])
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{"http://" + px.Addr()}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	cfg := etcd.DefaultConfig()
	cfg.SessionGrace = 2 * time.Second
	p := etcdtest.Prefix(t)
	cut := newBackend(t, cli, p, withPrefix(cfg, p))
	other := openAt(t, p, func(c *etcd.Config) { c.SessionGrace = 2 * time.Second })

	st := subscribe(t, cut, "h")
	_ = st
	if r := tryLock(t, cut, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "h", Lease: lock.LeaseSession}); !r.Acquired || r.Guaranteed <= 0 || r.Guaranteed > 2*time.Second {
		t.Fatalf("the grant: %+v, want acquired with a guarantee in (0, 2s]", r)
	}
	waiter := subscribe(t, other, "w")
	if r := tryLock(t, other, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "w", Lease: lock.LeaseSession}); !r.Queued {
		t.Fatalf("the waiter: %+v", r)
	}
	// Confirm, as a client does, then cut: the last guarantee is what
	// the holder would go by.
	sent := time.Now()
	g := stat(t, cut, lock.Pull, "r", "h").Guaranteed
	if g <= 0 {
		t.Fatalf("a server that reaches etcd and keeps the session vouched for nothing")
	}
	px.Blackhole()
	d := next(t, waiter)
	handed := time.Now()
	if d.Event.Name != lock.EventLockAssigned || d.Event.Node != "w" {
		t.Fatalf("the waiter got %+v, want the key", d.Event)
	}
	if handed.Before(sent.Add(g)) {
		t.Fatalf("handed on %v after the last confirmation was sent, which guaranteed %v", handed.Sub(sent), g)
	}
	t.Logf("last guarantee %v; handed on %v after it was asked for", g, handed.Sub(sent))
}
