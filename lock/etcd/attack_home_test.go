package etcd

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/lock"
)

// Attacks on home leases (docs/DESIGN.md, "Home leases"): promotions that
// race each other, the watch, the end of a session in its grace, the home
// lease's end and Close.

// localOf is a copy of node's local session on b, and whether b has one.
func localOf(b *Backend, node string) (localSession, bool) {
	b.s.mu.Lock()
	defer b.s.mu.Unlock()
	ls := b.s.local[node]
	if ls == nil {
		return localSession{}, false
	}
	return localSession{lease: ls.lease, home: ls.home, streams: ls.streams}, true
}

func streamDone(s lock.Stream) bool {
	select {
	case <-s.Done():
		return true
	default:
		return false
	}
}

// graceLocal closes node's only stream on b and returns its local session,
// in its grace, with its end stopped: the test fires it (endHomed) when it
// chooses, as the timer would.
func graceLocal(t *testing.T, b *Backend, node string) *localSession {
	t.Helper()
	s := subscribe(t, b, node)
	s.Close()
	b.s.mu.Lock()
	defer b.s.mu.Unlock()
	ls := b.s.local[node]
	if ls == nil || ls.end == nil || ls.streams != 0 || ls.home == 0 {
		t.Fatalf("%s after its last stream: %+v, want a homed session with an end waiting", node, ls)
	}
	ls.stopEnd()
	return ls
}

// gate holds b's next etcd request of its grouper (group.go) until
// released: entered is closed when it is held.
type gate struct {
	armed   atomic.Bool
	entered chan struct{}
	release chan struct{}
	once    sync.Once
}

func holdNextRequest(t *testing.T, b *Backend) *gate {
	g := &gate{entered: make(chan struct{}), release: make(chan struct{})}
	g.armed.Store(true)
	h := func() {
		if g.armed.CompareAndSwap(true, false) {
			close(g.entered)
			<-g.release
		}
	}
	b.g.hold.Store(&h)
	t.Cleanup(g.open)
	return g
}

func (g *gate) open() { g.once.Do(func() { close(g.release) }) }

func (g *gate) wait(t *testing.T) {
	t.Helper()
	select {
	case <-g.entered:
	case <-time.After(kit.Patience):
		t.Fatal("no request reached the gate")
	}
}

// holdOf reads k's record from etcd: its holder and session lease.
func holdOf(t *testing.T, cli *clientv3.Client, b *Backend, k lock.Key) (holder string, slease int64) {
	t.Helper()
	resp, err := cli.Get(t.Context(), b.n.key(k))
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		return "", 0
	}
	r, err := decodeKey(resp.Kvs[0].Value)
	if err != nil {
		t.Fatal(err)
	}
	return r.Holder, r.SLease
}

func sessionLock(t *testing.T, b *Backend, res, node string) lock.LockResult {
	t.Helper()
	r, err := b.TryLock(t.Context(), lock.LockRequest{Type: lock.Pull, Resource: res, Node: node, Lease: lock.LeaseSession})
	if err != nil || !r.Acquired {
		t.Fatalf("%s's session-leased lock of %s: %+v %v", node, res, r, err)
	}
	return r
}

