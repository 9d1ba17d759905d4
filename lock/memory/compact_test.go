package memory

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"
	"unsafe"

	"github.com/dlock/dlock/lock"
)

// Tests of the compact structures of docs/DESIGN.md ("The memory engine
// the rules"): each fails if its structure loses or keeps the wrong thing.

// checkKeys checks a shard's table of keys: each key in the chain of its
// hash, each resource's keys one per type and sharing one copy of it, and
// the count right.
func checkKeys(t *testing.T, m *Backend) {
	t.Helper()
	for i, s := range m.shards {
		s.mu.Lock()
		n := 0
		copies := map[string]*byte{}
		types := map[lock.Key]bool{}
		var all []*keyState
		kt := &s.keys
		for ks := range kt.all() {
			n++
			if h := kt.hash(ks.res); ks.hash != h {
				t.Errorf("shard %d: key %v has hash %x, its hash is %x", i, ks.key(), ks.hash, h)
			}
			if cur, old := kt.chains(ks.hash); !onChain(*cur, ks) && !onChain(deref(old), ks) {
				t.Errorf("shard %d: key %v is not on the chain of its hash", i, ks.key())
			}
			if p, ok := copies[ks.res]; ok && p != unsafe.StringData(ks.res) {
				t.Errorf("shard %d: the keys of %q do not share one copy of it", i, ks.res)
			}
			copies[ks.res] = unsafe.StringData(ks.res)
			if types[ks.key()] {
				t.Errorf("shard %d: two keys %v", i, ks.key())
			}
			types[ks.key()] = true
			if ks.holder == nil && ks.qlen() == 0 && !ks.hasRec && !ks.delayed() {
				t.Errorf("shard %d: %v kept with nothing to say", i, ks.key())
			}
			all = append(all, ks)
		}
		for _, ks := range all { // not while walking: a lookup moves keys
			if s.key(ks.key()) != ks {
				t.Errorf("shard %d: %v not found", i, ks.key())
			}
		}
		if n != kt.n {
			t.Errorf("shard %d: %d keys in the table, n %d", i, n, kt.n)
		}
		if b := len(kt.buckets); b < minBuckets || b&(b-1) != 0 || (kt.old == nil && (n > b || (b > minBuckets && n < b/8))) {
			t.Errorf("shard %d: %d keys in %d buckets (resizing from %d: %v)", i, n, b, len(kt.old), kt.old != nil)
		}
		s.mu.Unlock()
	}
}

// TestKeysOfOneResource: the three keys of a resource share one map entry;
// each is found, and each is forgotten alone, whatever the order, leaving
// the others held (the first of the chain, the middle, the last).
func TestKeysOfOneResource(t *testing.T) {
	orders := [][3]lock.Type{
		{lock.Pull, lock.Update, lock.Delete}, {lock.Pull, lock.Delete, lock.Update}, {lock.Update, lock.Pull, lock.Delete},
		{lock.Update, lock.Delete, lock.Pull}, {lock.Delete, lock.Pull, lock.Update}, {lock.Delete, lock.Update, lock.Pull},
	}
	for _, order := range orders {
		t.Run(fmt.Sprint(order), func(t *testing.T) {
			m := newMemory(t, func(c *Config) { c.CompletedMax = 0 }) // no records: a released key is forgotten
			for round := range 2 {                                    // the second round makes the keys again
				tokens := map[lock.Type]uint64{}
				for _, typ := range []lock.Type{lock.Pull, lock.Update, lock.Delete} {
					node := typ.String() + "-node"
					res := mustLock(t, m, lock.LockRequest{Type: typ, Resource: "r", Node: node})
					if !res.Acquired {
						t.Fatalf("round %d: %v not acquired: %+v", round, typ, res)
					}
					tokens[typ] = res.Token
				}
				checkKeys(t, m)
				for i, typ := range order {
					mustUnlock(t, m, typ, "r", typ.String()+"-node", false)
					checkKeys(t, m)
					if st := status(t, m, typ, "r", ""); st.Held || st.Token != 0 {
						t.Fatalf("round %d: %v still has state after its unlock: %+v", round, typ, st)
					}
					for _, other := range order[i+1:] {
						st := status(t, m, other, "r", "")
						if !st.Held || st.Holder != other.String()+"-node" || st.Token != tokens[other] {
							t.Fatalf("round %d: after unlocking %v, %v is %+v, want held by its node with token %d", round, typ, other, st, tokens[other])
						}
					}
				}
				if st := m.Stats(); st.Keys != 0 {
					t.Fatalf("round %d: %d keys left", round, st.Keys)
				}
				if n := m.shardFor("r").keys.n; n != 0 {
					t.Fatalf("round %d: %d keys still in the shard's table", round, n)
				}
			}
		})
	}
}

