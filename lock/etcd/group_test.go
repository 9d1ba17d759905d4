package etcd

import (
	"context"
	"fmt"
	"hash/maphash"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
)

// TestGroupJoins: a group never writes a key twice, lists a reader of a
// key before its writer, and refuses a transaction that would have to come
// both before and after members (docs/DESIGN.md, "Fewer, larger
// transactions").
func TestGroupJoins(t *testing.T) {
	put := func(k string) clientv3.Op { return clientv3.OpPut(k, "v") }
	guard := func(k string) clientv3.Cmp { return clientv3.Compare(clientv3.ModRevision(k), "=", 1) }
	p := func(cmps []clientv3.Cmp, ops ...clientv3.Op) *pending { return newPending(cmps, ops, nil) }

	a := p([]clientv3.Cmp{guard("/k/a")}, put("/k/a"))
	b := p([]clientv3.Cmp{guard("/k/b")}, put("/k/b"))
	if !joins([]*pending{a}, b) {
		t.Fatal("transactions of two keys did not join")
	}
	if joins([]*pending{a}, p(nil, put("/k/a"))) {
		t.Fatal("a second write of /k/a joined")
	}
	if joins([]*pending{a}, p(nil, clientv3.OpDelete("/k/", clientv3.WithPrefix()))) {
		t.Fatal("a prefix delete over /k/a joined a write of it")
	}
	if !joins([]*pending{a}, p(nil, clientv3.OpDelete("/q/", clientv3.WithPrefix()))) {
		t.Fatal("a prefix delete of other keys did not join")
	}
	// r reads /k/a, which a writes: it joins, and goes first.
	r := p([]clientv3.Cmp{guard("/k/a"), guard("/k/r")}, put("/k/r"))
	if !joins([]*pending{a}, r) {
		t.Fatal("a reader of a member's write did not join")
	}
	if got, ok := order([]*pending{a, b, r}); !ok || indexOf(got, r) > indexOf(got, a) {
		t.Fatalf("order put the reader of /k/a after its writer: %v", ok)
	}
	// w reads /k/b (b writes it) and writes /k/r2 (r2 reads it): it
	// would have to come before b and after r2. With either alone, fine;
	// with both, refused: another member could order b before r2.
	w := p([]clientv3.Cmp{guard("/k/b")}, put("/k/r2"))
	r2 := p([]clientv3.Cmp{guard("/k/r2")}, put("/k/x"))
	if !joins([]*pending{b}, w) || !joins([]*pending{r2}, w) {
		t.Fatal("a transaction ordered one way with each member was refused")
	}
	if joins([]*pending{b, r2}, w) {
		t.Fatal("a transaction that must come both before b and after r2 joined")
	}
	// The cycle joins refuses would have no order.
	c1 := p([]clientv3.Cmp{guard("/c/2")}, put("/c/1"))
	c2 := p([]clientv3.Cmp{guard("/c/1")}, put("/c/2"))
	if joins([]*pending{c1}, c2) {
		t.Fatal("two transactions that read each other's writes joined")
	}
	if _, ok := order([]*pending{c1, c2}); ok {
		t.Fatal("order found an order for a cycle")
	}
	// A transaction too large to nest goes alone.
	var big []clientv3.Op
	for i := range groupSubOps + 1 {
		big = append(big, put(fmt.Sprintf("/big/%d", i)))
	}
	if !p(nil, big...).alone {
		t.Fatal("a transaction over groupSubOps operations would be nested")
	}
}

func indexOf(l []*pending, p *pending) int {
	for i, q := range l {
		if q == p {
			return i
		}
	}
	return -1
}

