package etcd

import (
	"context"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/lock"
)

// guaranteed is how long from now the hold h describes is sure to stand:
// nothing can end it and hand the key on before (docs/DESIGN.md,
// "Leases"). A ttl lease stands to its deadline, and a session lease to
// the moment before which etcd cannot expire it: this server's keeper
// knows it for the sessions it keeps alive; for another server's, etcd's
// own count of what is left, read now, in whole seconds rounded down.
// Either ends sooner at a claim or max hold deadline. 0 when this server
// cannot vouch for the hold (it cannot reach etcd, or the lease is gone):
// a server that cannot keep a session alive does not confirm it. Deadlines
// are wall-clock times that every server's timers act on, so a clock ahead
// of this one ends a ttl hold early by its lead: docs/DESIGN.md says what
// the client's margin covers.
func (b *Backend) guaranteed(ctx context.Context, h holdEnds) time.Duration {
	now := time.Now()
	var until time.Time
	switch lock.Lease(h.lease) {
	case lock.LeaseTTL:
		until = time.Unix(0, h.ttl)
	case lock.LeaseSession:
		if until = b.keeper.until(h.slease); until.IsZero() {
			until = b.leaseLeft(ctx, h.slease, now)
		}
	}
	for _, d := range []int64{h.claim, h.maxHold} {
		if d != 0 && time.Unix(0, d).Before(until) {
			until = time.Unix(0, d)
		}
	}
	return max(until.Sub(now), 0)
}

// leaseLeft asks etcd how long lease has left, asked at now: etcd's leader
// answers from its own clock after now, so the lease stands at least that
// long after now. Zero when etcd does not answer or the lease is gone.
func (b *Backend) leaseLeft(ctx context.Context, lease int64, now time.Time) time.Time {
	if lease == 0 {
		return time.Time{}
	}
	bctx, cancel := b.bound(ctx)
	defer cancel()
	resp, err := b.cli.TimeToLive(bctx, clientv3.LeaseID(lease))
	if err != nil || resp.TTL <= 0 {
		return time.Time{}
	}
	return now.Add(time.Duration(resp.TTL) * time.Second)
}
