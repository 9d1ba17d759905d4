package etcd_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/dlock/dlock/lock"
)

// TestAttackManyTTLWaitersExpireTogether: a key with more waiters than
// etcd's 128 operations of one transaction, all on ttl leases that run out
// together. Their queue places must end (docs/DESIGN.md, "Leases": "queue
// place removed"), whatever etcd's limit on one transaction.
func TestAttackManyTTLWaitersExpireTogether(t *testing.T) {
	b, _ := open(t, func(c *lock.Config) { c.LockTTL = time.Second })
	subscribe(t, b, "holder")
	tryLock(t, b, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "holder", Lease: lock.LeaseSession})
	const n = 100
	for i := range n {
		if r := tryLock(t, b, ttlReq("r", fmt.Sprintf("w%03d", i))); !r.Queued {
			t.Fatalf("w%d: %+v, want queued", i, r)
		}
	}
	eventually(t, "every ttl waiter to leave the queue", func() bool { return stat(t, b, lock.Pull, "r", "").QueueLength == 0 })
	if st := stat(t, b, lock.Pull, "r", ""); st.Holder != "holder" {
		t.Fatalf("status %+v, want holder still holding", st)
	}
}
