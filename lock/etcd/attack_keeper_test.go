package etcd

import (
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

// TestAttackKeeperPairsAcrossRemoveAdd: the keeper pairs each answer of its
// LeaseKeepAlive stream with the send it answers, the oldest on the wire
// (keeper.go). A node's last stream on this server closes while a
// keepalive of its lease is on the wire (the keeper stops keeping the
// lease), and the node comes back at once (the keeper keeps the lease
// again, shown alive by a send of t2: a check's KeepAliveOnce, or a grant),
// before etcd answered that keepalive. The
// keeper sends no second keepalive of the lease while the first is on the
// wire; the old answer arrives and answers the send made before the
// remove: pairing it with a later send would vouch for a lease end etcd
// never set (until the later answer comes, which a stream that breaks now
// never brings). No server may vouch for more than etcd honours
// (docs/DESIGN.md, "Leases"). The lease's next keepalive goes out a period
// after t2, and its answer counts from its own send.
func TestAttackKeeperPairsAcrossRemoveAdd(t *testing.T) {
	b := &Backend{graceTTL: 3}
	k := newKeeper(b).lane(42)
	const lease, ttl = 42, 3 * time.Second
	answer := &pb.LeaseKeepAliveResponse{ID: lease, TTL: int64(ttl / time.Second)}
	t0 := time.Now()

	k.add(lease, t0, t0.Add(ttl)) // shown alive by a send at t0
	s1 := t0.Add(k.k.every)
	if ids, _ := k.due(nil, nil, s1); len(ids) != 1 {
		t.Fatalf("due at %v: %v", s1.Sub(t0), ids)
	}
	k.remove(lease)                     // the node's last stream here closed
	t2 := s1.Add(10 * time.Millisecond) // it is back: shown alive by a send at t2
	k.add(lease, t2, t2.Add(ttl))
	s3 := t2.Add(k.k.every)
	if ids, _ := k.due(nil, nil, s3); len(ids) != 0 {
		t.Fatalf("due at %v, with the keepalive sent at %v unanswered: %v", s3.Sub(t0), s1.Sub(t0), ids)
	}
	// The answer to the send at s1 arrives: etcd renewed the lease at
	// some moment after s1, nothing says after s3.
	if err := k.answered(answer, s3); err != nil {
		t.Fatal(err)
	}
	if got, sound := k.until(lease), t2.Add(ttl); got.After(sound) {
		t.Fatalf("after the answer to the keepalive sent at +%v, the keeper vouches for the lease to +%v; etcd honours only +%v (the latest send known answered, plus the TTL)",
			s1.Sub(t0), got.Sub(t0), sound.Sub(t0))
	}
	if ids, _ := k.due(nil, nil, s3); len(ids) != 1 {
		t.Fatalf("due at %v, the old keepalive answered: %v", s3.Sub(t0), ids)
	}
	// The answer to the send at s3 then counts from s3.
	if err := k.answered(answer, s3.Add(time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if got, want := k.until(lease), s3.Add(ttl); !got.Equal(want) {
		t.Fatalf("after the second answer: +%v, want +%v", got.Sub(t0), want.Sub(t0))
	}
}
