package etcd

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/lock"
)

// sessions keeps alive, from this server, the etcd leases of the sessions
// whose streams are here. Any server holding one of a node's streams keeps
// its lease alive; when none does, etcd ends it one TTL after the last
// keepalive: the grace (docs/DESIGN.md, "An etcd backend").
type sessions struct {
	b      *Backend
	making chan struct{} // a token per session being made (make)
	more   chan struct{} // the same, beyond maxMaking, taken only without pressure
	mu     sync.Mutex    // never held across a call to etcd: the keeper's answers wait for nothing
	local  map[string]*localSession

	revMu      sync.Mutex
	revNext    *revRead // the read the next calls of currentRev wait for
	revReading bool     // readRevs runs

	homeMu  sync.Mutex    // held across the grant of a home lease
	home    int64         // this server's home lease (homeLease), under mu
	homeTTL time.Duration // its TTL as etcd granted it

	// seenHook, when set, runs in acquire after it read the watch's view
	// of the session (tests: what may happen before it counts).
	seenHook atomic.Pointer[func()]

	claimMu sync.Mutex       // held across the grant of a claim lease: one at a time
	claim   clientv3.LeaseID // the lease of this server's claims, granted at claimAt
	claimAt time.Time
}

type localSession struct {
	lease   int64
	home    int64 // the home lease it lives on, 0 when it has its own
	streams int
	end     *time.Timer // set while it has no stream here (endHomed)
	// adopting: a promotion of it runs here (adopt), after another
	// server moved it onto its home lease while it had a stream here.
	adopting bool
}

func (ls *localSession) stopEnd() {
	if ls.end != nil {
		ls.end.Stop()
		ls.end = nil
	}
}

func newSessions(b *Backend) *sessions {
	return &sessions{b: b, making: make(chan struct{}, maxMaking), more: make(chan struct{}, maxMakingFree-maxMaking), local: map[string]*localSession{}}
}