// TestAttackHomeAcquireStaleWatchLosesLease: the interleaving
//
//	A: acquire reads node's session from A's watch: on A's home lease
//	B: a session-leased lock gives the session its own lease (B's grant)
//	A: the watch applies it; promoted forgets the session, in its grace
//	A: acquire counts the stream: a new local session on the home lease
//
// left A, before countHomed, with a stream of a session whose own lease
// nobody kept alive: no one told that local session about the promotion
// again. The lease ran out a grace after B's grant, and the session ended,
// with B's hold, while the node's stream on A was open: a session-leased
// hold lost by a node that did everything right.
//
// acquire's hook (seenHook) runs the promotion between its read of the
// watch and its count; every step is the code's own, in the order above.
// countHomed looks at the watch again after it counts.
func TestAttackHomeAcquireStaleWatchLosesLease(t *testing.T) {
	bs, cli := homeCluster(t, 2, 2*time.Second)
	a, b := bs[0], bs[1]
	const node = "stale"
	graceLocal(t, a, node)
	before, _, _ := sessionOf(t, cli, a, node)
	// A's Subscribe reads the watch's view (the session on A's home
	// lease); before it counts the stream, B promotes the session and A's
	// watch applies that and tells A's sessions, which forget the session
	// in its grace.
	hook := func() {
		a.s.seenHook.Store(nil)
		caughtUp(t, b, a)
		sessionLock(t, b, "layer", node)
		kit.WaitFor(t, "A's watch to apply the promotion (promoted forgets the session in its grace)", func() bool {
			_, ok := localOf(a, node)
			return !ok
		})
	}
	a.s.seenHook.Store(&hook)
	s := subscribe(t, a, node)
	defer s.Close()
	a.w.mu.Lock()
	si := a.w.sessions[node]
	if si == nil || si.home != 0 || si.lease != before.Lease {
		a.w.mu.Unlock()
		t.Fatalf("A's watch: %+v, want the session promoted", si)
	}
	a.w.mu.Unlock()
	l, _ := localOf(a, node)
	if l.home != 0 {
		t.Errorf("A counts the stream on a session it thinks lives on its home lease %x, though the session has its own lease %x: nobody keeps that lease alive", l.home, before.Lease)
	}
	kit.WaitFor(t, "A to keep the session's lease alive, or the session to end", func() bool {
		_, _, ok := sessionOf(t, cli, a, node)
		return !ok || !a.keeper.until(before.Lease).IsZero()
	})
	if _, _, ok := sessionOf(t, cli, a, node); !ok {
		kit.WaitFor(t, "the lost session's hold to be released", func() bool {
			h, _ := holdOf(t, cli, a, lock.Key{Type: lock.Pull, Resource: "layer"})
			return h == ""
		})
		t.Errorf("the session's own lease ran out with its stream on A open (the stream ended only with it: done=%v); its session-leased hold on layer was released as lost", streamDone(s))
	}
}

// TestAttackHomeSubscribeRacesWatchPromotion is the race above in real
// time: nodes in their grace on A are promoted through B while each opens
// a stream on A again. Every stream on A of a promoted session must come to
// be kept alive by A. (The window is narrow: this mostly checks the paths
// around it.)
func TestAttackHomeSubscribeRacesWatchPromotion(t *testing.T) {
	bs, cli := homeCluster(t, 2, 3*time.Second)
	a, b := bs[0], bs[1]
	const rounds, nodes = 3, 40
	var open []lock.Stream
	defer func() {
		for _, s := range open {
			s.Close()
		}
	}()
	for round := range rounds {
		names := make([]string, nodes)
		for i := range names {
			names[i] = fmt.Sprintf("r%d-n%d", round, i)
			s := subscribe(t, a, names[i])
			s.Close()
		}
		caughtUp(t, b, a)
		streams := make([]lock.Stream, nodes)
		var wg sync.WaitGroup
		for i, n := range names {
			wg.Go(func() {
				_, _ = b.TryLock(t.Context(), lock.LockRequest{Type: lock.Pull, Resource: "res-" + n, Node: n, Lease: lock.LeaseSession})
			})
			wg.Go(func() {
				if s, _, err := a.Subscribe(t.Context(), lock.SubscribeRequest{Node: n}); err == nil {
					streams[i] = s
				}
			})
		}
		wg.Wait()
		caughtUp(t, a, a, b)
		for i, n := range names {
			s := streams[i]
			if s == nil {
				continue
			}
			open = append(open, s)
			rec, _, ok := sessionOf(t, cli, a, n)
			if !ok || rec.Home != 0 {
				continue
			}
			kit.WaitFor(t, "A to keep "+n+"'s promoted session alive, or it to end", func() bool {
				_, _, stands := sessionOf(t, cli, a, n)
				return !stands || !a.keeper.until(rec.Lease).IsZero()
			})
			if _, _, stands := sessionOf(t, cli, a, n); !stands {
				t.Errorf("%s's promoted session ended with a stream open on A", n)
			}
		}
	}
}

