package etcd_test

// The differential test: the etcd engine against the memory engine, the
// oracle, on the same histories of calls. What a node receives is decided
// by docs/DESIGN.md ("Events", "Event ids and replay", "Sessions and
// events"), not by the engine: a node, its streams broken and resumed with
// Last-Event-ID, must receive on etcd exactly the events it receives in
// memory, and every call must answer the same, on whichever of two etcd
// servers of one data set it is made or a stream resumes (docs/DESIGN.md,
// "What a client does": it moves to another server and resumes there).
// Fencing tokens differ in value between the engines (docs/DESIGN.md,
// "Fencing tokens"; "An etcd backend"), so a key's tokens are named by the
// order in which the test first saw them.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/etcd"
	"github.com/dlock/dlock/lock/memory"
)

// TestDifferential runs seeded random histories against both engines, a
// step at a time, and compares every answer and every event after each
// step.
func TestDifferential(t *testing.T) {
	srv := etcdtest.Shared(t)
	for seed := uint64(1); seed <= 8; seed++ {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			t.Parallel() // each history has its own backends and data set
			runDifferential(t, srv, seed, 70, nil, nil)
		})
	}
}

// TestDifferentialLeftIndexes runs TestDifferential's histories with
// servers whose every success with waiters leaves their queue indexes
// (docs/DESIGN.md, "Queue indexes a success leaves"): swept by none
// (stale indexes pile up under every later call), or swept the moment the
// watch applies the success, racing the calls after it. The answers and
// events must be the memory engine's all the same. The histories are
// longer than TestDifferential's: a stale index matters only to a node
// that calls again on a key whose queue formed anew.
func TestDifferentialLeftIndexes(t *testing.T) {
	runLeftIndexes(t, 1, 16, 200, nil)
}

// runLeftIndexes runs the histories of seeds first to last, steps calls
// long, on servers whose every success with waiters leaves their indexes:
// never swept for an odd seed, swept at once for an even one.
func runLeftIndexes(t *testing.T, first, last uint64, steps int, check func(*diff)) {
	srv := etcdtest.Shared(t)
	for seed := first; seed <= last; seed++ {
		after := time.Duration(0)
		if seed%2 == 1 {
			after = time.Hour
		}
		t.Run(fmt.Sprintf("seed=%d/sweepAfter=%v", seed, after), func(t *testing.T) {
			t.Parallel()
			runDifferential(t, srv, seed, steps, func(b *etcd.Backend) { etcd.LeaveIndexesForTest(b, 0, after) }, check)
		})
	}
}

// runDifferential runs the seeded random history of seed, steps calls
// long; tune, if not nil, is applied to each etcd backend before its first
// call, and check, if not nil, after every step.
func runDifferential(t *testing.T, srv *etcdtest.Server, seed uint64, steps int, tune func(*etcd.Backend), check func(*diff)) {
	rng := rand.New(rand.NewPCG(seed, 0x646c6f636b))
	rules := diffRules()
	// Rules that change what the events are: a node refused
	// instead of queued, hand-offs that need no claim, a replay
	// log so short that a resume misses events.
	rules.AllowMultiNodeDownload = rng.IntN(4) != 0
	if rng.IntN(2) == 0 {
		rules.ClaimTimeout = 0
	}
	rules.SessionLog = []int{1, 1, 2, rules.SessionLog}[rng.IntN(4)]
	nodes := 3 + rng.IntN(3)
	keys := diffKeys(rng)
	d := newDiff(t, srv, seed, rules, nodes, keys, tune)
	for range steps {
		d.begin(d.gen(rng, true))
		if rng.IntN(5) == 0 {
			// Two calls with no wait between them: on etcd the
			// second may come before the watch has applied the
			// first, or before a timer has acted on it; in
			// memory a call's events are out when it returns.
			// Not a break: what a stream had not delivered when
			// it broke depends on when it broke.
			d.begin(d.gen(rng, false))
		}
		d.end()
		if check != nil {
			check(d)
		}
	}
	d.finish()
}

