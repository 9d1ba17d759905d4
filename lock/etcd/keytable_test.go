package etcd

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/dlock/dlock/lock"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// TestKeyTableIsOneMap holds the watch's table of keys to the one map by
// lock.Key it replaced: after any sequence of sets and deletes, each
// under the key's own etcd key or under another spelling of it ("%61" for
// "a", which no server writes but a record may have), every key reads
// back what was last set for it, and the table has as many keys. The
// record cache that keeps the marks changes in between as it does beside
// the watch (write-throughs ahead of it, the watch's own puts and
// deletes), which must not change what the table reads.
func TestKeyTableIsOneMap(t *testing.T) {
	n := names{p: "/kt/"}
	keys := []lock.Key{{Type: lock.Pull, Resource: "a"}, {Type: lock.Update, Resource: "a"}, {Type: lock.Pull, Resource: "b/c"}, {Type: lock.Delete, Resource: "sha256:x"}}
	spellings := func(k lock.Key) []string {
		own := n.key(k)
		other := n.p + "k/" + k.Type.String() + "/%" + fmt.Sprintf("%02X", k.Resource[0]) + esc(k.Resource[1:])
		if _, ok := n.parseKey(other); !ok {
			t.Fatalf("%q: not a key", other)
		}
		return []string{own, other}
	}
	infos := []keyInfo{
		plainHeld,
		{},
		{held: true, kept: true, deadline: 7},
		{held: true, kept: true, queue: 2},
		{kept: true, doneAt: 9},
		{kept: true, queue: 1, deadline: 1},
		{held: true, kept: true, doneAt: 3},
	}
	for seed := range uint64(50) {
		rng := rand.New(rand.NewPCG(seed, 1))
		c := newRecCache(n)
		tab := newKeyTable(n, c)
		model := map[lock.Key]keyInfo{}
		rev := int64(1)
		for step := range 200 {
			k := keys[rng.IntN(len(keys))]
			sp := spellings(k)
			rev++
			switch own := sp[0]; rng.IntN(5) {
			case 0:
				c.writeThrough([]clientv3.Op{clientv3.OpPut(own, "v")}, rev, -1, cVal{})
			case 1:
				c.writeThrough([]clientv3.Op{clientv3.OpDelete(own)}, rev, -1, cVal{})
			case 2:
				ev := &clientv3.Event{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: []byte(own), ModRevision: rev}}
				if rng.IntN(2) == 0 {
					ev = &clientv3.Event{Type: mvccpb.PUT, Kv: &mvccpb.KeyValue{Key: []byte(own), Value: []byte("w"), ModRevision: rev}}
				}
				c.apply([]*clientv3.Event{ev}, []string{own}, []cVal{{b: string(ev.Kv.Value)}}, rev)
			}
			key := sp[0]
			if rng.IntN(5) == 0 {
				key = sp[1]
			}
			want, wok := model[k]
			var old keyInfo
			var had bool
			if rng.IntN(4) == 0 {
				old, had = tab.del(k, key)
				delete(model, k)
			} else {
				ki := infos[rng.IntN(len(infos))]
				old, had = tab.set(k, key, ki)
				model[k] = ki
			}
			if old != want || had != wok {
				t.Fatalf("seed %d step %d: the previous state of %v = %+v %v, want %+v %v", seed, step, k, old, had, want, wok)
			}
			if tab.len() != len(model) {
				t.Fatalf("seed %d step %d: %d keys, want %d", seed, step, tab.len(), len(model))
			}
			for _, k := range keys {
				want, wok := model[k]
				for _, key := range spellings(k) {
					if got, ok := tab.get(k, key); got != want || ok != wok {
						t.Fatalf("seed %d step %d: get(%v, %q) = %+v %v, want %+v %v", seed, step, k, key, got, ok, want, wok)
					}
				}
				if got, ok := tab.getKey(k); got != want || ok != wok {
					t.Fatalf("seed %d step %d: getKey(%v) = %+v %v, want %+v %v", seed, step, k, got, ok, want, wok)
				}
				// timed answers for what has a deadline or a record's time.
				got, ok := tab.timed(k)
				timed := want.deadline != 0 || want.doneAt != 0
				if timed && (got != want || !ok) || !timed && (got.deadline != 0 || got.doneAt != 0) {
					t.Fatalf("seed %d step %d: timed(%v) = %+v %v, want %+v %v", seed, step, k, got, ok, want, wok)
				}
			}
			seen := map[lock.Key]bool{}
			for k, ki := range tab.notPlain() {
				if seen[k] || ki == plainHeld && model[k] != plainHeld || model[k] != ki {
					t.Fatalf("seed %d step %d: notPlain yields %v %+v, want %+v", seed, step, k, ki, model[k])
				}
				seen[k] = true
			}
			for _, key := range tab.plainKeys(nil) {
				k, ok := n.parseKey(key)
				if !ok || seen[k] || model[k] != plainHeld || key != n.key(k) {
					t.Fatalf("seed %d step %d: plainKeys yields %q, its key %+v", seed, step, key, model[k])
				}
				seen[k] = true
			}
			if len(seen) != len(model) {
				t.Fatalf("seed %d step %d: the walks yield %d keys, want %d", seed, step, len(seen), len(model))
			}
		}
	}
}