// Subscribe opens a node's session stream and/or an observer of one key.
func (b *Backend) Subscribe(ctx context.Context, req lock.SubscribeRequest) (lock.Stream, lock.Subscription, error) {
	if req.Node == "" && req.Observe == nil {
		return nil, lock.Subscription{}, fmt.Errorf("%w: a stream needs a node_id, a key to observe, or both", lock.ErrInvalid)
	}
	if req.Node != "" {
		if err := lock.ValidateNode(req.Node); err != nil {
			return nil, lock.Subscription{}, err
		}
	}
	if o := req.Observe; o != nil {
		if err := lock.ValidateKey(o.Type, o.Resource, "-"); err != nil {
			return nil, lock.Subscription{}, err
		}
	}
	if err := b.alive(); err != nil {
		return nil, lock.Subscription{}, err
	}
	w := b.w
	if req.Observe != nil && b.cfg.MaxWatchers > 0 {
		w.mu.Lock()
		n := w.nWatchers
		w.mu.Unlock()
		if n >= b.cfg.MaxWatchers {
			b.refusedWatchers.Add(1)
			return nil, lock.Subscription{}, fmt.Errorf("%w: %d observers, at most %d are allowed", lock.ErrTooManyWatchers, n, b.cfg.MaxWatchers)
		}
	}
	// Every wait on etcd below is bounded, and ends at Close.
	parent := ctx
	ctx, cancel := b.bound(ctx)
	defer cancel()
	f := newFeed(b, req.Node, req.Observe)
	var lease int64
	if req.Node != "" {
		var rev int64
		var asked bool
		var err error
		if lease, rev, asked, err = b.s.acquire(ctx, req.Node); err != nil {
			return nil, lock.Subscription{}, b.boundErr(parent, ctx, err)
		}
		f.lease = lease
		// The stream joins at etcd's revision when it opened, or later:
		// every change before it is in the replay (the session's log),
		// none is told as if it came after. A revision etcd answered
		// this call (the session's transaction) is one; the watch's is
		// not, and etcd is asked for its own.
		if !asked {
			cur, err := b.s.currentRev(ctx)
			if err != nil {
				b.s.releaseNode(req.Node, lease)
				return nil, lock.Subscription{}, b.boundErr(parent, ctx, err)
			}
			rev = max(rev, cur)
		}
		// The watch must have seen the session before the stream joins,
		// so that the session's log is the one the stream replays.
		if !w.caughtUp(rev, 10*time.Second) {
			b.s.releaseNode(req.Node, lease)
			if err := b.alive(); err != nil {
				return nil, lock.Subscription{}, err
			}
			return nil, lock.Subscription{}, fmt.Errorf("%w: the watch of the lock state is behind", lock.ErrUnavailable)
		}
	}
	// A last event id from another server that is ahead of this one: wait
	// until this server has seen it too.
	last := normID(req.LastID)
	if req.HasLast {
		if rev := idRev(last); rev > 0 {
			w.mu.Lock()
			seen := w.processed >= rev
			w.mu.Unlock()
			if !seen {
				if cur, err := b.s.currentRev(ctx); err == nil && rev <= cur {
					w.caughtUp(rev, 5*time.Second)
				}
			}
		}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if err := b.alive(); err != nil {
		if req.Node != "" {
			b.s.releaseNode(req.Node, lease)
		}
		return nil, lock.Subscription{}, err
	}
	// Checked again where the count grows: observers that passed the
	// check above together must not all open.
	if req.Observe != nil && b.cfg.MaxWatchers > 0 && w.nWatchers >= b.cfg.MaxWatchers {
		if req.Node != "" {
			b.s.releaseNode(req.Node, lease)
		}
		b.refusedWatchers.Add(1)
		return nil, lock.Subscription{}, fmt.Errorf("%w: %d observers, at most %d are allowed", lock.ErrTooManyWatchers, w.nWatchers, b.cfg.MaxWatchers)
	}
	counter := revID(w.processed+1) - 1
	sub := lock.Subscription{ID: counter}
	if req.Node != "" {
		s := w.sessions[req.Node]
		if s == nil || s.lease != lease {
			b.s.releaseNode(req.Node, lease)
			return nil, lock.Subscription{}, fmt.Errorf("%w: the session of %s ended while its stream opened", lock.ErrUnavailable, req.Node)
		}
		if req.HasLast && last <= counter {
			if last >= s.dropped {
				sub.ID = last
				sub.Replay = s.log.After(req.Node, last)
			} else {
				sub.ID, sub.Missed = s.dropped, true
				sub.Replay = s.log.After(req.Node, 0)
				b.replays.Add(1)
			}
		}
		w.streams[req.Node] = append(w.streams[req.Node][:len(w.streams[req.Node]):len(w.streams[req.Node])], f)
		b.ops.streamsChanged(req.Node, len(w.streams[req.Node]))
	}
	if o := req.Observe; o != nil {
		l := w.observers[*o]
		w.observers[*o] = append(l[:len(l):len(l)], f)
		w.nWatchers++
	}
	return f, sub, nil
}

// currentRev returns a revision of etcd's at least as new as its current
// one when called. The calls that come while a read is on its way share
// the next one: thousands of streams that open together (a fleet moving
// from a server that died) read a handful of times, not once each.
func (s *sessions) currentRev(ctx context.Context) (int64, error) {
	s.revMu.Lock()
	if s.revNext == nil {
		s.revNext = &revRead{done: make(chan struct{})}
	}
	r := s.revNext
	if !s.revReading {
		if s.b.ctx.Err() != nil {
			s.revMu.Unlock()
			return 0, lock.ErrClosed
		}
		s.revReading = true
		s.b.wg.Add(1)
		go s.readRevs()
	}
	s.revMu.Unlock()
	select {
	case <-r.done:
		return r.rev, r.err
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// revRead is one read of etcd's revision, for the calls that wait on it.
type revRead struct {
	done chan struct{}
	rev  int64
	err  error
}

// readRevs reads etcd's revision for the calls waiting, again while more
// came meanwhile.
func (s *sessions) readRevs() {
	defer s.b.wg.Done()
	b := s.b
	for {
		s.revMu.Lock()
		r := s.revNext
		s.revNext = nil
		if r == nil {
			s.revReading = false
			s.revMu.Unlock()
			return
		}
		s.revMu.Unlock()
		ctx, cancel := context.WithTimeout(b.ctx, callTimeout)
		resp, err := b.cli.Get(ctx, b.n.epoch())
		cancel()
		if err != nil {
			r.err = b.etcdErr("reading the revision", err)
		} else {
			r.rev = resp.Header.Revision
		}
		close(r.done)
	}
}

// acquire counts one more stream of node on this server, finding or making
// its session and keeping it alive. It returns the session's lease and a
// revision at which the session exists; asked says that etcd answered
// that revision during this call (the session's transaction), so that no
// revision etcd had when the call began is newer.
func (s *sessions) acquire(ctx context.Context, node string) (lease, rev int64, asked bool, err error) {
	b := s.b
	s.mu.Lock()
	if ls := s.local[node]; ls != nil && b.cfg.MaxSessionsPerNode > 0 && ls.streams >= b.cfg.MaxSessionsPerNode {
		s.mu.Unlock()
		b.refusedNodeStreams.Add(1)
		return 0, 0, false, fmt.Errorf("%w: %s has %d streams, at most %d are allowed", lock.ErrTooManySessions, node, ls.streams, b.cfg.MaxSessionsPerNode)
	}
	s.mu.Unlock()
	// The session as the watch saw it: no read of etcd (count).
	seen, modRev, rev := b.w.session(node)
	if f := s.seenHook.Load(); f != nil {
		(*f)()
	}
	for range maxJoins {
		if seen.Lease == 0 {
			var made bool
			var r int64
			seen, modRev, r, made, err = s.make(ctx, node)
			if err != nil {
				return 0, 0, false, err
			}
			rev, asked = max(rev, r), true
			if made {
				return seen.Lease, rev, true, nil
			}
		}
		switch {
		case seen.Home == 0:
			return seen.Lease, rev, asked, s.count(node, seen.Lease, 0, time.Time{}, time.Time{})
		case seen.Home == s.homeID():
			return seen.Lease, rev, asked, s.countHomed(node, seen, modRev)
		}
		// The session lives on another server's home lease, which ends
		// with that server: the node moved here (its server died, or
		// its stream broke), and the session moves onto this server's
		// home lease. Were the node's stream on that server still, that
		// server gives the session its own lease when its watch sees the
		// move (rehomed).
		var ok bool
		var r int64
		seen, modRev, r, ok, err = s.rehome(ctx, node, seen, modRev)
		if err != nil {
			return 0, 0, false, err
		}
		rev, asked = max(rev, r), true
		if ok {
			return seen.Lease, rev, asked, s.countHomed(node, seen, modRev)
		}
	}
	return 0, 0, false, fmt.Errorf("%w: the session of %s changed %d times while its stream opened", lock.ErrUnavailable, node, maxJoins)
}

// maxJoins bounds the tries of acquire, each after the session changed.
const maxJoins = 4

// make makes node's session, or reads the one that exists, in one
// transaction; made says which. A session made here lives on this
// server's home lease (homeLease) and counts a stream of node: a fleet
// opening its sessions grants no lease and keeps none alive but one per
// server (docs/DESIGN.md, "Home leases"). Sessions are made as admit lets
// them: a fleet opening together would queue thousands of writes
// before etcd, whose apply then lags its commits by seconds; etcd 3.4
// holds every keepalive until the writes committed before it are applied,
// and the sessions already open would lose their leases to the ones
// opening (docs/BENCHMARKS.md, "Fleet scale on etcd").
func (s *sessions) make(ctx context.Context, node string) (rec sessRec, modRev, rev int64, made bool, err error) {
	b := s.b
	done, err := s.admit(ctx)
	if err != nil {
		return sessRec{}, 0, 0, false, err
	}
	defer done()
	if err := b.roomForSession(); err != nil {
		return sessRec{}, 0, 0, false, err
	}
	key := b.n.session(node)
	rec, modRev, rev, made, err = s.putHomed(ctx, key, clientv3.Compare(clientv3.CreateRevision(key), "=", 0), newSessionID(), "making a session")
	switch {
	case err != nil:
		return sessRec{}, 0, 0, false, err
	case !made && rec.Lease == 0:
		return sessRec{}, 0, 0, false, fmt.Errorf("etcd backend: the session of %s vanished while read", node)
	case !made:
		return rec, modRev, rev, false, nil
	}
	if err := s.countHomed(node, rec, rev); err != nil {
		return sessRec{}, 0, 0, false, err
	}
	return rec, rev, rev, true, nil
}

// putHomed puts node's session record (key), with id, on this server's
// home lease if guard holds, for make and rehome. ok says it was put:
// rec is then the record and modRev the request's revision rev; otherwise
// rec is the record that stands, at modRev (none when there is none). The
// sessions made and moved together share a request (group.go), and their
// home lease: were it gone, etcd refuses them all, nothing is written, and
// each is sent again alone on a new one.
func (s *sessions) putHomed(ctx context.Context, key string, guard clientv3.Cmp, id int64, what string) (rec sessRec, modRev, rev int64, ok bool, err error) {
	b := s.b
	for try := 0; ; try++ {
		home, err := s.homeLease(ctx)
		if err != nil {
			return sessRec{}, 0, 0, false, err
		}
		rec = sessRec{Lease: id, Home: home}
		rev, tr, err := b.g.txnHomed(ctx, []clientv3.Cmp{guard}, key, encodeSess(rec), home, []clientv3.Op{clientv3.OpGet(key)})
		if errors.Is(err, rpctypes.ErrLeaseNotFound) {
			// The home lease ran out (etcd did not hear from this
			// server for a grace, or is a TTL behind).
			s.homeLost(home)
			if try == 0 {
				continue
			}
			return sessRec{}, 0, 0, false, fmt.Errorf("%w: %s: this server's home lease ran out before etcd wrote its record", lock.ErrUnavailable, what)
		}
		if err != nil {
			return sessRec{}, 0, 0, false, fmt.Errorf("%s: %w", what, err)
		}
		if tr.Succeeded {
			b.committed(rev)
			return rec, rev, rev, true, nil
		}
		rec, modRev, err = standing(tr.Responses[0].GetResponseRange().GetKvs())
		return rec, modRev, rev, false, err
	}
}

// standing decodes the session record etcd answered (kvs, one key at
// most) and its mod revision: zero when there is none.
func standing(kvs []*mvccpb.KeyValue) (sessRec, int64, error) {
	if len(kvs) == 0 {
		return sessRec{}, 0, nil
	}
	rec, err := decodeSess(kvs[0].Value)
	if err != nil {
		return sessRec{}, 0, err
	}
	return rec, kvs[0].ModRevision, nil
}

// admit waits for a place among the sessions being made or given their own
// lease here (make, promote), and returns its release. Without pressure,
// up to maxMakingFree at once: more of them share etcd's requests and
// fsyncs, and the keepalives say when etcd is behind; with it, maxMaking,
// and none while it is held: the sessions that stand come first, and while
// their keepalives wait on etcd no session is made or moved (a fleet
// opening together, or moving from a server that died, then goes as fast
// as etcd keeps up, and none loses its lease to the others).
func (s *sessions) admit(ctx context.Context) (func(), error) {
	var more chan struct{}
	if p, _ := s.b.g.pressure(time.Now()); p == pressureNone {
		more = s.more
	}
	var done func()
	select {
	case s.making <- struct{}{}:
		done = func() { <-s.making }
	case more <- struct{}{}:
		done = func() { <-more }
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	for {
		if p, _ := s.b.g.pressure(time.Now()); p != pressureHeld {
			return done, nil
		}
		select {
		case <-ctx.Done():
			done()
			return nil, ctx.Err()
		case <-time.After(pressurePoll):
		}
	}
}

// maxMaking bounds the sessions a server makes or moves at once (admit)
// while its keepalives wait on etcd, maxMakingFree while they do not.
const (
	maxMaking     = 16
	maxMakingFree = 64
)

// newSessionID reserves a session's lease id: random, positive, not 0.
// etcd grants it, on promote, as asked; an id etcd has for another lease
// already (one chance in 2^63 per lease there) would make the session
// live as long as that lease.
func newSessionID() int64 {
	var raw [8]byte
	for {
		_, _ = rand.Read(raw[:])
		if id := int64(binary.BigEndian.Uint64(raw[:]) &^ (1 << 63)); id != 0 {
			return id
		}
	}
}

// homeID is this server's home lease, 0 before the first session.
func (s *sessions) homeID() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.home
}

// homeLease returns this server's home lease, granting it at the first
// session made here or after the last one ran out. The keeper keeps it
// alive; it runs out one grace after this server stops, or is cut off,
// and takes the sessions that live on it with it: what a lease per
// session did when nobody kept them.
func (s *sessions) homeLease(ctx context.Context) (int64, error) {
	if h := s.homeID(); h != 0 {
		return h, nil
	}
	s.homeMu.Lock()
	defer s.homeMu.Unlock()
	if h := s.homeID(); h != 0 {
		return h, nil
	}
	sent := time.Now()
	g, err := s.b.cli.Grant(ctx, s.b.graceTTL)
	if err != nil {
		return 0, s.b.etcdErr("granting a home lease", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.b.alive(); err != nil {
		go s.b.revokeLater(int64(g.ID))
		return 0, err
	}
	s.home, s.homeTTL = int64(g.ID), time.Duration(g.TTL)*time.Second
	s.b.keeper.add(s.home, sent, sent.Add(s.homeTTL))
	return s.home, nil
}

// homeLost forgets home, a home lease etcd no longer has.
func (s *sessions) homeLost(home int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.home == home {
		s.home = 0
		s.b.keeper.remove(home)
	}
}

// promote grants the lease node's session reserved (seen, its record at
// modRev living on a home lease) and puts the record under it, if the
// record is still the one seen. A lease etcd has already was granted by
// another server promoting the same session, and the put decides. ok says
// that the session now has its own lease, whoever put it; otherwise cur is
// the record that stands instead (none when the session ended). A lease
// granted here is never revoked: another server may have put the record
// under it after its own grant was refused; unused, it runs out in a
// grace. Promotions wait for admit as sessions made do: a fleet moving from
// a server that died is thousands at once.
func (s *sessions) promote(ctx context.Context, node string, seen sessRec, modRev int64) (cur sessRec, curRev, rev int64, until time.Time, ok bool, err error) {
	b := s.b
	done, err := s.admit(ctx)
	if err != nil {
		return sessRec{}, 0, 0, time.Time{}, false, err
	}
	defer done()
	until, err = b.grantID(ctx, seen.Lease)
	if err != nil {
		return sessRec{}, 0, 0, time.Time{}, false, err
	}
	key := b.n.session(node)
	own := sessRec{Lease: seen.Lease}
	rev, tr, err := b.g.txnLeased(ctx, []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(key), "=", modRev)},
		key, encodeSess(own), own.Lease, []clientv3.Op{clientv3.OpGet(key)})
	if errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return sessRec{}, 0, 0, time.Time{}, false, fmt.Errorf("%w: promoting a session: its lease ran out before etcd wrote its record", lock.ErrUnavailable)
	}
	if err != nil {
		return sessRec{}, 0, 0, time.Time{}, false, fmt.Errorf("promoting a session: %w", err)
	}
	if tr.Succeeded {
		b.committed(rev)
		b.promotions.Add(1)
		return own, rev, rev, until, true, nil
	}
	// None stands when it ended: the caller makes a new one.
	cur, curRev, err = standing(tr.Responses[0].GetResponseRange().GetKvs())
	if err != nil {
		return sessRec{}, 0, 0, time.Time{}, false, err
	}
	return cur, curRev, rev, until, cur == own, nil
}

// rehome moves node's session (seen, its record at modRev on another
// server's home lease) onto this server's home lease, if the record is
// still the one seen: one transaction, shared with the sessions made and
// moved at the moment, and no grant: a fleet moving from a server that
// died moves as fast as it opens (docs/DESIGN.md, "Home leases"). ok says
// that the session lives here now; otherwise cur is the record that
// stands instead (none when the session ended).
func (s *sessions) rehome(ctx context.Context, node string, seen sessRec, modRev int64) (cur sessRec, curRev, rev int64, ok bool, err error) {
	done, err := s.admit(ctx)
	if err != nil {
		return sessRec{}, 0, 0, false, err
	}
	defer done()
	key := s.b.n.session(node)
	cur, curRev, rev, ok, err = s.putHomed(ctx, key, clientv3.Compare(clientv3.ModRevision(key), "=", modRev), seen.Lease, "moving a session")
	if ok {
		s.b.rehomes.Add(1)
	}
	return cur, curRev, rev, ok, err
}

// grantID grants the session lease id, reserved by a session that lives on
// a home lease, and returns until when it stands at least. One etcd has
// already is another server's grant of it, for the same session, made any
// time since: it is kept alive once at once, so that it stands a whole TTL
// from now, as a grant of its own would.
func (b *Backend) grantID(ctx context.Context, id int64) (until time.Time, err error) {
	for range 2 {
		sent := time.Now()
		g, err := b.leases.LeaseGrant(ctx, &pb.LeaseGrantRequest{TTL: b.graceTTL, ID: id})
		if err == nil {
			return sent.Add(time.Duration(g.TTL) * time.Second), nil
		}
		if err = rpctypes.Error(err); !errors.Is(err, rpctypes.ErrLeaseExist) {
			return time.Time{}, b.etcdErr("granting a session lease", err)
		}
		sent = time.Now()
		ka, err := b.cli.KeepAliveOnce(ctx, clientv3.LeaseID(id))
		if err == nil {
			return sent.Add(time.Duration(ka.TTL) * time.Second), nil
		}
		if !errors.Is(err, rpctypes.ErrLeaseNotFound) {
			return time.Time{}, b.etcdErr("keeping a session lease alive", err)
		}
		// It ran out in between: granted again.
	}
	return time.Time{}, fmt.Errorf("%w: granting a session lease: it ran out while another server granted it", lock.ErrUnavailable)
}

// count counts a stream of node's session with lease, a session that
// exists (the watch saw it, or etcd answered it). A session that lives on
// this server's home lease (home) needs no keepalive of its own; one that
// has its own lease is kept alive from here: a lease this server keeps
// already just counts one more, another is kept from now on, shown alive
// by a keepalive or grant sent at sent that makes it stand until until
// (zero when not known: the keeper asks etcd at once, and whether etcd
// still has the lease is not waited for: a lease that ran out ends its
// session, which the watch sees and ends the stream with). A fleet moving
// from a server that died opens thousands of streams at once: a
// KeepAliveOnce each, a stream of etcd's each, did not get through within
// their grace.
func (s *sessions) count(node string, lease, home int64, sent, until time.Time) error {
	b := s.b
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := b.alive(); err != nil {
		return err
	}
	if ls := s.local[node]; ls != nil && ls.lease == lease {
		// Checked again here, where the count grows: streams that
		// passed acquire's check together must not all open.
		if b.cfg.MaxSessionsPerNode > 0 && ls.streams >= b.cfg.MaxSessionsPerNode {
			b.refusedNodeStreams.Add(1)
			return fmt.Errorf("%w: %s has %d streams, at most %d are allowed", lock.ErrTooManySessions, node, ls.streams, b.cfg.MaxSessionsPerNode)
		}
		ls.streams++
		ls.stopEnd()
		// A session's own lease, once granted, stays: a home seen
		// after it is an older record.
		if home == 0 && (ls.home != 0 || !until.IsZero()) {
			ls.home = 0
			b.keeper.add(lease, sent, until)
		}
		return nil
	}
	if old := s.local[node]; old != nil {
		s.dropLocked(node, old) // a session that ended and began anew
	}
	if home == 0 {
		b.keeper.add(lease, sent, until)
	}
	s.local[node] = &localSession{lease: lease, home: home, streams: 1}
	return nil
}

// countHomed counts a stream of node's session rec, which lives on this
// server's home lease as far as the caller saw (its record at modRev).
// Another server may have given it its own lease since, or moved it onto
// its own home lease, and this server's watch may have applied that and
// told these sessions (promoted, rehomed) before this count, which would
// then keep nothing alive or wait for a home lease the session no longer
// lives on: the watch's view after the count says. The watch updates its
// view before it tells, so a change is either seen here or told after the
// count.
func (s *sessions) countHomed(node string, rec sessRec, modRev int64) error {
	if err := s.count(node, rec.Lease, rec.Home, time.Time{}, time.Time{}); err != nil {
		return err
	}
	if now, nowRev, _ := s.b.w.session(node); now.Lease == rec.Lease && nowRev > modRev && now.Home != rec.Home {
		s.moved(node, now, nowRev)
	}
	return nil
}

// homed returns the lease of node's session when it lives on this server's
// home lease and has a stream here, 0 otherwise.
func (s *sessions) homed(node string) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ls := s.local[node]; ls != nil && ls.home != 0 {
		return ls.lease
	}
	return 0
}

// dropLocked forgets node's local session ls; s.mu held.
func (s *sessions) dropLocked(node string, ls *localSession) {
	ls.stopEnd()
	if ls.home == 0 {
		s.b.keeper.remove(ls.lease)
	}
	delete(s.local, node)
}

// release counts one stream of f's node less, once per stream.
func (s *sessions) release(f *feed) {
	if f.node == "" {
		return
	}
	if f.released.CompareAndSwap(false, true) {
		s.releaseNode(f.node, f.lease)
	}
}

// releaseNode counts one stream of node's session with lease less. A
// stream of a session that ended counts for none: the node's new session,
// made here since, keeps its own count. A session that has its own lease
// runs out one grace after its last keepalive, unless another server
// keeps it; one on this server's home lease is ended a grace from now by
// endHomed, unless a stream of it comes back first.
func (s *sessions) releaseNode(node string, lease int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ls := s.local[node]
	if ls == nil || ls.lease != lease {
		return
	}
	if ls.streams--; ls.streams > 0 {
		return
	}
	if ls.home == 0 || s.b.ctx.Err() != nil {
		s.dropLocked(node, ls)
		return
	}
	ls.streams = 0
	ls.end = time.AfterFunc(max(s.homeTTL, time.Duration(s.b.graceTTL)*time.Second), func() { s.endHomed(node, ls) })
}

// endHomed deletes the record of node's session ls, which lives on this
// server's home lease and has had no stream here for a grace, if it is
// still that record: a session another server took a stream of since has
// its own lease, or lives on that server's home lease, and stands. The
// delete is guarded by the record's mod revision, not its value: a session
// that moved to another server and back is the same value again, put by
// this server for a stream of the node here, and a late delete of the
// first must not end it.
func (s *sessions) endHomed(node string, ls *localSession) {
	b := s.b
	s.mu.Lock()
	if s.local[node] != ls || ls.streams > 0 || ls.home == 0 || b.ctx.Err() != nil {
		s.mu.Unlock()
		return
	}
	delete(s.local, node)
	b.wg.Add(1)
	s.mu.Unlock()
	defer b.wg.Done()
	key := b.n.session(node)
	was := sessRec{Lease: ls.lease, Home: ls.home}
	for {
		ctx, cancel := context.WithTimeout(b.ctx, callTimeout)
		err := s.deleteHomed(ctx, key, node, was)
		cancel()
		if err == nil {
			return
		}
		// etcd is away: tried again while this server stands and the
		// node did not come back. Away for a grace, the home lease
		// runs out and ends the session anyway.
		select {
		case <-b.ctx.Done():
			return
		case <-time.After(time.Second):
		}
		s.mu.Lock()
		back := s.local[node] != nil
		s.mu.Unlock()
		if back {
			return
		}
	}
}

// deleteHomed deletes node's session record at key if it is was, at the
// mod revision the watch saw it at, or, when the watch has no record of
// the node (one that lags), at the revision etcd answers for it.
func (s *sessions) deleteHomed(ctx context.Context, key, node string, was sessRec) error {
	b := s.b
	rec, modRev, _ := b.w.session(node)
	switch {
	case rec == was:
	case rec.Lease != 0:
		return nil // promoted, moved, or a new session: not this one to end
	default:
		resp, err := b.cli.Get(ctx, key)
		if err != nil {
			return err
		}
		cur, curRev, err := standing(resp.Kvs)
		if err != nil || cur != was {
			return nil
		}
		modRev = curRev
	}
	_, _, err := b.g.txn(ctx, []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(key), "=", modRev)},
		[]clientv3.Op{clientv3.OpDelete(key)}, nil, false)
	return err
}

