package etcd

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/dlock/dlock/lock"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// marksWorld is a record cache and the watch's table of keys that marks
// its entries, driven the ways the backend drives them, beside a model of
// what the table was last told: each key's keyInfo and whether it was
// last set plainly held under its own etcd key (marked).
type marksWorld struct {
	t      *testing.T
	n      names
	b      *Backend // for StaleCacheForTest
	c      *recCache
	tab    keyTable
	keys   []lock.Key
	model  map[lock.Key]keyInfo
	marked map[lock.Key]bool
}

func newMarksWorld(t *testing.T, n names, keys []lock.Key) *marksWorld {
	c := newRecCache(n)
	c.reset(1, map[string]cEntry{}, nil)
	return &marksWorld{t: t, n: n, b: &Backend{n: n, rc: c}, c: c, tab: newKeyTable(n, c), keys: keys,
		model: map[lock.Key]keyInfo{}, marked: map[lock.Key]bool{}}
}

// spellings are k's own etcd key and another one of the same key.
func (m *marksWorld) spellings(k lock.Key) []string {
	own := m.n.key(k)
	other := m.n.p + "k/" + k.Type.String() + "/%" + fmt.Sprintf("%02X", k.Resource[0]) + esc(k.Resource[1:])
	return []string{own, other}
}

func (m *marksWorld) set(k lock.Key, key string, ki keyInfo) {
	m.tab.set(k, key, ki)
	m.model[k] = ki
	m.marked[k] = ki == plainHeld && key == m.n.key(k)
}

func (m *marksWorld) del(k lock.Key, key string) {
	m.tab.del(k, key)
	delete(m.model, k)
	delete(m.marked, k)
}

// relist is what watcher.list does: a fresh cache whose entries a fresh
// table marks, as etcd has the keys (the model), installed at once.
func (m *marksWorld) relist() {
	rev := m.c.watched + 1
	fresh := newRecCache(m.n)
	tab := newKeyTable(m.n, fresh)
	for k, ki := range m.model {
		key := m.n.key(k)
		fresh.m[key] = cEntry{val: cVal{b: "l"}, modp: rev}
		tab.set(k, key, ki)
		m.marked[k] = ki == plainHeld
	}
	m.c.reset(rev, fresh.m, fresh.gone)
	tab.c = m.c
	m.tab = tab
}

// check holds the table to the model, and the cache's marks to the table.
func (m *marksWorld) check(what string) {
	t, tab := m.t, &m.tab
	t.Helper()
	if tab.len() != len(m.model) {
		t.Fatalf("%s: %d keys, want %d", what, tab.len(), len(m.model))
	}
	for _, k := range m.keys {
		want, wok := m.model[k]
		for _, key := range m.spellings(k) {
			if got, ok := tab.get(k, key); got != want || ok != wok {
				t.Fatalf("%s: get(%v, %q) = %+v %v, want %+v %v", what, k, key, got, ok, want, wok)
			}
		}
	}
	plain := tab.plainKeys(nil)
	if len(plain) != tab.plain {
		t.Fatalf("%s: %d marked keys %q, the table counts %d", what, len(plain), plain, tab.plain)
	}
	var want []string
	for k, on := range m.marked {
		if on {
			want = append(want, m.n.key(k))
		}
	}
	slices.Sort(plain)
	slices.Sort(want)
	if !slices.Equal(plain, want) {
		t.Fatalf("%s: marked %q, want %q", what, plain, want)
	}
	m.c.mu.RLock()
	defer m.c.mu.RUnlock()
	for key := range m.c.gone {
		if _, ok := m.c.m[key]; ok {
			t.Fatalf("%s: %q has an entry and a mark in gone", what, key)
		}
	}
	for key, e := range m.c.m {
		if e.plain() && e.mod() >= plainMark {
			t.Fatalf("%s: %q's revision %d reaches the mark", what, key, e.mod())
		}
	}
}

