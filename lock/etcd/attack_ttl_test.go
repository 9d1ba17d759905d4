package etcd_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/etcd"
)

// TestAttackManyTTLWaitersExpireTogether: a key with more waiters than
// etcd's 128 operations of one transaction, all on ttl leases that run out
// together. Their queue places must end (docs/DESIGN.md, "Leases": "queue
// place removed"), whatever etcd's limit on one transaction.
func TestAttackManyTTLWaitersExpireTogether(t *testing.T) {
	b, _ := open(t, func(c *etcd.Config) { c.LockTTL = time.Second })
	subscribe(t, b, "holder")
	tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "holder", Lease: lock.LeaseSession})
	const n = 100
	for i := range n {
		if r := tryLock(t, b, ttlReq("r", fmt.Sprintf("w%03d", i))); !r.Queued {
			t.Fatalf("w%d: %+v, want queued", i, r)
		}
	}
	etcd.Eventually(t, "every ttl waiter to leave the queue", func() bool { return stat(t, b, lock.Pull, "r", "").QueueLength == 0 })
	if st := stat(t, b, lock.Pull, "r", ""); st.Holder != "holder" {
		t.Fatalf("status %+v, want holder still holding", st)
	}
}

// TestAttackExpiredWaiterNotPromoted: when one timer firing finds both the
// hold and the head waiter's ttl lease run out (no server was up to fire
// them apart), the waiter leaves first and the key goes to the next one
// (docs/DESIGN.md, "Leases": a queue place ends, and no hold is handed to
// a waiter whose lease ran out), and the queue's count stays true.
func TestAttackExpiredWaiterNotPromoted(t *testing.T) {
	mod := func(c *etcd.Config) { c.LockTTL = time.Second }
	b1, p := open(t, mod)
	tryLock(t, b1, ttlReq("r", "a"))
	tryLock(t, b1, ttlReq("r", "w1"))
	if r := tryLock(t, b1, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "w2", Lease: lock.LeaseSession}); !r.Queued || r.Position != 2 {
		t.Fatalf("w2: %+v, want queued second", r)
	}
	// w2's session lives on, kept by the test, while no server is up.
	cli := etcdtest.Shared(t).Client(t)
	resp, err := cli.Get(context.Background(), p+"s/w2")
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("w2's session: %v %v", resp, err)
	}
	var sr struct {
		L int64 `json:"l"`
	}
	if err := json.Unmarshal(resp.Kvs[0].Value, &sr); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := cli.KeepAlive(ctx, clientv3.LeaseID(sr.L)); err != nil {
		t.Fatal(err)
	}
	b1.Close()
	due := time.Now().Add(1500 * time.Millisecond)
	for time.Now().Before(due) { // the wall clock passes a's and w1's deadlines
		time.Sleep(50 * time.Millisecond)
	}
	b2 := openAt(t, p, mod)
	var st lock.Status
	etcd.Eventually(t, "a's hold to end", func() bool { st = stat(t, b2, lock.Pull, "r", ""); return st.Holder != "a" })
	if st.Holder != "w2" || st.QueueLength != 0 {
		t.Fatalf("status %+v, want w2 holding with nobody waiting: w1's ttl ran out", st)
	}
	left, err := cli.Get(context.Background(), p+"q/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil || left.Count != 0 {
		t.Fatalf("%v queue entries left (%v), want none", left.Count, err)
	}
}