// promoted notes that node's session with lease has its own lease now:
// its streams here keep that lease alive, and no longer end it at a grace
// without them.
func (s *sessions) promoted(node string, lease int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ls := s.local[node]
	if ls == nil || ls.lease != lease || ls.home == 0 {
		return
	}
	if ls.streams == 0 {
		ls.stopEnd()
		delete(s.local, node)
		return
	}
	ls.home = 0
	s.b.keeper.add(lease, time.Time{}, time.Time{})
}

// rehomed notes that node's session, which lives on this server's home
// lease as far as these sessions know, was moved onto another server's
// (rec, at modRev): its node opened a stream there. Without a stream here
// the session is that server's now, and is forgotten here; with one, it
// needs a lease of its own, which both servers keep alive, or it would end
// with the other server although this one holds its stream (adopt).
func (s *sessions) rehomed(node string, rec sessRec, modRev int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ls := s.local[node]
	if ls == nil || ls.lease != rec.Lease || ls.home == 0 || ls.home == rec.Home {
		return
	}
	if ls.streams == 0 {
		ls.stopEnd()
		delete(s.local, node)
		return
	}
	if ls.adopting || s.b.ctx.Err() != nil {
		return
	}
	ls.adopting = true
	s.b.wg.Add(1)
	go s.adopt(node, ls, rec, modRev)
}