// TestDifferentialResume holds, as named cases, the histories of a bug
// report: a node whose stream broke and was resumed within the grace must
// receive each lock_assigned once, whether the grant was the direct answer
// to its own TryLock (which sends lock_assigned too: docs/DESIGN.md,
// "Events") or a hand-off made while its stream was down, and nothing
// replayed twice; also when it resumes on another etcd server. Both
// engines are run and compared as in TestDifferential, and each must also
// give the events written here.
func TestDifferentialResume(t *testing.T) {
	srv := etcdtest.Shared(t)
	const a, b = 0, 1
	k := lock.Key{Type: lock.Pull, Resource: "a"}
	keys := []lock.Key{k}
	lockOp := func(node int) dop { return dop{kind: opLock, node: node, lease: lock.LeaseSession} }
	unlockOp := func(node int, ok bool) dop {
		return dop{kind: opUnlock, node: node, success: ok, tok: tokCurrent}
	}
	open := func(node int) dop { return dop{kind: opOpen, node: node} }
	brk := func(node int) dop { return dop{kind: opClose, node: node} }
	resume := func(node int) dop { return dop{kind: opResume, node: node} }
	completed := `operation_completed pull:a n1 success=true error="" next=""`
	assigned := `lock_assigned pull:a n2 #2`
	for _, c := range []struct {
		name string
		ops  []dop
		want []string // what b receives, replays marked
	}{{
		// The report: b waits behind a, its stream breaks and is
		// resumed, a succeeds (b is told to skip), b locks again and
		// is granted directly.
		name: "DirectGrantAfterResume",
		ops: []dop{
			open(a), open(b), lockOp(a), lockOp(b), brk(b), resume(b),
			unlockOp(a, true), lockOp(b), brk(b), resume(b), lockOp(b),
			brk(b), resume(b), unlockOp(b, true),
		},
		want: []string{completed, assigned},
	}, {
		// The same with a's success while b's stream is down: the
		// skip is replayed, the grant comes live.
		name: "SkipReplayedThenDirectGrant",
		ops: []dop{
			open(a), open(b), lockOp(a), lockOp(b), brk(b),
			unlockOp(a, true), resume(b), lockOp(b), brk(b), resume(b),
			lockOp(b), unlockOp(b, false),
		},
		want: []string{"replay " + completed, assigned},
	}, {
		// A direct grant while b's stream is down: its lock_assigned is
		// in the session's log, replayed once.
		name: "DirectGrantWhileDown",
		ops: []dop{
			open(a), open(b), lockOp(a), lockOp(b), brk(b),
			unlockOp(a, true), lockOp(b), resume(b), brk(b), resume(b),
			lockOp(b), unlockOp(b, true),
		},
		want: []string{"replay " + completed, "replay " + assigned},
	}, {
		// A failure hands the key to b while its stream is down: the
		// hand-off's lock_assigned is replayed exactly once, b's
		// confirming TryLock sends nothing, and a later resume replays
		// nothing again.
		name: "HandoffWhileDown",
		ops: []dop{
			open(a), open(b), lockOp(a), lockOp(b), brk(b),
			unlockOp(a, false), resume(b), lockOp(b), brk(b), resume(b),
			lockOp(b), unlockOp(b, true),
		},
		want: []string{"replay " + assigned},
	}} {
		// Each case twice: b on a's server throughout, and b resuming,
		// and making its calls, on the other server of the data set.
		for _, elsewhere := range []bool{false, true} {
			name, ops := c.name, slices.Clone(c.ops)
			if elsewhere {
				name += "Elsewhere"
				for i, o := range ops {
					if o.node == b && o.kind != opOpen {
						ops[i].server = 1
					}
				}
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				d := newDiff(t, srv, 0, diffRules(), 3, keys, nil)
				for _, o := range ops {
					d.step(o)
				}
				d.finish()
				for _, s := range d.sides {
					if got := s.got[b]; !slices.Equal(got, c.want) {
						t.Fatalf("%s: n2 received\n\t%s\nwant\n\t%s\nhistory:\n%s", s.name, strings.Join(got, "\n\t"), strings.Join(c.want, "\n\t"), d.history())
					}
				}
			})
		}
	}
}