// TestAttackHomePromotionStorm: a node on A's home lease, with a stream on
// A, opens streams on B and C and takes session-leased locks through A, B
// and C, all at once. One promotion wins; every server with a stream keeps
// the lease; the session and its holds outlive A's home lease; and once
// every stream closes the session ends within a grace or so, its holds
// with it (no phantom).
func TestAttackHomePromotionStorm(t *testing.T) {
	bs, cli := homeCluster(t, 3, 2*time.Second)
	a := bs[0]
	const node = "storm"
	sa := subscribe(t, a, node)
	rec, _, _ := sessionOf(t, cli, a, node)
	caughtUp(t, bs[1], a)
	caughtUp(t, bs[2], a)
	var wg sync.WaitGroup
	streams := make([]lock.Stream, 3)
	streams[0] = sa
	errs := make(chan error, 8)
	for i := 1; i < 3; i++ {
		wg.Go(func() {
			s, _, err := bs[i].Subscribe(t.Context(), lock.SubscribeRequest{Node: node})
			if err != nil {
				errs <- fmt.Errorf("stream on %d: %w", i, err)
				return
			}
			streams[i] = s
		})
	}
	for i := range 3 {
		wg.Go(func() {
			r, err := bs[i].TryLock(t.Context(), lock.LockRequest{Type: lock.Pull, Resource: fmt.Sprint("k", i), Node: node, Lease: lock.LeaseSession})
			if err != nil || !r.Acquired {
				errs <- fmt.Errorf("lock via %d: %+v %w", i, r, err)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	defer func() {
		for _, s := range streams {
			if s != nil {
				s.Close()
			}
		}
	}()
	own, attached, ok := sessionOf(t, cli, a, node)
	if !ok || own.Lease != rec.Lease || own.Home != 0 || attached != rec.Lease {
		t.Fatalf("after the storm: %+v on %x (exists %v), want session %x on its own lease", own, attached, ok, rec.Lease)
	}
	var n uint64
	for _, b := range bs {
		n += b.promotions.Load()
	}
	if n != 1 {
		t.Errorf("%d promotions counted, want 1", n)
	}
	for i, b := range bs {
		kit.WaitFor(t, fmt.Sprint("server ", i, " to keep the session's lease"), func() bool { return !b.keeper.until(rec.Lease).IsZero() })
	}
	if _, err := cli.Revoke(t.Context(), clientv3.LeaseID(rec.Home)); err != nil {
		t.Fatal(err)
	}
	// The keepalives carry the session past its grant's TTL.
	past := time.Now().Add(3 * time.Second)
	for i, b := range bs {
		kit.WaitFor(t, fmt.Sprint("server ", i, "'s keepalives to renew the session's lease"), func() bool { return b.keeper.until(rec.Lease).After(past) })
	}
	caughtUp(t, a, bs...)
	for i := range 3 {
		if h, sl := holdOf(t, cli, a, lock.Key{Type: lock.Pull, Resource: fmt.Sprint("k", i)}); h != node || sl != rec.Lease {
			t.Errorf("k%d: holder %q under %x, want %s under %x", i, h, sl, node, rec.Lease)
		}
	}
	for i, s := range streams {
		if s != nil && streamDone(s) {
			t.Errorf("stream on %d ended", i)
		}
	}
	for _, s := range streams {
		if s != nil {
			s.Close()
		}
	}
	kit.WaitFor(t, "the session to end once no stream keeps it", func() bool {
		_, _, ok := sessionOf(t, cli, a, node)
		return !ok
	})
	kit.WaitFor(t, "its holds to be released", func() bool {
		for i := range 3 {
			if h, _ := holdOf(t, cli, a, lock.Key{Type: lock.Pull, Resource: fmt.Sprint("k", i)}); h != "" {
				return false
			}
		}
		return true
	})
	for i, b := range bs {
		if l, ok := localOf(b, node); ok {
			t.Errorf("server %d still keeps %+v", i, l)
		}
	}
}

// TestAttackHomeManyMoveAtOnce: many nodes whose sessions live on A's home
// lease open streams on B at once (a fleet moving), while A keeps its
// streams; then A closes (its home lease to run out). Every session stands:
// on its own lease kept by B where A's promotion (adopt) was made before A
// closed, on B's home lease where it was not.
func TestAttackHomeManyMoveAtOnce(t *testing.T) {
	bs, cli := homeCluster(t, 2, 2*time.Second)
	a, b := bs[0], bs[1]
	const nodes = 150
	names := make([]string, nodes)
	var onA []lock.Stream
	for i := range names {
		names[i] = fmt.Sprint("fleet-", i)
		onA = append(onA, subscribe(t, a, names[i]))
	}
	recs := make([]sessRec, nodes)
	for i, n := range names {
		recs[i], _, _ = sessionOf(t, cli, a, n)
	}
	caughtUp(t, b, a)
	onB := make([]lock.Stream, nodes)
	var wg sync.WaitGroup
	var failed atomic.Int64
	for i, n := range names {
		wg.Go(func() {
			s, _, err := b.Subscribe(t.Context(), lock.SubscribeRequest{Node: n})
			if err != nil {
				failed.Add(1)
				return
			}
			onB[i] = s
		})
	}
	wg.Wait()
	defer func() {
		for _, s := range onB {
			if s != nil {
				s.Close()
			}
		}
	}()
	if f := failed.Load(); f > 0 {
		t.Errorf("%d of %d streams on B failed to open", f, nodes)
	}
	a.Close()
	if _, err := cli.Revoke(t.Context(), clientv3.LeaseID(recs[0].Home)); err != nil {
		t.Fatal(err)
	}
	for _, s := range onA {
		s.Close()
	}
	caughtUp(t, b, b)
	for i, n := range names {
		rec, attached, ok := sessionOf(t, cli, b, n)
		own := rec.Home == 0 && attached == rec.Lease
		onBHome := rec.Home == b.s.homeID() && attached == rec.Home
		if !ok || rec.Lease != recs[i].Lease || !own && !onBHome {
			t.Errorf("%s: %+v on %x (exists %v), want %x on its own lease or on B's home lease %x", n, rec, attached, ok, recs[i].Lease, b.s.homeID())
			continue
		}
		if onB[i] != nil && streamDone(onB[i]) {
			t.Errorf("%s's stream on B ended", n)
		}
		if own {
			// Told by its watch, B keeps the lease from its first
			// keepalive's answer.
			kit.WaitFor(t, "B to keep "+n+"'s lease", func() bool { return !b.keeper.until(rec.Lease).IsZero() })
		}
	}
}

// TestAttackHomeEndRacesPromotion: the end of a session in its grace
// (endHomed) races its promotion by a session-leased lock through another
// server, both ways, the order made by holding etcd requests. Either the
// promotion stands and the end changes nothing, or the end stands and the
// lock makes a new session: never a hold under a session that is gone, nor
// a session that outlives its grace with no stream.
func TestAttackHomeEndRacesPromotion(t *testing.T) {
	for _, endFirst := range []bool{false, true} {
		t.Run(fmt.Sprint("endFirst=", endFirst), func(t *testing.T) {
			bs, cli := homeCluster(t, 2, 2*time.Second)
			a, b := bs[0], bs[1]
			const node = "ending"
			ls := graceLocal(t, a, node)
			caughtUp(t, b, a)
			ga := holdNextRequest(t, a)
			ended := make(chan struct{})
			go func() { defer close(ended); a.s.endHomed(node, ls) }()
			ga.wait(t)
			var r lock.LockResult
			if endFirst {
				gb := holdNextRequest(t, b)
				locked := make(chan error, 1)
				go func() {
					var err error
					r, err = b.TryLock(t.Context(), lock.LockRequest{Type: lock.Pull, Resource: "layer", Node: node, Lease: lock.LeaseSession})
					locked <- err
				}()
				gb.wait(t)
				ga.open()
				<-ended
				gb.open()
				if err := <-locked; err != nil || !r.Acquired {
					t.Fatalf("the lock: %+v %v", r, err)
				}
			} else {
				r = sessionLock(t, b, "layer", node)
				ga.open()
				<-ended
			}
			rec, _, ok := sessionOf(t, cli, a, node)
			h, sl := holdOf(t, cli, a, lock.Key{Type: lock.Pull, Resource: "layer"})
			if !ok || h != node || sl != rec.Lease || rec.Home != 0 || !leaseExists(t, cli, sl) {
				t.Fatalf("after the race: session %+v (exists %v), hold %q under %x: want the hold under the session's own, granted lease", rec, ok, h, sl)
			}
			// No stream anywhere: the session ends within a grace, the
			// hold with it.
			kit.WaitFor(t, "the session with no stream to end", func() bool {
				_, _, ok := sessionOf(t, cli, a, node)
				return !ok
			})
			kit.WaitFor(t, "its hold to be released", func() bool {
				h, _ := holdOf(t, cli, a, lock.Key{Type: lock.Pull, Resource: "layer"})
				return h == ""
			})
		})
	}
}

// TestAttackHomeStreamReturnsDuringEnd: a stream of the node opens on its
// home server just after the session's end began (endHomed forgot it, its
// delete on its way): the stream opens on the record that is about to go.
// It must not outlive it: once the record is gone, the stream ends (its node
// reconnects and learns Missed), and a new stream makes a session that
// stands.
func TestAttackHomeStreamReturnsDuringEnd(t *testing.T) {
	bs, cli := homeCluster(t, 1, 2*time.Second)
	a := bs[0]
	const node = "returning"
	ls := graceLocal(t, a, node)
	ga := holdNextRequest(t, a)
	ended := make(chan struct{})
	go func() { defer close(ended); a.s.endHomed(node, ls) }()
	ga.wait(t)
	s, _, err := a.Subscribe(t.Context(), lock.SubscribeRequest{Node: node})
	if err != nil {
		t.Fatalf("the stream that came back: %v", err)
	}
	defer s.Close()
	ga.open()
	<-ended
	_, _, stands := sessionOf(t, cli, a, node)
	t.Logf("after the end: the session stands %v", stands)
	if stands {
		// The end was refused: the stream keeps the session.
		if streamDone(s) {
			t.Fatal("the session stands, its stream ended")
		}
		return
	}
	select {
	case <-s.Done():
	case <-time.After(kit.Patience):
		t.Fatal("the stream outlives its session's record")
	}
	kit.WaitFor(t, "A to forget the ended session", func() bool {
		_, ok := localOf(a, node)
		return !ok
	})
	s2 := subscribe(t, a, node)
	defer s2.Close()
	rec, _, ok := sessionOf(t, cli, a, node)
	if !ok || rec.Lease == ls.lease {
		t.Fatalf("the new stream's session: %+v (exists %v)", rec, ok)
	}
}

// TestAttackHomeRevokedDuringPromotion: A's home lease ends (revoked here,
// as etcd lets it run out) while B promotes a session on it, for a stream
// and for a session-leased lock, the grant made and the put held. B must
// end up with a session that exists: a stream of a session that is gone, or
// a hold under one, would be a phantom.
func TestAttackHomeRevokedDuringPromotion(t *testing.T) {
	for _, viaLock := range []bool{false, true} {
		t.Run(fmt.Sprint("viaLock=", viaLock), func(t *testing.T) {
			bs, cli := homeCluster(t, 2, 2*time.Second)
			a, b := bs[0], bs[1]
			const node = "orphaned"
			sa := subscribe(t, a, node)
			defer sa.Close()
			rec, _, _ := sessionOf(t, cli, a, node)
			caughtUp(t, b, a)
			gb := holdNextRequest(t, b)
			type result struct {
				s   lock.Stream
				r   lock.LockResult
				err error
			}
			done := make(chan result, 1)
			go func() {
				if viaLock {
					r, err := b.TryLock(t.Context(), lock.LockRequest{Type: lock.Pull, Resource: "layer", Node: node, Lease: lock.LeaseSession})
					done <- result{r: r, err: err}
					return
				}
				s, _, err := b.Subscribe(t.Context(), lock.SubscribeRequest{Node: node})
				done <- result{s: s, err: err}
			}()
			gb.wait(t)
			// A lock promotes the session (its lease granted before the
			// put); a stream moves it onto B's home lease, granting
			// nothing.
			if granted := leaseExists(t, cli, rec.Lease); granted != viaLock {
				t.Fatalf("held before its put, B's %s has granted %x: %v", map[bool]string{true: "promotion", false: "move"}[viaLock], rec.Lease, granted)
			}
			if _, err := cli.Revoke(t.Context(), clientv3.LeaseID(rec.Home)); err != nil {
				t.Fatal(err)
			}
			gb.open()
			res := <-done
			if res.err != nil {
				t.Logf("the promotion answered %v", res.err)
				return
			}
			if res.s != nil {
				defer res.s.Close()
			}
			caughtUp(t, b, a, b)
			cur, _, ok := sessionOf(t, cli, b, node)
			if viaLock {
				h, sl := holdOf(t, cli, b, lock.Key{Type: lock.Pull, Resource: "layer"})
				if !res.r.Acquired || h != node || !ok || sl != cur.Lease || cur.Lease == rec.Lease {
					t.Fatalf("the lock %+v: hold %q under %x, session %+v (exists %v): want a hold under a new session", res.r, h, sl, cur, ok)
				}
			} else {
				l, _ := localOf(b, node)
				if !ok || l.lease != cur.Lease || cur.Lease == rec.Lease || streamDone(res.s) {
					t.Fatalf("B's stream (done %v) counts %+v, the session is %+v (exists %v): want a new session", streamDone(res.s), l, cur, ok)
				}
			}
			select {
			case <-sa.Done():
			case <-time.After(kit.Patience):
				t.Fatal("A's stream outlives the session its home lease took")
			}
		})
	}
}

// TestAttackHomeCloseWithEndsPending: a server closes with sessions in
// their grace (ends waiting), sessions with streams, and one session with
// streams here and on another server. Nothing fires after Close; the
// sessions that lived only here end with the home lease a grace later;
// the one with a stream elsewhere stands, kept there, and ends a grace
// after that stream closes.
func TestAttackHomeCloseWithEndsPending(t *testing.T) {
	bs, cli := homeCluster(t, 2, 2*time.Second)
	a, b := bs[0], bs[1]
	var names []string
	for i := range 10 {
		n := fmt.Sprint("grace-", i)
		names = append(names, n)
		s := subscribe(t, a, n)
		s.Close()
	}
	var streams []lock.Stream
	for i := range 5 {
		n := fmt.Sprint("open-", i)
		names = append(names, n)
		streams = append(streams, subscribe(t, a, n))
	}
	both := subscribe(t, a, "both")
	caughtUp(t, b, a)
	sb := subscribe(t, b, "both")
	kit.WaitFor(t, "A to keep the promoted lease", func() bool {
		l, _ := localOf(a, "both")
		return l.home == 0
	})
	a.Close()
	a.s.mu.Lock()
	left := len(a.s.local)
	a.s.mu.Unlock()
	if left != 0 {
		t.Errorf("A keeps %d sessions after Close", left)
	}
	for _, n := range names {
		kit.WaitFor(t, n+"'s session to end with A's home lease", func() bool {
			_, _, ok := sessionOf(t, cli, b, n)
			return !ok
		})
	}
	for _, s := range streams {
		s.Close()
	}
	both.Close()
	rec, _, ok := sessionOf(t, cli, b, "both")
	if !ok || rec.Home != 0 || streamDone(sb) {
		t.Fatalf("the session with a stream on B: %+v (exists %v), stream done %v", rec, ok, streamDone(sb))
	}
	sb.Close()
	kit.WaitFor(t, "the session to end a grace after its last stream", func() bool {
		_, _, ok := sessionOf(t, cli, b, "both")
		return !ok
	})
}

// TestAttackHomeGracePromotedEnds: a session in its grace on A (no stream
// anywhere) gets a session-leased hold through A or through B, which gives
// it its own lease: with no stream to keep it, the session still ends (a
// grace after the grant), the hold released with it; no phantom.
func TestAttackHomeGracePromotedEnds(t *testing.T) {
	for _, via := range []int{0, 1} {
		t.Run(fmt.Sprint("via=", via), func(t *testing.T) {
			bs, cli := homeCluster(t, 2, 2*time.Second)
			a := bs[0]
			const node = "idle"
			s := subscribe(t, a, node)
			s.Close()
			caughtUp(t, bs[via], a)
			sessionLock(t, bs[via], "layer", node)
			if rec, _, ok := sessionOf(t, cli, a, node); !ok || rec.Home != 0 {
				t.Fatalf("after the lock: %+v (exists %v)", rec, ok)
			}
			kit.WaitFor(t, "the session with no stream to end", func() bool {
				_, _, ok := sessionOf(t, cli, a, node)
				return !ok
			})
			kit.WaitFor(t, "its hold to be released", func() bool {
				h, _ := holdOf(t, cli, a, lock.Key{Type: lock.Pull, Resource: "layer"})
				return h == ""
			})
			for i, b := range bs {
				if l, ok := localOf(b, node); ok {
					t.Errorf("server %d still keeps %+v", i, l)
				}
			}
		})
	}
}