// TestKeyTableGrowsAndShrinks: thousands of keys of many resources in
// one shard, made and forgotten in a shuffled order, are each found, with
// the table growing and shrinking on the way, and while it moves its keys.
func TestKeyTableGrowsAndShrinks(t *testing.T) {
	m := newMemory(t, func(c *Config) { c.Shards = 1; c.CompletedMax = 0 })
	s := m.shards[0]
	const n = 3000
	var keys []lock.Key
	for i := range n / 3 {
		for _, typ := range []lock.Type{lock.Pull, lock.Update, lock.Delete} {
			keys = append(keys, lock.Key{Type: typ, Resource: fmt.Sprint("res-", i)})
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	rng.Shuffle(len(keys), func(i, j int) { keys[i], keys[j] = keys[j], keys[i] })
	tokens := map[lock.Key]uint64{}
	moving := 0 // checks made while a resize went on
	check := func(i int) {
		if s.keys.old != nil {
			moving++
		}
		if i%500 == 0 || s.keys.old != nil {
			checkKeys(t, m)
		}
	}
	for i, k := range keys {
		tokens[k] = mustLock(t, m, lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: "a"}).Token
		check(i)
	}
	checkKeys(t, m)
	if b := len(s.keys.buckets); b != 4096 {
		t.Fatalf("%d keys in %d buckets, want 4096", n, b)
	}
	rng.Shuffle(len(keys), func(i, j int) { keys[i], keys[j] = keys[j], keys[i] })
	for i, k := range keys {
		mustUnlock(t, m, k.Type, k.Resource, "a", false)
		check(i)
		if i%250 == 0 {
			for _, o := range keys[i+1 : min(len(keys), i+50)] {
				if st := status(t, m, o.Type, o.Resource, ""); st.Holder != "a" || st.Token != tokens[o] {
					t.Fatalf("%v after %d unlocks: %+v, want held by a with token %d", o, i+1, st, tokens[o])
				}
			}
		}
	}
	checkKeys(t, m)
	if b := len(s.keys.buckets); s.keys.n != 0 || b != minBuckets || s.keys.old != nil {
		t.Fatalf("%d keys left in %d buckets, resizing %v", s.keys.n, b, s.keys.old != nil)
	}
	if moving < 10 {
		t.Fatalf("%d changes made while a resize went on", moving)
	}
}

// TestDerivedDeadlines: an entry keeps its ttl deadline alone; the claim
// timeout and max hold are counted from its grant. A hand-off whose claim
// timeout and max hold end together is reported as max hold (the
// precedence of docs/DESIGN.md, "Leases"), a waiter is never held to the
// max hold of a grant it has not had, and a confirmation ends only the
// claim timeout.
func TestDerivedDeadlines(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemory(t, func(c *Config) {
			c.ClaimTimeout, c.MaxHold, c.LockTTL = 5*time.Second, 5*time.Second, time.Hour
		})
		mustLock(t, m, lockReq(lock.Pull, "r", "a"))
		mustLock(t, m, lockReq(lock.Pull, "r", "c"))
		mustLock(t, m, lockReq(lock.Pull, "r", "b")) // waits from 0 s to 8 s, beyond a max hold
		time.Sleep(4 * time.Second)
		mustUnlock(t, m, lock.Pull, "r", "a", false) // c granted at 4 s
		mustLock(t, m, lockReq(lock.Pull, "r", "c")) // and confirms
		time.Sleep(4 * time.Second)
		synctest.Wait()
		if st := status(t, m, lock.Pull, "r", "b"); st.Holder != "c" || st.Position != 1 {
			t.Fatalf("at 8 s: %+v, want c holding and b waiting", st)
		}
		mustUnlock(t, m, lock.Pull, "r", "c", false) // b granted at 8 s, unconfirmed
		time.Sleep(4 * time.Second)
		synctest.Wait()
		if st := status(t, m, lock.Pull, "r", ""); st.Holder != "b" {
			t.Fatalf("at 12 s: %+v, want b holding: its bounds run from its grant at 8 s", st)
		}
		time.Sleep(2 * time.Second)
		synctest.Wait()
		st := status(t, m, lock.Pull, "r", "")
		if st.Held || st.LastCompleted == nil || st.LastCompleted.Node != "b" || st.LastCompleted.Error != "max hold exceeded" {
			t.Fatalf("claim timeout and max hold together: %+v %+v, want max hold exceeded", st, st.LastCompleted)
		}

		// A confirmed hand-off is held to its max hold only.
		m2 := newMemory(t, func(c *Config) {
			c.ClaimTimeout, c.MaxHold, c.LockTTL = 2*time.Second, 10*time.Second, time.Hour
		})
		mustLock(t, m2, lockReq(lock.Pull, "r", "a"))
		mustLock(t, m2, lockReq(lock.Pull, "r", "b"))
		mustUnlock(t, m2, lock.Pull, "r", "a", false)
		if v := inspect(t, m2, lock.KeyQuery{}).Keys; len(v) != 1 || !v[0].Unclaimed {
			t.Fatalf("hand-off not shown unclaimed: %+v", v)
		}
		time.Sleep(time.Second)
		mustLock(t, m2, lockReq(lock.Pull, "r", "b")) // confirms
		if v := inspect(t, m2, lock.KeyQuery{}).Keys; len(v) != 1 || v[0].Unclaimed {
			t.Fatalf("confirmed hand-off shown unclaimed: %+v", v)
		}
		time.Sleep(8 * time.Second)
		synctest.Wait()
		if st := status(t, m2, lock.Pull, "r", ""); st.Holder != "b" {
			t.Fatalf("at 9 s, confirmed at 1 s: %+v, want b holding", st)
		}
		time.Sleep(2 * time.Second)
		synctest.Wait()
		if st := status(t, m2, lock.Pull, "r", ""); st.Held || st.LastCompleted.Error != "max hold exceeded" {
			t.Fatalf("at 11 s: %+v %+v, want max hold exceeded", st, st.LastCompleted)
		}
	})
}