// TestDifferentialErasedRecord: a pull's success erases the delete's
// completion record (docs/DESIGN.md, "Unlock"), which leaves the delete
// key with nothing: absent, and /status reports no token for it
// ("Status"). The memory engine forgets the key at once; etcd keeps its
// empty record until the key's timer drops it, and a /status made before
// then must already answer as for an absent key. Each round asks at once,
// with no wait after the unlock, so that the timer has seldom acted.
func TestDifferentialErasedRecord(t *testing.T) {
	srv := etcdtest.Shared(t)
	del, pull := 0, 1
	keys := []lock.Key{{Type: lock.Delete, Resource: "a"}, {Type: lock.Pull, Resource: "a"}}
	d := newDiff(t, srv, 0, diffRules(), 2, keys, nil)
	for range 25 {
		d.step(dop{kind: opLock, node: 0, key: del, lease: lock.LeaseTTL})
		d.step(dop{kind: opUnlock, node: 0, key: del, success: true})
		d.step(dop{kind: opLock, node: 1, key: pull, lease: lock.LeaseTTL})
		d.step(dop{kind: opUnlock, node: 1, key: pull, success: true}, dop{kind: opStatus, key: del, anyNode: true})
	}
	d.finish()
}

// diffRules are the rules both engines get: no timer fires within a
// history (leases, the grace, the claim timeout and the records' retention
// far longer than it), so that both see the same sequence of calls and
// nothing else.
func diffRules() lock.Rules {
	r := lock.DefaultRules()
	r.SessionGrace = 10 * time.Minute
	r.LockTTL = 10 * time.Minute
	r.ClaimTimeout = 10 * time.Minute
	r.CompletedRetention = 10 * time.Minute
	return r
}

// diffKeys picks two or three keys, on two resources, so that the types
// of one resource meet (a pull's success erases a delete's record:
// docs/DESIGN.md, "Unlock").
func diffKeys(rng *rand.Rand) []lock.Key {
	var all []lock.Key
	for _, res := range []string{"a", "b"} {
		for _, typ := range []lock.Type{lock.Pull, lock.Update, lock.Delete} {
			all = append(all, lock.Key{Type: typ, Resource: res})
		}
	}
	rng.Shuffle(len(all), func(i, j int) { all[i], all[j] = all[j], all[i] })
	keys := all[:2+rng.IntN(2)]
	slices.SortFunc(keys, func(x, y lock.Key) int { return strings.Compare(x.String(), y.String()) })
	return keys
}

type opKind uint8

const (
	opOpen   opKind = iota // a fresh session stream
	opClose                // the stream breaks
	opResume               // a stream with Last-Event-ID: the last id the broken one received
	opLock
	opUnlock
	opCancel
	opStatus
)

// tokChoice is the token an unlock sends, named by what the test knows of
// the key's grants, so that each engine sends its own value.
type tokChoice uint8

const (
	tokNone    tokChoice = iota
	tokCurrent           // the key's newest token
	tokStale             // an older one
)

// dop is one call of a history. A node has two stream slots, each opened,
// broken and resumed.
type dop struct {
	kind    opKind
	node    int
	slot    int // which of the node's two streams
	key     int
	lease   lock.Lease
	skip    bool
	success bool
	tok     tokChoice
	anyNode bool // opStatus: without a node
	server  int  // the etcd server of two that the call goes to
}

func (o dop) String(keys []lock.Key) string {
	at := ""
	if o.server != 0 {
		at = fmt.Sprintf(" @etcd%d", o.server+1)
	}
	return o.call(keys) + at
}