// adopt gives node's session ls its own lease (promote), as rehomed found
// it needed, and keeps that lease alive from here. It tries again, from
// the record that stands, while ls has a stream here and the session lives
// on another server's home lease: a failed promotion would leave the
// session to end with that server.
func (s *sessions) adopt(node string, ls *localSession, rec sessRec, modRev int64) {
	b := s.b
	defer b.wg.Done()
	defer func() { s.adopted(node, ls, modRev) }()
	for {
		// Not needed when another server promoted it (the watch tells
		// promoted), or it came back onto this server's home lease, or
		// it ended, or its last stream here closed.
		s.mu.Lock()
		needed := s.local[node] == ls && ls.streams > 0 && ls.home != 0 &&
			rec.Lease == ls.lease && rec.Home != 0 && rec.Home != ls.home
		s.mu.Unlock()
		if !needed || b.ctx.Err() != nil {
			return
		}
		ctx, cancel := context.WithTimeout(b.ctx, callTimeout)
		sent := time.Now()
		cur, curRev, _, until, ok, err := s.promote(ctx, node, rec, modRev)
		cancel()
		switch {
		case ok:
			s.mu.Lock()
			if s.local[node] == ls && ls.home != 0 {
				if ls.streams == 0 {
					ls.stopEnd()
					delete(s.local, node)
				} else {
					ls.home = 0
					b.keeper.add(ls.lease, sent, until)
				}
			}
			s.mu.Unlock()
			return
		case err != nil:
			// etcd is away: tried again while the session needs it.
			select {
			case <-b.ctx.Done():
				return
			case <-time.After(time.Second):
			}
			rec, modRev, _ = b.w.session(node)
		default:
			rec, modRev = cur, curRev // changed since: decided again
		}
	}
}