// TestTrackCountsExact applies sequences of grants, releases, waiters,
// completions, lock delays and deletes to a few keys through the watch's
// track, and checks after each change that the counts the limits and
// gauges read are those of the records as they are, that each key's entry
// is its record's, and that the timers find the earliest deadline and
// the oldest completion record: a count off by one or a deadline lost
// after a key was plainly held fails.
func TestTrackCountsExact(t *testing.T) {
	const retention = time.Minute
	n := names{p: "/tc/"}
	keys := []lock.Key{{Type: lock.Pull, Resource: "r1"}, {Type: lock.Update, Resource: "r1"}, {Type: lock.Pull, Resource: "r 2"}}
	recs := []keyRec{
		{Holder: "n1", Token: 1, Lease: uint8(lock.LeaseSession), SLease: 5, Acquired: 10},     // plainly held
		{Holder: "n2", Token: 2, Lease: uint8(lock.LeaseTTL), Acquired: 10, TTL: 5000},         // a ttl deadline
		{Holder: "n1", Token: 3, Lease: uint8(lock.LeaseSession), SLease: 5, Queue: 2, Seq: 3}, // waiters
		{Holder: "n1", Token: 4, Lease: uint8(lock.LeaseSession), SLease: 5, Claim: 700},       // a hand-off to confirm
		{Token: 5, Done: &done{Node: "n1", Token: 5, OK: true, At: 300}},                       // a completion record
		{Holder: "n3", Token: 6, Lease: uint8(lock.LeaseSession), SLease: 6, Done: &done{Node: "n1", Token: 5, At: 400}},
		{Token: 7, Queue: 1, Seq: 9, WaitTTL: 900}, // a free key's waiter
		{Token: 8, Delay: 650}, // a lock delay
		{Token: 9},             // nothing kept
		{Holder: "n4", Token: 10, Lease: uint8(lock.LeaseSession), SLease: 9, MaxHold: 2000}, // a max hold
	}
	for seed := range uint64(40) {
		rng := rand.New(rand.NewPCG(seed, 2))
		w := &watcher{b: &Backend{n: n, cfg: Config{Rules: lock.Rules{CompletedRetention: retention}}}, keys: newKeyTable(n, newRecCache(n))}
		model := map[lock.Key]keyRec{}
		for step := range 300 {
			k := keys[rng.IntN(len(keys))]
			c := change{k: k, key: n.key(k)}
			if rng.IntN(5) == 0 {
				c.deleted = true
				delete(model, k)
			} else {
				c.rec = recs[rng.IntN(len(recs))]
				// A record that stays differs in its times only.
				if c.rec.Done != nil {
					d := *c.rec.Done
					d.At += int64(step)
					c.rec.Done = &d
				}
				model[k] = c.rec
			}
			w.track(c)
			var nKeys, nHeld, nQd, nDone int
			var next, oldest int64
			for k := range model {
				r := model[k]
				want := info(&r, retention)
				got, ok := w.keys.get(k, n.key(k))
				if !ok || got != want {
					t.Fatalf("seed %d step %d: %v is %+v %v, want %+v", seed, step, k, got, ok, want)
				}
				nKeys, nHeld, nQd = nKeys+b2i(want.kept), nHeld+b2i(want.held), nQd+int(want.queue)
				if want.doneAt != 0 {
					nDone++
					if oldest == 0 || want.doneAt < oldest {
						oldest = want.doneAt
					}
				}
				if want.deadline != 0 && (next == 0 || want.deadline < next) {
					next = want.deadline
				}
			}
			if w.keys.len() != len(model) {
				t.Fatalf("seed %d step %d: %d keys, want %d", seed, step, w.keys.len(), len(model))
			}
			if w.nKeys != nKeys || w.nHeld != nHeld || w.nQd != nQd || w.nDone != nDone {
				t.Fatalf("seed %d step %d: keys %d held %d queued %d done %d, want %d %d %d %d",
					seed, step, w.nKeys, w.nHeld, w.nQd, w.nDone, nKeys, nHeld, nQd, nDone)
			}
			if _, at, ok := w.next(); at != next || ok != (next != 0) {
				t.Fatalf("seed %d step %d: next deadline %d %v, want %d", seed, step, at, ok, next)
			}
			if _, at, ok := w.oldestPastCap(); at != oldest || ok != (oldest != 0) {
				t.Fatalf("seed %d step %d: oldest completion %d %v, want %d", seed, step, at, ok, oldest)
			}
		}
	}
}