// TestMarksFollowTheWatch drives the record cache and the watch's table
// of keys through what the backend does to them in any order: the watch's
// sets and deletes under either spelling of a key, write-throughs ahead of
// the watch and out of order (puts, deletes, a queue's prefix delete and
// a range over keys' records), the watch's own changes (several keys in
// one revision), the test hook that makes the cache stale, and relists.
// After each, every key reads back what the table was last told, the
// cache's marks are exactly the keys last set plainly held under their
// own etcd key, the table's count of them is their number, and no key has
// both an entry and a mark kept for a deleted one. TestKeyTableIsOneMap
// interleaves only in-order write-throughs and single applies.
func TestMarksFollowTheWatch(t *testing.T) {
	n := names{p: "/mk/"}
	keys := []lock.Key{{Type: lock.Pull, Resource: "a"}, {Type: lock.Update, Resource: "a"}, {Type: lock.Pull, Resource: "b/c"}, {Type: lock.Delete, Resource: "sha256:x"}, {Type: lock.Pull, Resource: "ab"}}
	infos := []keyInfo{
		plainHeld, plainHeld,
		{},
		{held: true, kept: true, deadline: 7},
		{held: true, kept: true, queue: 2},
		{kept: true, doneAt: 9},
	}
	for seed := range uint64(200) {
		rng := rand.New(rand.NewPCG(seed, 7))
		m := newMarksWorld(t, n, keys)
		// Every key the cache may hold: both spellings of each, and two
		// queue index entries of each.
		var all []string
		for _, k := range keys {
			all = append(all, m.spellings(k)...)
			all = append(all, n.queueNode(k, "n1"), n.queueNode(k, "n2"))
		}
		for step := range 300 {
			k := keys[rng.IntN(len(keys))]
			sp := m.spellings(k)
			key := sp[0]
			if rng.IntN(5) == 0 {
				key = sp[1]
			}
			// Ahead of the watch, and not in order between themselves.
			ahead := m.c.watched + 1 + int64(rng.IntN(4))
			var what string
			switch op := rng.IntN(100); {
			case op < 30:
				ki := infos[rng.IntN(len(infos))]
				m.set(k, key, ki)
				what = fmt.Sprintf("set(%v, %q, %+v)", k, key, ki)
			case op < 40:
				m.del(k, key)
				what = fmt.Sprintf("del(%v, %q)", k, key)
			case op < 55:
				var ops []clientv3.Op
				for range 1 + rng.IntN(3) {
					key := all[rng.IntN(len(all))]
					if rng.IntN(2) == 0 {
						ops = append(ops, clientv3.OpPut(key, "v"))
					} else {
						ops = append(ops, clientv3.OpDelete(key))
					}
				}
				m.c.writeThrough(ops, ahead, -1, cVal{})
				what = fmt.Sprintf("writeThrough(%d ops) at %d", len(ops), ahead)
			case op < 60:
				// A success clears its queue's index (the queue path), or
				// a range over keys' records (the other).
				op := clientv3.OpDelete(n.queueNodes(k), clientv3.WithPrefix())
				if rng.IntN(2) == 0 {
					op = clientv3.OpDelete(n.keys()+k.Type.String()+"/", clientv3.WithRange(n.keys()+k.Type.String()+"/c"))
				}
				m.c.writeThrough([]clientv3.Op{op}, ahead, -1, cVal{})
				what = fmt.Sprintf("writeThrough(range %q) at %d", op.KeyBytes(), ahead)
			case op < 80:
				rev := m.c.watched + 1
				var evs []*clientv3.Event
				seen := map[string]bool{}
				for range 1 + rng.IntN(3) {
					key := all[rng.IntN(len(all))]
					if seen[key] {
						continue
					}
					seen[key] = true
					ev := &clientv3.Event{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: []byte(key), ModRevision: rev}}
					if rng.IntN(2) == 0 {
						ev = &clientv3.Event{Type: mvccpb.PUT, Kv: &mvccpb.KeyValue{Key: []byte(key), Value: []byte("w"), ModRevision: rev}}
					}
					evs = append(evs, ev)
				}
				applyEvs(m.c, evs, rev)
				what = fmt.Sprintf("apply(%d events) at %d", len(evs), rev)
			case op < 95:
				StaleCacheForTest(m.b, rng)
				what = "stale"
			default:
				m.relist()
				what = "relist"
			}
			m.check(fmt.Sprintf("seed %d step %d, %s", seed, step, what))
		}
		staleHists.Delete(m.b)
	}
}

// TestMarksUnderWriteThroughs: the watch sets, clears and reads marks
// (under its mutex, as the watcher does) while calls write the cache
// through at once from other goroutines, and a viewer copies the marked
// keys. What the watch reads back is always what it set last, and the
// marks and their count agree when the writers are done; under -race, the
// cache's lock covers every mark.
func TestMarksUnderWriteThroughs(t *testing.T) {
	n := names{p: "/mw/"}
	var keys []lock.Key
	for i := range 16 {
		keys = append(keys, lock.Key{Type: lock.Pull, Resource: fmt.Sprint("r", i)})
	}
	m := newMarksWorld(t, n, keys)
	var wmu sync.Mutex // the watcher's w.mu
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for g := range 3 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 11))
			for {
				select {
				case <-stop:
					return
				default:
				}
				m.c.mu.RLock()
				ahead := m.c.watched + 1 + int64(rng.IntN(3))
				m.c.mu.RUnlock()
				key := n.key(keys[rng.IntN(len(keys))])
				op := clientv3.OpPut(key, "v")
				if rng.IntN(2) == 0 {
					op = clientv3.OpDelete(key)
				}
				m.c.writeThrough([]clientv3.Op{op}, ahead, -1, cVal{})
			}
		})
	}
	wg.Go(func() { // the viewer
		for {
			select {
			case <-stop:
				return
			default:
			}
			wmu.Lock()
			plain := m.tab.plainKeys(make([]string, 0, m.tab.plain))
			count := m.tab.plain
			wmu.Unlock()
			if len(plain) != count {
				t.Errorf("the viewer copied %d marked keys, the table counts %d", len(plain), count)
				return
			}
		}
	})
	rng := rand.New(rand.NewPCG(3, 11))
	for step := range 20000 {
		k := keys[rng.IntN(len(keys))]
		wmu.Lock()
		switch op := rng.IntN(10); {
		case op < 5:
			ki := plainHeld
			if rng.IntN(3) == 0 {
				ki = keyInfo{held: true, kept: true, deadline: 5}
			}
			m.set(k, n.key(k), ki)
		case op < 7:
			m.del(k, n.key(k))
		default:
			m.c.mu.RLock()
			rev := m.c.watched + 1
			m.c.mu.RUnlock()
			ev := &clientv3.Event{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: []byte(n.key(k)), ModRevision: rev}}
			if rng.IntN(2) == 0 {
				ev = &clientv3.Event{Type: mvccpb.PUT, Kv: &mvccpb.KeyValue{Key: []byte(n.key(k)), Value: []byte("w"), ModRevision: rev}}
			}
			applyEvs(m.c, []*clientv3.Event{ev}, rev)
		}
		want, wok := m.model[k]
		got, ok := m.tab.get(k, n.key(k))
		wmu.Unlock()
		if got != want || ok != wok {
			t.Fatalf("step %d: get(%v) = %+v %v, want %+v %v", step, k, got, ok, want, wok)
		}
	}
	close(stop)
	wg.Wait()
	m.check("after the writers")
}