// adopted ends an adopt of node's session ls whose last look at its record
// was at modRev. A move told while it ran (rehomed let it be) is in the
// watch's view, which is updated before it tells: decided again.
func (s *sessions) adopted(node string, ls *localSession, modRev int64) {
	s.mu.Lock()
	ls.adopting = false
	s.mu.Unlock()
	if now, nowRev, _ := s.b.w.session(node); now.Lease == ls.lease && nowRev > modRev {
		s.moved(node, now, nowRev)
	}
}

// moved tells these sessions that node's session record is rec at modRev
// now, on another lease than they knew (the watch, or a look at its view
// after a count or a promotion): its own (promoted), or another server's
// home lease (rehomed).
func (s *sessions) moved(node string, rec sessRec, modRev int64) {
	if rec.Home == 0 {
		s.promoted(node, rec.Lease)
		return
	}
	s.rehomed(node, rec, modRev)
}

// ended forgets node's session with lease, which the watch saw end.
func (s *sessions) ended(node string, lease int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ls := s.local[node]; ls != nil && ls.lease == lease {
		s.dropLocked(node, ls)
	}
}

// closeAll stops every keepalive of this server and every session end it
// waits to make (Close). The leases run out one TTL later unless another
// server keeps them; the home lease with every session on it.
func (s *sessions) closeAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, ls := range s.local {
		ls.stopEnd()
	}
	clear(s.local)
	s.home = 0
	s.b.keeper.removeAll()
}