func (o dop) call(keys []lock.Key) string {
	n := nodeName(o.node)
	k := keys[o.key].String()
	switch o.kind {
	case opOpen:
		return fmt.Sprintf("open %s/%d", n, o.slot)
	case opClose:
		return fmt.Sprintf("break %s/%d", n, o.slot)
	case opResume:
		return fmt.Sprintf("resume %s/%d", n, o.slot)
	case opLock:
		return fmt.Sprintf("lock %s %s lease=%v skip_recent=%v", n, k, o.lease, o.skip)
	case opUnlock:
		return fmt.Sprintf("unlock %s %s success=%v token=%s", n, k, o.success, [...]string{"none", "current", "stale"}[o.tok])
	case opCancel:
		return fmt.Sprintf("cancel %s %s", n, k)
	case opStatus:
		if o.anyNode {
			return "status " + k
		}
		return fmt.Sprintf("status %s %s", k, n)
	}
	return "?"
}

func nodeName(i int) string { return fmt.Sprintf("n%d", i+1) }

// diff runs one history on both engines.
type diff struct {
	t     *testing.T
	seed  uint64
	keys  []lock.Key
	nodes int
	sides [2]*side
	steps []string // the history so far, with what memory answered
	last  *dop     // the last unlock, repeated now and then

	calls []string    // the calls of the step being made
	outs  [2][]string // what each side answered to them
}

func newDiff(t *testing.T, srv *etcdtest.Server, seed uint64, rules lock.Rules, nodes int, keys []lock.Key, tune func(*etcd.Backend)) *diff {
	t.Helper()
	d := &diff{t: t, seed: seed, keys: keys, nodes: nodes}
	mem, err := memory.New(t.Context(), memory.Config{Rules: rules, Shards: 4})
	if err != nil {
		t.Fatal(err)
	}
	// Two servers of one data set, each with its own etcd client, as
	// dlock serve processes have.
	cfg := etcd.Config{Rules: rules, Prefix: etcdtest.Prefix(t)}
	var ets []lock.Backend
	for range 2 {
		et, err := etcd.New(t.Context(), srv.Client(t), cfg)
		if err != nil {
			mem.Close()
			for _, b := range ets {
				b.Close()
			}
			t.Fatal(err)
		}
		if tune != nil {
			tune(et)
		}
		ets = append(ets, et)
	}
	d.sides = [2]*side{newSide(t, "memory", []lock.Backend{mem}, nodes, keys), newSide(t, "etcd", ets, nodes, keys)}
	t.Cleanup(func() {
		for _, s := range d.sides {
			s.close()
		}
	})
	return d
}

// gen picks the next call; a break only if breaks. Which node unlocks
// leans on who holds the key, as the memory engine's observers said: the
// engines answered alike so far, so the history does not depend on which
// one is asked.
func (d *diff) gen(rng *rand.Rand, breaks bool) dop {
	o := dop{node: rng.IntN(d.nodes), key: rng.IntN(len(d.keys)), server: rng.IntN(2)}
	if rng.IntN(4) == 0 {
		o.slot = 1 // a second stream of the node, now and then
	}
	mem := d.sides[0]
	switch p := rng.IntN(100); {
	case p < 30:
		switch sl := mem.slots[o.node][o.slot]; {
		case sl.st != nil && !breaks:
			o.kind = opStatus
		case sl.st != nil:
			o.kind = opClose
		case sl.opened && rng.IntN(4) != 0:
			o.kind = opResume
		default:
			o.kind = opOpen
		}
	case p < 55:
		o.kind = opLock
		o.lease = []lock.Lease{lock.LeaseSession, lock.LeaseSession, lock.LeaseTTL, lock.LeaseAuto}[rng.IntN(4)]
		o.skip = rng.IntN(4) == 0
	case p < 78:
		if d.last != nil && rng.IntN(8) == 0 {
			return *d.last // a repeat, whose answer may be a replay
		}
		o.kind = opUnlock
		if h := mem.holder[d.keys[o.key]]; h >= 0 && rng.IntN(4) != 0 {
			o.node = h
		}
		o.success = rng.IntN(2) == 0
		o.tok = tokChoice(rng.IntN(3))
		if rng.IntN(4) != 0 && o.tok == tokStale {
			o.tok = tokCurrent
		}
	case p < 86:
		o.kind = opCancel
	default:
		o.kind = opStatus
		o.anyNode = rng.IntN(4) == 0
	}
	return o
}