// TestGroupOneRevision: calls of many keys that wait together commit in one
// etcd request, hence one revision; the events of its changes have
// distinct, increasing ids on a stream that gets more than one of them (a
// session stream that also observes a key), and another server of the data
// set gives the same ids (docs/DESIGN.md, "Fewer, larger transactions").
func TestGroupOneRevision(t *testing.T) {
	srv := etcdtest.Shared(t)
	p := etcdtest.Prefix(t)
	cfg := DefaultConfig()
	cfg.Prefix = p
	ctx := context.Background()
	a, err := New(ctx, srv.Client(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := New(ctx, srv.Client(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()

	// Calls of resources of one stripe wait for each other before they
	// reach the grouper (tx.go, run): every resource here has a stripe of
	// its own.
	stripes := map[uint64]bool{}
	resource := func(name string) string {
		for i := 0; ; i++ {
			r := fmt.Sprintf("sha256:%s-%d", name, i)
			if s := maphash.String(a.seed, r) % uint64(len(a.stripes)); !stripes[s] {
				stripes[s] = true
				return r
			}
		}
	}
	// n's session stream also observes k1, which m gets in the same
	// request as n gets k2.
	k1 := lock.Key{Type: lock.Pull, Resource: resource("k1")}
	k2 := lock.Key{Type: lock.Pull, Resource: resource("k2")}
	st, sub, err := a.Subscribe(ctx, lock.SubscribeRequest{Node: "n", Observe: &k1})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()

	// Both request slots are held by a call each; what comes next waits.
	var held atomic.Int32
	release := make(chan struct{})
	hold := func() {
		held.Add(1)
		<-release
	}
	a.g.hold.Store(&hold)
	var wg sync.WaitGroup
	lockKey := func(k lock.Key, node string) {
		defer wg.Done()
		r, err := a.TryLock(ctx, lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: node, Lease: lock.LeaseTTL})
		if err != nil || !r.Acquired {
			t.Errorf("%s on %v: %+v %v", node, k, r, err)
		}
	}
	for i := range groupFlight {
		// One at a time: two calls that wait together go together.
		wg.Add(1)
		go lockKey(lock.Key{Type: lock.Pull, Resource: resource("plug")}, "plug")
		kit.WaitFor(t, "a request slot to be held", func() bool { return held.Load() == int32(i+1) })
	}
	keys := []lock.Key{k1, k2}
	nodes := []string{"m", "n"}
	for i := range 16 {
		keys = append(keys, lock.Key{Type: lock.Pull, Resource: resource("other")})
		nodes = append(nodes, fmt.Sprintf("o%d", i))
	}
	for i, k := range keys {
		wg.Add(1)
		go lockKey(k, nodes[i])
	}
	kit.WaitFor(t, "every call to wait for a request", func() bool {
		a.g.mu.Lock()
		defer a.g.mu.Unlock()
		return len(a.g.q) == len(keys)
	})
	grouped := a.g.grouped.Load()
	close(release)
	wg.Wait()
	if a.g.grouped.Load() == grouped {
		t.Fatal("no request carried more than one transaction")
	}
	var rev int64
	for _, k := range keys {
		resp, err := srv.Client(t).Get(ctx, a.n.key(k))
		if err != nil || len(resp.Kvs) == 0 {
			t.Fatalf("%v's record: %v", k, err)
		}
		if rev == 0 {
			rev = resp.Kvs[0].ModRevision
		} else if resp.Kvs[0].ModRevision != rev {
			t.Fatalf("%v was written at revision %d, the others at %d: not one request", k, resp.Kvs[0].ModRevision, rev)
		}
	}

	// n's stream: k1's grant to m (observed) and k2's to n, one revision,
	// two ids, increasing.
	var got []lock.Delivery
	deadline := time.After(10 * time.Second)
	for len(got) < 2 {
		select {
		case <-st.Ready():
			got = st.Take(got)
		case <-deadline:
			t.Fatalf("n's stream has %d events, want 2", len(got))
		}
	}
	byKey := map[lock.Key]lock.Delivery{}
	prev := sub.ID
	for _, d := range got {
		if d.ID <= prev {
			t.Fatalf("event ids not increasing on n's stream: %d after %d", d.ID, prev)
		}
		prev = d.ID
		if idRev(d.ID) != rev {
			t.Fatalf("event %d is not of revision %d", d.ID, rev)
		}
		byKey[d.Event.Key] = d
	}
	if byKey[k1].Event == nil || byKey[k1].Event.Node != "m" || byKey[k2].Event == nil || byKey[k2].Event.Node != "n" {
		t.Fatalf("n's stream: %+v", got)
	}
	// The other server knows n's event by the same id.
	st.Close()
	kit.WaitFor(t, "b's watch to reach the grants", func() bool { return b.w.caughtUp(rev, 100*time.Millisecond) })
	st2, sub2, err := b.Subscribe(ctx, lock.SubscribeRequest{Node: "n", LastID: sub.ID, HasLast: true})
	if err != nil {
		t.Fatal(err)
	}
	defer st2.Close()
	if sub2.Missed || len(sub2.Replay) != 1 || sub2.Replay[0].ID != byKey[k2].ID || sub2.Replay[0].Event.Key != k2 {
		t.Fatalf("replay on the other server: missed=%v %+v; want k2's grant with id %d", sub2.Missed, sub2.Replay, byKey[k2].ID)
	}
}

// TestOldEventIDResumes: a stream that resumes with an id of the numbering
// before grouped requests (revision × 8 + index) replays exactly the events
// after it, and ids of this numbering are above every such id
// (docs/DESIGN.md, "An etcd backend", "Events are derived, not stored").
func TestOldEventIDResumes(t *testing.T) {
	srv := etcdtest.Shared(t)
	cfg := DefaultConfig()
	cfg.Prefix = etcdtest.Prefix(t)
	ctx := context.Background()
	b, err := New(ctx, srv.Client(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	st, sub, err := b.Subscribe(ctx, lock.SubscribeRequest{Node: "n"})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	var got []lock.Delivery
	for i := range 2 {
		if r, err := b.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: fmt.Sprintf("sha256:old%d", i), Node: "n", Lease: lock.LeaseSession}); err != nil || !r.Acquired {
			t.Fatalf("lock %d: %+v %v", i, r, err)
		}
	}
	deadline := time.After(10 * time.Second)
	for len(got) < 2 {
		select {
		case <-st.Ready():
			got = st.Take(got)
		case <-deadline:
			t.Fatalf("n's stream has %d events, want 2", len(got))
		}
	}
	if sub.ID < idBase || got[0].ID <= sub.ID {
		t.Fatalf("ids %d, %d: not in this numbering", sub.ID, got[0].ID)
	}
	// The first grant as the numbering before would have named it.
	first := got[0].ID
	if (first-idBase)%idsPerRev != 0 {
		t.Fatalf("a lone transition's event %d is not its revision's first id", first)
	}
	old := uint64(idRev(first))*oldPerRev + 0
	if normID(old) != first {
		t.Fatalf("normID(%d) = %d, want %d", old, normID(old), first)
	}
	st.Close()
	st2, sub2, err := b.Subscribe(ctx, lock.SubscribeRequest{Node: "n", LastID: old, HasLast: true})
	if err != nil {
		t.Fatal(err)
	}
	defer st2.Close()
	if sub2.Missed || sub2.ID != first || len(sub2.Replay) != 1 || sub2.Replay[0].ID != got[1].ID {
		t.Fatalf("resumed after old id %d: missed=%v id=%d replay=%+v; want the second grant only (%d)", old, sub2.Missed, sub2.ID, sub2.Replay, got[1].ID)
	}
}

// TestSpanOverlaps: keys and ranges as etcd has them, a range's end
// excluded, "\x00" as an end that never comes.
func TestSpanOverlaps(t *testing.T) {
	k := func(s string) span { return span{key: []byte(s)} }
	r := func(a, b string) span { return span{key: []byte(a), end: []byte(b)} }
	for _, c := range []struct {
		a, b span
		want bool
	}{
		{k("/a"), k("/a"), true},
		{k("/a"), k("/b"), false},
		{k("/a/1"), r("/a/", "/a0"), true},
		{k("/a0"), r("/a/", "/a0"), false},
		{k("/a."), r("/a/", "/a0"), false},
		{r("/a/", "/a0"), r("/a/x", "/b"), true},
		{r("/a/", "/a0"), r("/a0", "/b"), false},
		{k("/z"), r("/m", "\x00"), true},
		{k("/a"), r("/m", "\x00"), false},
		{r("/a", "/n"), r("/m", "\x00"), true},
	} {
		if got := c.a.overlaps(c.b); got != c.want {
			t.Errorf("%q overlaps %q: %v, want %v", c.a, c.b, got, c.want)
		}
		if got := c.b.overlaps(c.a); got != c.want {
			t.Errorf("%q overlaps %q: %v, want %v", c.b, c.a, got, c.want)
		}
	}
	a, b := k("/a/1"), r("/a/", "/a0")
	if n := testing.AllocsPerRun(100, func() { a.overlaps(b) }); n != 0 {
		t.Errorf("overlaps allocates %v times", n)
	}
}