// sessionEntries checks node's session list (consistent links, every
// entry leased to the session, nents its length) and returns its keys.
func sessionEntries(t *testing.T, m *Backend, node string) []lock.Key {
	t.Helper()
	for _, sh := range m.shards { // lock order: shards, session table, session
		sh.mu.Lock()
		defer sh.mu.Unlock()
	}
	s := m.sess.get(node)
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var keys []lock.Key
	var prev *entry
	for e := s.ents; e != nil; e = e.snext {
		if e.sprev != prev || e.sess != s {
			t.Fatalf("%s: entry %v badly linked: prev ok %v, session ok %v", node, e.ks.key(), e.sprev == prev, e.sess == s)
		}
		if ks := m.shardFor(e.ks.res).key(e.ks.key()); ks != e.ks || (ks.holder != e && ks.waiter(node) != e) {
			t.Fatalf("%s: entry %v in the session list is not in its key", node, e.ks.key())
		}
		keys = append(keys, e.ks.key())
		prev = e
	}
	if len(keys) != s.nents {
		t.Fatalf("%s: %d entries listed, nents %d", node, len(keys), s.nents)
	}
	slices.SortFunc(keys, func(a, b lock.Key) int { return strings.Compare(a.String(), b.String()) })
	return keys
}

func keyList(typ lock.Type, res ...string) []lock.Key {
	var keys []lock.Key
	for _, r := range res {
		keys = append(keys, lock.Key{Type: typ, Resource: r})
	}
	return keys
}