// step makes ops one step: each call on each engine, in turn, with no wait
// between them; then end.
func (d *diff) step(ops ...dop) {
	d.t.Helper()
	for _, o := range ops {
		d.begin(o)
	}
	d.end()
}

// begin makes the call o on each engine, memory first.
func (d *diff) begin(o dop) {
	if o.kind == opUnlock {
		d.last = &o
	}
	for i, s := range d.sides {
		d.outs[i] = append(d.outs[i], s.run(d.keys, o)...)
	}
	d.calls = append(d.calls, o.String(d.keys))
}

// end waits until each engine has delivered every event of the step's
// calls, and compares what each answered and delivered.
func (d *diff) end() {
	d.t.Helper()
	outs := d.outs
	for i, s := range d.sides {
		outs[i] = append(outs[i], s.settle(d.keys)...)
	}
	line := fmt.Sprintf("step %d: %s", len(d.steps)+1, strings.Join(d.calls, ", then "))
	d.calls, d.outs = nil, [2][]string{}
	if !slices.Equal(outs[0], outs[1]) {
		d.t.Fatalf("seed %d: the engines differ at %s\nmemory:\n\t%s\netcd:\n\t%s\nhistory before it (memory's answers):\n%s",
			d.seed, line, strings.Join(outs[0], "\n\t"), strings.Join(outs[1], "\n\t"), d.history())
	}
	d.steps = append(d.steps, line+"\n\t"+strings.Join(outs[0], "\n\t"))
}

// finish waits once more, after the last step, so that an event that
// comes late is seen too, and compares.
func (d *diff) finish() {
	d.t.Helper()
	var outs [2][]string
	for i, s := range d.sides {
		outs[i] = s.settle(d.keys)
	}
	if !slices.Equal(outs[0], outs[1]) {
		d.t.Fatalf("seed %d: the engines differ after the last step\nmemory:\n\t%s\netcd:\n\t%s\nhistory:\n%s",
			d.seed, strings.Join(outs[0], "\n\t"), strings.Join(outs[1], "\n\t"), d.history())
	}
}

func (d *diff) history() string { return strings.Join(d.steps, "\n") }

// side is one engine and what the test saw of it.
type side struct {
	t    *testing.T
	name string
	bs   []lock.Backend // its servers: memory's one, etcd's two

	keyTok map[lock.Key][]uint64 // a key's tokens, in the order the test first saw them
	slots  [][2]*slot            // a node's two streams
	got    [][]string            // every event a node's streams received, replays marked
	obs    []lock.Stream         // an observer of each key
	holder map[lock.Key]int      // as the observers said; -1 for none

	barrier   []lock.Stream // observes barrierKey, on each server
	barrierOn bool          // barrierNode holds barrierKey
	barriers  int
}

// slot is a node's session stream, and the last event id it received.
type slot struct {
	st     lock.Stream
	opened bool
	last   uint64
}

// barrierKey is locked and unlocked, by a node without a session, after
// every step: once its observer on a server has the event of that write,
// every earlier write's events have been delivered there, on etcd because
// each server's watch applies revisions in order (docs/DESIGN.md, "An etcd
// backend").
var barrierKey = lock.Key{Type: lock.Pull, Resource: "barrier"}

const barrierNode = "barrier-node"