// sessionEnded ends, once in the cluster, what a lost session leased: its
// queue places, then its holds, handed on as failures with "session lost"
// (docs/DESIGN.md, "Leases"). The server whose claim is made first does it
// and counts the loss; a claim of a server that dies with it is let go
// with the server's own lease, and the orphan sweep finishes the work.
func (b *Backend) sessionEnded(node string, lease int64) {
	if b.ctx.Err() != nil {
		return
	}
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		ctx, cancel := context.WithTimeout(b.ctx, time.Minute)
		defer cancel()
		claim := b.n.lost(node, lease)
		g, err := b.s.claimLease(ctx)
		if err != nil {
			return
		}
		tr, err := b.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(claim), "=", 0)).
			Then(clientv3.OpPut(claim, "", clientv3.WithLease(g))).Commit()
		if err != nil || !tr.Succeeded {
			return
		}
		switch n, err := b.endSession(ctx, node, lease); {
		case err != nil:
			b.sessionsLost.Add(1)
			b.log.Warn("etcd backend: ending a lost session", "node", node, "err", err)
			// Let the orphan sweep take it up, not only when the
			// claim's lease runs out.
			_, _ = b.cli.Delete(ctx, claim)
		case n == 0:
			// A clean end: the node closed its streams holding nothing.
			b.sessionsClosed.Add(1)
			b.log.Debug("session ended", "node", node)
		default:
			b.sessionsLost.Add(1)
			b.log.Info("session lost", "node", node, "keys", n)
		}
	}()
}