// TestSessionList: a session's entries join and leave its list as holds
// and waits start and end, from its head, middle and tail, and as leases
// switch; its loss ends exactly what is still listed, and the entries it
// had, released and reused by another session meanwhile, stay with that
// one.
func TestSessionList(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemory(t, func(c *Config) { c.SessionGrace = 5 * time.Second; c.Shards = 2 })
		sa := subscribe(t, m, "a", nil)
		subscribe(t, m, "b", nil)
		for _, r := range []string{"w1", "w2"} {
			mustLock(t, m, lock.LockRequest{Type: lock.Pull, Resource: r, Node: "x", Lease: lock.LeaseTTL})
		}
		for _, r := range []string{"h1", "h2", "h3", "h4", "h5", "w1", "w2"} {
			mustLock(t, m, lockReq(lock.Pull, r, "a"))
		}
		if got := sessionEntries(t, m, "a"); !slices.Equal(got, keyList(lock.Pull, "h1", "h2", "h3", "h4", "h5", "w1", "w2")) {
			t.Fatalf("a's entries: %v", got)
		}
		// Leave from the tail (the first linked), the head and the middle.
		mustUnlock(t, m, lock.Pull, "h1", "a", true)
		if _, err := m.Cancel(t.Context(), lock.Pull, "w2", "a"); err != nil {
			t.Fatal(err)
		}
		mustUnlock(t, m, lock.Pull, "h3", "a", false)
		// A switch to ttl leaves the list; one back to session joins it.
		mustLock(t, m, lock.LockRequest{Type: lock.Pull, Resource: "h4", Node: "a", Lease: lock.LeaseTTL})
		mustLock(t, m, lock.LockRequest{Type: lock.Pull, Resource: "h5", Node: "a", Lease: lock.LeaseTTL})
		mustLock(t, m, lock.LockRequest{Type: lock.Pull, Resource: "h5", Node: "a", Lease: lock.LeaseSession})
		if got := sessionEntries(t, m, "a"); !slices.Equal(got, keyList(lock.Pull, "h2", "h5", "w1")) {
			t.Fatalf("a's entries after leaving: %v", got)
		}
		// b takes what a gave up; the shards reuse a's released entries.
		for _, r := range []string{"h1", "h3", "w2"} {
			mustLock(t, m, lockReq(lock.Pull, r, "b"))
		}
		mustLock(t, m, lockReq(lock.Pull, "h2", "b")) // waits behind a
		if got := sessionEntries(t, m, "b"); !slices.Equal(got, keyList(lock.Pull, "h1", "h2", "h3", "w2")) {
			t.Fatalf("b's entries: %v", got)
		}
		if p := inspectSessions(t, m); p["a"] != 3 || p["b"] != 4 {
			t.Fatalf("sessions' key counts: %v", p)
		}

		sa.Close()
		time.Sleep(6 * time.Second)
		synctest.Wait()
		if m.Stats().SessionsLost != 1 {
			t.Fatalf("sessions lost: %d", m.Stats().SessionsLost)
		}
		want := map[string]string{"h1": "b", "h2": "b", "h3": "b", "h4": "a", "h5": "", "w1": "x", "w2": "x"}
		for r, holder := range want {
			st := status(t, m, lock.Pull, r, "a")
			if st.Holder != holder || st.Position != 0 {
				t.Errorf("%s after a's loss: %+v, want holder %q and a not waiting", r, st, holder)
			}
		}
		if got := sessionEntries(t, m, "b"); !slices.Equal(got, keyList(lock.Pull, "h1", "h2", "h3", "w2")) {
			t.Fatalf("b's entries after a's loss: %v", got)
		}
		if got := sessionEntries(t, m, "a"); got != nil {
			t.Fatalf("a's session outlived its loss: %v", got)
		}
	})
}

func inspectSessions(t *testing.T, m *Backend) map[string]int {
	t.Helper()
	p, err := m.InspectSessions(t.Context(), lock.SessionQuery{})
	if err != nil {
		t.Fatal(err)
	}
	keys := map[string]int{}
	for _, s := range p.Sessions {
		keys[s.Node] = s.Keys
	}
	return keys
}