func newSide(t *testing.T, name string, bs []lock.Backend, nodes int, keys []lock.Key) *side {
	t.Helper()
	b := bs[0] // the observers' server
	s := &side{t: t, name: name, bs: bs, keyTok: map[lock.Key][]uint64{}, holder: map[lock.Key]int{}}
	for range nodes {
		s.slots = append(s.slots, [2]*slot{{}, {}})
	}
	s.got = make([][]string, nodes)
	for _, k := range keys {
		s.holder[k] = -1
		st, _, err := b.Subscribe(t.Context(), lock.SubscribeRequest{Observe: &k})
		if err != nil {
			t.Fatalf("%s: observing %v: %v", name, k, err)
		}
		s.obs = append(s.obs, st)
	}
	for _, b := range bs {
		st, _, err := b.Subscribe(t.Context(), lock.SubscribeRequest{Observe: &barrierKey})
		if err != nil {
			t.Fatalf("%s: observing the barrier: %v", name, err)
		}
		s.barrier = append(s.barrier, st)
	}
	return s
}

func (s *side) close() {
	for _, sls := range s.slots {
		for _, sl := range sls {
			if sl.st != nil {
				sl.st.Close()
			}
		}
	}
	for _, st := range s.obs {
		st.Close()
	}
	for _, st := range s.barrier {
		st.Close()
	}
	for _, b := range s.bs {
		b.Close()
	}
}

// run makes the call o and returns its answer, normalised.
func (s *side) run(keys []lock.Key, o dop) []string {
	ctx := s.t.Context()
	k := keys[o.key]
	node := nodeName(o.node)
	sl := s.slots[o.node][o.slot]
	b := s.bs[o.server%len(s.bs)]
	var out []string
	switch o.kind {
	case opOpen, opResume:
		if sl.st != nil {
			s.t.Fatalf("%s: %s's stream %d is open already", s.name, node, o.slot)
		}
		req := lock.SubscribeRequest{Node: node}
		if o.kind == opResume {
			req.LastID, req.HasLast = sl.last, true
		}
		st, sub, err := b.Subscribe(ctx, req)
		if err != nil {
			out = append(out, "subscribe: "+errClass(err))
			break
		}
		sl.st, sl.opened = st, true
		a := fmt.Sprintf("subscribe: missed=%v replay=%d", sub.Missed, len(sub.Replay))
		if o.kind == opResume {
			// After a last event id the subscribed id is that id, unless
			// events after it were let go.
			a += fmt.Sprintf(" from-last=%v", sub.ID == sl.last)
		}
		out = append(out, a)
		// A replay comes after the subscribed id (the last event id, or
		// the gap's end), in increasing order.
		prev := sub.ID
		for _, dl := range sub.Replay {
			if dl.ID <= prev {
				out = append(out, fmt.Sprintf("replay id %d not after %d", dl.ID, prev))
			}
			prev = dl.ID
			e := s.event(dl.Event)
			out = append(out, "replay "+e)
			s.got[o.node] = append(s.got[o.node], "replay "+e)
		}
		sl.last = sub.ID
		if n := len(sub.Replay); n > 0 {
			sl.last = sub.Replay[n-1].ID
		}
	case opClose:
		if sl.st == nil {
			s.t.Fatalf("%s: %s's stream %d is not open", s.name, node, o.slot)
		}
		// Anything it had not delivered is lost with it: nothing should
		// be waiting, every step's events were taken after it.
		for _, dl := range sl.st.Take(nil) {
			out = append(out, "undelivered at the break: "+s.event(dl.Event))
		}
		sl.st.Close()
		sl.st = nil
	case opLock:
		r, err := b.TryLock(ctx, lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: node, Lease: o.lease, SkipRecent: o.skip})
		switch {
		case err != nil:
			out = append(out, "lock: "+errClass(err))
		case r.Acquired:
			out = append(out, fmt.Sprintf("lock: acquired %s holder=%s", s.token(k, r.Token), r.Holder))
		case r.Queued:
			out = append(out, fmt.Sprintf("lock: queued position=%d holder=%s", r.Position, r.Holder))
		case r.Skip:
			out = append(out, fmt.Sprintf("lock: skip holder=%q", r.Holder))
		default:
			out = append(out, fmt.Sprintf("lock: neither acquired, queued nor skip: %+v", r))
		}
	case opUnlock:
		var tok uint64
		ts := s.keyTok[k]
		switch o.tok {
		case tokCurrent:
			if len(ts) > 0 {
				tok = ts[len(ts)-1]
			}
		case tokStale:
			switch {
			case len(ts) > 1:
				tok = ts[len(ts)-2]
			case len(ts) == 1:
				tok = ts[0] - 1 // not the key's token: tokens only grow
			}
		}
		errText := ""
		if !o.success {
			errText = "failed at " + node
		}
		r, err := b.Unlock(ctx, lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: node, Success: o.success, Error: errText, Token: tok})
		if err != nil {
			out = append(out, "unlock: "+errClass(err))
		} else {
			out = append(out, fmt.Sprintf("unlock: released next_holder=%q replayed=%v", r.NextHolder, r.Replayed))
		}
	case opCancel:
		r, err := b.Cancel(ctx, k.Type, k.Resource, node)
		if err != nil {
			out = append(out, "cancel: "+errClass(err))
		} else {
			out = append(out, fmt.Sprintf("cancel: dequeued=%v released=%v", r.Dequeued, r.Released))
		}
	case opStatus:
		n := node
		if o.anyNode {
			n = ""
		}
		st, err := b.Status(ctx, k.Type, k.Resource, n)
		if err != nil {
			out = append(out, "status: "+errClass(err))
			break
		}
		a := fmt.Sprintf("status: held=%v holder=%q token=%s queue=%d position=%d", st.Held, st.Holder, s.token(k, st.Token), st.QueueLength, st.Position)
		if c := st.LastCompleted; c != nil {
			a += fmt.Sprintf(" last={%s %s success=%v error=%q}", c.Node, s.token(k, c.Token), c.Success, c.Error)
		}
		out = append(out, a)
	}
	return out
}