// claimLease is the lease of this server's claims on ended sessions
// (sessionEnded): granted once and shared by the claims of the next
// claimReuse, so that the claims outlive their work (a minute at most,
// usually one round trip per key) and go with this server if it dies. A
// grant and a revoke per ended session, on every server that saw it end,
// were three writes more each time a node of a fleet closed its streams.
func (s *sessions) claimLease(ctx context.Context) (clientv3.LeaseID, error) {
	s.claimMu.Lock()
	defer s.claimMu.Unlock()
	if s.claim != 0 && time.Since(s.claimAt) < claimReuse {
		return s.claim, nil
	}
	g, err := s.b.cli.Grant(ctx, int64(claimTTL/time.Second))
	if err != nil {
		return 0, s.b.etcdErr("granting a claim lease", err)
	}
	s.claim, s.claimAt = g.ID, time.Now()
	return g.ID, nil
}

// A claim lease lives claimTTL and takes new claims for claimReuse after
// its grant: each claim stands claimTTL - claimReuse at least.
const (
	claimTTL   = time.Minute
	claimReuse = 20 * time.Second
)

// endSession removes node's waits, then releases its holds, of the session
// with lease, and drops their index entries. It returns how many keys the
// session had a hold or a place on.
func (b *Backend) endSession(ctx context.Context, node string, lease int64) (int, error) {
	var keys []lock.Key
	err := b.w.page(ctx, b.n.nodeIndex(node), 0, func(kv kvLike) {
		if v, err := strconv.ParseInt(string(kv.Value), 16, 64); err != nil || v != lease {
			return
		}
		if _, k, ok := b.n.parseNodeIndex(string(kv.Key)); ok {
			keys = append(keys, k)
		}
	})
	if err != nil {
		return 0, err
	}
	// Waiters first, so that no hold is handed to a waiter that is leaving
	// too.
	for _, holds := range []bool{false, true} {
		for _, k := range keys {
			var expired, handed bool
			_, err := b.run(ctx, k, func(t *tx) error {
				expired, handed = false, false
				if holds {
					if t.rec.Holder != node || t.rec.Lease != uint8(lock.LeaseSession) || t.rec.SLease != lease {
						return nil
					}
					next, err := t.end(false, "session lost", false, true, time.Now())
					expired, handed = true, next != ""
					return err
				}
				wr, ok, err := t.waiting(node)
				if err != nil || !ok || wr.Lease != uint8(lock.LeaseSession) || wr.SLease != lease {
					return err
				}
				t.dequeue(wr.seq, node)
				t.rec.Queue--
				if t.rec.Queue == 0 {
					t.rec.WaitTTL = 0
				}
				t.put(nil)
				return nil
			})
			if err != nil {
				return 0, err
			}
			if expired {
				b.expiries.Add(1)
			}
			if handed {
				b.grants.Add(1)
				b.handoffs.Add(1)
			}
		}
	}
	v := strconv.FormatInt(lease, 16)
	for _, k := range keys {
		key := b.n.nodeKey(node, k)
		if _, err := b.cli.Txn(ctx).If(clientv3.Compare(clientv3.Value(key), "=", v)).Then(clientv3.OpDelete(key)).Commit(); err != nil {
			return 0, b.etcdErr("dropping a session's index", err)
		}
	}
	return len(keys), nil
}