// TestNodeIDsInterned: every entry of a node names it with one copy of its
// id, the session's for a session lease, however the request's string was
// made; a node's id made again after its entries were all gone (and
// collected) names it still.
func TestNodeIDsInterned(t *testing.T) {
	m := newMemory(t, nil)
	subscribe(t, m, "sess-node", nil)
	nodeOf := func(k lock.Key) string { // the holder's id as the entry keeps it
		s := m.shardFor(k.Resource)
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.key(k).holder.node()
	}
	fresh := func(s string) string { return string([]byte(s)) } // a copy of its own, as each request has
	var ttlIDs, sessIDs []string
	for i := range 4 {
		r := fmt.Sprintf("r%d", i)
		mustLock(t, m, lock.LockRequest{Type: lock.Pull, Resource: r, Node: fresh("ttl-node"), Lease: lock.LeaseTTL})
		mustLock(t, m, lock.LockRequest{Type: lock.Update, Resource: r, Node: fresh("sess-node")})
		ttlIDs = append(ttlIDs, nodeOf(lock.Key{Type: lock.Pull, Resource: r}))
		sessIDs = append(sessIDs, nodeOf(lock.Key{Type: lock.Update, Resource: r}))
	}
	// A lease switch keeps the entry's id.
	mustLock(t, m, lock.LockRequest{Type: lock.Update, Resource: "r0", Node: fresh("sess-node"), Lease: lock.LeaseTTL})
	mustLock(t, m, lock.LockRequest{Type: lock.Update, Resource: "r1", Node: fresh("sess-node"), Lease: lock.LeaseTTL})
	mustLock(t, m, lock.LockRequest{Type: lock.Update, Resource: "r1", Node: fresh("sess-node"), Lease: lock.LeaseSession})
	sessIDs = append(sessIDs, nodeOf(lock.Key{Type: lock.Update, Resource: "r0"}), nodeOf(lock.Key{Type: lock.Update, Resource: "r1"}))
	sess := m.sess.get("sess-node")
	for _, id := range sessIDs {
		if id != "sess-node" || unsafe.StringData(id) != unsafe.StringData(sess.id.Value()) {
			t.Fatalf("a session-leased entry's id %q is not the session's copy", id)
		}
	}
	for _, id := range ttlIDs {
		if id != "ttl-node" || unsafe.StringData(id) != unsafe.StringData(ttlIDs[0]) {
			t.Fatalf("ttl entries of one node do not share one copy of its id")
		}
	}
	if st := status(t, m, lock.Pull, "r3", ""); st.Holder != "ttl-node" {
		t.Fatalf("holder %q", st.Holder)
	}

	// Every entry of a node gone, its interned id may be collected; the
	// next one is named right.
	for i := range 4 {
		mustUnlock(t, m, lock.Pull, fmt.Sprintf("r%d", i), "ttl-node", true)
	}
	ttlIDs = nil
	runtime.GC()
	runtime.GC()
	mustLock(t, m, lock.LockRequest{Type: lock.Pull, Resource: "again", Node: fresh("ttl-node"), Lease: lock.LeaseTTL})
	mustLock(t, m, lock.LockRequest{Type: lock.Pull, Resource: "again", Node: fresh("other"), Lease: lock.LeaseTTL})
	if st := status(t, m, lock.Pull, "again", "other"); st.Holder != "ttl-node" || st.Position != 1 {
		t.Fatalf("after a collection: %+v", st)
	}
	if nodeOf(lock.Key{Type: lock.Pull, Resource: "again"}) != "ttl-node" {
		t.Fatal("the id made again names another node")
	}

	// Ids that meet in the shard's cache of ids keep their own names.
	m2 := newMemory(t, func(c *Config) { c.Shards = 1 })
	for round := range 2 {
		for i, node := range []string{"node-a1", "node-b1", "node-c1", "node-a1"} {
			r := fmt.Sprint("k", round, i)
			mustLock(t, m2, lock.LockRequest{Type: lock.Pull, Resource: r, Node: fresh(node), Lease: lock.LeaseTTL})
			if st := status(t, m2, lock.Pull, r, ""); st.Holder != node {
				t.Fatalf("round %d: %s held by %q, locked by %q", round, r, st.Holder, node)
			}
		}
	}
}