// settle waits for the barrier, then takes what every open stream and
// observer received since the last step.
func (s *side) settle(keys []lock.Key) []string {
	s.wait()
	var out []string
	for i, sls := range s.slots {
		for j, sl := range sls {
			if sl.st == nil {
				continue
			}
			name := fmt.Sprintf("%s/%d", nodeName(i), j)
			for _, dl := range sl.st.Take(nil) {
				if dl.ID <= sl.last {
					out = append(out, fmt.Sprintf("%s: id %d not after %d", name, dl.ID, sl.last))
				}
				sl.last = dl.ID
				e := s.event(dl.Event)
				out = append(out, name+": "+e)
				s.got[i] = append(s.got[i], e)
			}
			select {
			case <-sl.st.Done():
				out = append(out, name+": the stream ended")
				sl.st.Close()
				sl.st = nil
			default:
			}
		}
	}
	for i, st := range s.obs {
		for _, dl := range st.Take(nil) {
			out = append(out, "observer "+keys[i].String()+": "+s.event(dl.Event))
			s.follow(keys[i], dl.Event)
		}
	}
	return out
}

// wait writes barrierKey and waits until its observer on every server has
// the write's event. It is no pause: it ends when the events are there.
func (s *side) wait() {
	ctx := s.t.Context()
	b := s.bs[0]
	s.barriers++
	var want func(*lock.Event) bool
	if s.barrierOn {
		msg := fmt.Sprintf("barrier %d", s.barriers)
		if _, err := b.Unlock(ctx, lock.UnlockRequest{Type: barrierKey.Type, Resource: barrierKey.Resource, Node: barrierNode, Error: msg}); err != nil {
			s.t.Fatalf("%s: the barrier's unlock: %v", s.name, err)
		}
		want = func(e *lock.Event) bool { return e.Name == lock.EventOperationCompleted && e.Error == msg }
	} else {
		r, err := b.TryLock(ctx, lock.LockRequest{Type: barrierKey.Type, Resource: barrierKey.Resource, Node: barrierNode, Lease: lock.LeaseTTL})
		if err != nil || !r.Acquired {
			s.t.Fatalf("%s: the barrier's lock: %+v %v", s.name, r, err)
		}
		want = func(e *lock.Event) bool { return e.Name == lock.EventLockAssigned && e.Token == r.Token }
	}
	s.barrierOn = !s.barrierOn
	timeout := time.NewTimer(kit.Patience)
	defer timeout.Stop()
	for i, obs := range s.barrier {
	wait:
		for {
			for _, dl := range obs.Take(nil) {
				if want(dl.Event) {
					break wait
				}
			}
			select {
			case <-obs.Ready():
			case <-obs.Done():
				s.t.Fatalf("%s: the barrier's observer on server %d ended", s.name, i+1)
			case <-timeout.C:
				s.t.Fatalf("%s: the barrier's event did not come to server %d within %v", s.name, i+1, kit.Patience)
			}
		}
	}
}