// sweepOrphans ends, every grace or so, the index entries of sessions that
// no longer exist: a session that ended while no server was up, or whose
// ending server died halfway.
func (b *Backend) sweepOrphans() {
	defer b.wg.Done()
	every := max(5*time.Second, time.Duration(b.graceTTL)*time.Second)
	t := time.NewTimer(every)
	defer t.Stop()
	for {
		select {
		case <-b.ctx.Done():
			return
		case <-t.C:
		}
		b.sweepOnce()
		t.Reset(every)
	}
}

func (b *Backend) sweepOnce() {
	ctx, cancel := context.WithTimeout(b.ctx, time.Minute)
	defer cancel()
	type orphan struct {
		node  string
		lease int64
	}
	seen := map[orphan]bool{}
	err := b.w.page(ctx, b.n.nodeIndexes(), 0, func(kv kvLike) {
		node, _, ok := b.n.parseNodeIndex(string(kv.Key))
		v, err := strconv.ParseInt(string(kv.Value), 16, 64)
		if !ok || err != nil {
			return
		}
		seen[orphan{node, v}] = true
	})
	if err != nil {
		return
	}
	for o := range seen {
		resp, err := b.cli.Get(ctx, b.n.session(o.node))
		if err != nil {
			return
		}
		if len(resp.Kvs) > 0 {
			if sr, err := decodeSess(resp.Kvs[0].Value); err == nil && sr.Lease == o.lease {
				continue // alive
			}
		}
		claim := b.n.lost(o.node, o.lease)
		if c, err := b.cli.Get(ctx, claim); err != nil || len(c.Kvs) > 0 {
			continue // a server is at it
		}
		if _, err := b.endSession(ctx, o.node, o.lease); err != nil {
			b.log.Warn("etcd backend: ending an orphaned session", "node", o.node, "err", err)
		}
	}
}