// TestReplayRebuildsCompactEvents: a session's own lock_assigned events,
// which its log keeps as key and token, replay as they were sent, in order
// with the events it keeps whole, from every Last-Event-ID, before and
// after the log let its oldest go and compacted.
func TestReplayRebuildsCompactEvents(t *testing.T) {
	const logLen = 8
	m := newMemory(t, func(c *Config) { c.SessionLog = logLen })
	st := subscribe(t, m, "a", nil)
	var sent []lock.Delivery
	for i := range 30 {
		r := fmt.Sprint("r", i)
		switch i % 3 {
		case 0: // a direct grant
			mustLock(t, m, lockReq(lock.Pull, r, "a"))
		case 1: // a success tells the waiter a
			mustLock(t, m, lock.LockRequest{Type: lock.Pull, Resource: r, Node: "x", Lease: lock.LeaseTTL})
			mustLock(t, m, lockReq(lock.Pull, r, "a"))
			mustUnlock(t, m, lock.Pull, r, "x", true)
		case 2: // a failure hands the key to a
			mustLock(t, m, lock.LockRequest{Type: lock.Update, Resource: r, Node: "x", Lease: lock.LeaseTTL})
			mustLock(t, m, lockReq(lock.Update, r, "a"))
			mustUnlock(t, m, lock.Update, r, "x", false)
		}
		sent = append(sent, events(st)...)
		for j := -1; j < len(sent); j++ {
			var last uint64
			if j >= 0 {
				last = sent[j].ID
			}
			// after, which Subscribe is to use, gives the tail of live.
			s := m.sess.get("a")
			s.mu.Lock()
			tail, all := s.after(last), s.live()
			s.mu.Unlock()
			k := len(all) - len(tail)
			if k < 0 {
				t.Fatalf("round %d, after %d: %d events, more than the log's %d", i, last, len(tail), len(all))
			}
			for x, d := range tail {
				if a := all[k+x]; d.ID != a.ID || !sameEvent(d.Event, a.Event) || (k > 0 && all[k-1].ID > last) || d.ID <= last {
					t.Fatalf("round %d, after %d: event %d of %d differs from the log's", i, last, x, len(tail))
				}
			}
			rs, sub, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: "a", LastID: last, HasLast: true})
			if err != nil {
				t.Fatal(err)
			}
			rs.Close()
			kept := sent[max(0, len(sent)-logLen):]
			want := sent[j+1:]
			if missed := len(want) > len(kept); missed != sub.Missed {
				t.Fatalf("round %d, from %d: missed %v, want %v", i, last, sub.Missed, missed)
			} else if missed {
				want = kept
			}
			if len(sub.Replay) != len(want) {
				t.Fatalf("round %d, from %d: %d events replayed, want %d", i, last, len(sub.Replay), len(want))
			}
			for k, d := range sub.Replay {
				w := want[k]
				if d.ID != w.ID || !sameEvent(d.Event, w.Event) {
					t.Fatalf("round %d, from %d: replayed %d %s, sent %d %s", i, last, d.ID, eventText(d.Event), w.ID, eventText(w.Event))
				}
			}
		}
	}
}

func sameEvent(a, b *lock.Event) bool {
	return a.Name == b.Name && a.Key == b.Key && a.Node == b.Node && a.Token == b.Token && a.Success == b.Success &&
		a.Error == b.Error && a.CompletedAt.Equal(b.CompletedAt) && a.NextHolder == b.NextHolder && a.WireSize() == b.WireSize()
}

func eventText(e *lock.Event) string {
	return fmt.Sprintf("%s %v node %s token %d success %v error %q at %v next %q", e.Name, e.Key, e.Node, e.Token, e.Success, e.Error, e.CompletedAt, e.NextHolder)
}

func onChain(first, ks *keyState) bool {
	for o := first; o != nil; o = o.sib {
		if o == ks {
			return true
		}
	}
	return false
}