// follow keeps who holds k, from its observer's events.
func (s *side) follow(k lock.Key, e *lock.Event) {
	switch e.Name {
	case lock.EventLockAssigned:
		s.holder[k] = nodeIndex(e.Node)
	case lock.EventOperationCompleted:
		s.holder[k] = nodeIndex(e.NextHolder)
	}
}

func nodeIndex(n string) int {
	var i int
	if _, err := fmt.Sscanf(n, "n%d", &i); err != nil {
		return -1
	}
	return i - 1
}

// event is e normalised: its id, time and token values left out, the
// token named by its order.
func (s *side) event(e *lock.Event) string {
	switch e.Name {
	case lock.EventLockAssigned:
		return fmt.Sprintf("%s %v %s %s", e.Name, e.Key, e.Node, s.token(e.Key, e.Token))
	case lock.EventOperationCompleted:
		return fmt.Sprintf("%s %v %s success=%v error=%q next=%q", e.Name, e.Key, e.Node, e.Success, e.Error, e.NextHolder)
	}
	return fmt.Sprintf("%s %v %s", e.Name, e.Key, e.Node)
}

// token names a token of k by the order in which the test first saw the
// key's tokens: #1, #2, ...; #0 is none. Only one key's tokens are ordered:
// the memory engine starts every key at its token clock, so two keys may
// have the same token (docs/DESIGN.md, "Fencing tokens").
func (s *side) token(k lock.Key, v uint64) string {
	if v == 0 {
		return "#0"
	}
	ts := s.keyTok[k]
	n := slices.Index(ts, v) + 1
	if n == 0 {
		s.keyTok[k] = append(ts, v)
		n = len(ts) + 1
	}
	return fmt.Sprintf("#%d", n)
}

var errClasses = []struct {
	name string
	err  error
}{
	{"invalid", lock.ErrInvalid},
	{"not_holder", lock.ErrNotHolder},
	{"stale_token", lock.ErrStaleToken},
	{"in_use", lock.ErrInUse},
	{"deleting", lock.ErrDeleting},
	{"updating", lock.ErrUpdating},
	{"refcount_off", lock.ErrRefCountOff},
	{"closed", lock.ErrClosed},
	{"unavailable", lock.ErrUnavailable},
	{"too_many_sessions", lock.ErrTooManySessions},
	{"queue_full", lock.ErrQueueFull},
	{"too_many_keys", lock.ErrTooManyKeys},
	{"too_many_watchers", lock.ErrTooManyWatchers},
	{"lock_held", lock.ErrLockHeld},
	{"context", context.Canceled},
}

// errClass names err by the sentinel it matches, the answer's error code.
func errClass(err error) string {
	var held *lock.HeldError
	if errors.As(err, &held) {
		return fmt.Sprintf("lock_held holder=%q", held.Holder)
	}
	for _, c := range errClasses {
		if errors.Is(err, c.err) {
			return c.name
		}
	}
	return "error: " + err.Error()
}
