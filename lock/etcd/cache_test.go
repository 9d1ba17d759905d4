package etcd

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
)

// TestRecCacheOrder: the cache keeps the newest of what the watch and this
// server's commits tell it, whatever order they come in, and a success's
// prefix delete clears its queue's index and nothing else.
func TestRecCacheOrder(t *testing.T) {
	n := names{p: "/t/"}
	c := newRecCache(n)
	c.reset(10, map[string]cEntry{}, nil)
	k := n.key(lock.Key{Type: lock.Pull, Resource: "r"})
	qa := n.queueNode(lock.Key{Type: lock.Pull, Resource: "r"}, "a")
	qb := n.queueNode(lock.Key{Type: lock.Pull, Resource: "r"}, "b")
	other := n.queueNode(lock.Key{Type: lock.Pull, Resource: "r2"}, "a")
	c.writeThrough([]clientv3.Op{clientv3.OpPut(k, "v12"), clientv3.OpPut(qa, "1"), clientv3.OpPut(qb, "2"), clientv3.OpPut(other, "3"), clientv3.OpPut(n.p+"n/x/pull/r", "l")}, 12, -1, cVal{})
	if e, ok := c.get(k); !ok || e.val.b != "v12" || e.mod() != 12 {
		t.Fatalf("written through: %+v %v", e, ok)
	}
	if _, ok := c.get(n.p + "n/x/pull/r"); ok {
		t.Fatal("a kind the cache does not keep was kept")
	}
	// The watch brings an older change of the key after the write: kept
	// as written.
	applyEvs(c, []*clientv3.Event{{Type: clientv3.EventTypePut, Kv: kvOf(k, "v11", 11)}}, 11)
	if e, _ := c.get(k); e.val.b != "v12" {
		t.Fatalf("an older change overwrote a newer one: %s", e.val.b)
	}
	// A commit the watch has passed already is left to it.
	applyEvs(c, []*clientv3.Event{{Type: clientv3.EventTypePut, Kv: kvOf(k, "v14", 14)}}, 14)
	c.writeThrough([]clientv3.Op{clientv3.OpPut(k, "v13")}, 13, -1, cVal{})
	if e, _ := c.get(k); e.val.b != "v14" {
		t.Fatalf("a passed commit was written through: %s", e.val.b)
	}
	// A success clears the queue's index with a prefix delete.
	c.writeThrough([]clientv3.Op{clientv3.OpDelete(n.queueNodes(lock.Key{Type: lock.Pull, Resource: "r"}), clientv3.WithPrefix())}, 15, -1, cVal{})
	for _, q := range []string{qa, qb} {
		if _, ok := c.get(q); ok {
			t.Fatalf("%s outlived its queue's clearing", q)
		}
	}
	if _, ok := c.get(other); !ok {
		t.Fatal("another key's queue index went with it")
	}
	// A delete the watch brings removes only what is not newer.
	applyEvs(c, []*clientv3.Event{{Type: clientv3.EventTypeDelete, Kv: kvOf(other, "", 2)}}, 2)
	if _, ok := c.get(other); !ok {
		t.Fatal("an older delete removed a newer entry")
	}
	applyEvs(c, []*clientv3.Event{{Type: clientv3.EventTypeDelete, Kv: kvOf(k, "", 16)}}, 16)
	if _, ok := c.get(k); ok {
		t.Fatal("a delete left its entry")
	}
	if v := c.begin(); !v.ok || v.rev != 16 {
		t.Fatalf("the cache's revision: %+v", v)
	}
}

func kvOf(key, val string, mod int64) *mvccpb.KeyValue {
	return &mvccpb.KeyValue{Key: []byte(key), Value: []byte(val), ModRevision: mod}
}

// TestCacheStaleNeverAnswers: a call whose first attempt reads a stale
// record from the cache (another server changed the key since) answers
// what etcd holds, never what the cache said: a write's guard fails, and
// an answer that writes nothing (a refusal, a status) is confirmed before
// it is given (docs/DESIGN.md, "One round trip for a warm call").
func TestCacheStaleNeverAnswers(t *testing.T) {
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
	k := lock.Key{Type: lock.Pull, Resource: "sha256:stale"}
	kk := a.n.key(k)

	// b holds the key; a's cache sees it, then is made to forget it.
	got, err := b.TryLock(ctx, lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: "holder", Lease: lock.LeaseTTL})
	if err != nil || !got.Acquired {
		t.Fatalf("holder: %+v %v", got, err)
	}
	resp, err := srv.Client(t).Get(ctx, kk)
	if err != nil || len(resp.Kvs) == 0 {
		t.Fatalf("the record: %v", err)
	}
	held := resp.Kvs[0].ModRevision
	kit.WaitFor(t, "a's cache to see the hold", func() bool {
		e, ok := a.rc.get(kk)
		return ok && e.mod() >= held
	})
	// stale sets a's entry back, once a's watch has applied every change
	// made so far: a change still on its way would overwrite the stale
	// entry before the call reads it.
	stale := func() {
		t.Helper()
		resp, err := srv.Client(t).Get(ctx, kk)
		if err != nil {
			t.Fatal(err)
		}
		now := resp.Header.Revision
		kit.WaitFor(t, "a's watch to apply every change so far", func() bool {
			// Changes elsewhere on the shared etcd reach the watch as
			// progress notifications, which caughtUp asks for.
			a.w.caughtUp(now, 100*time.Millisecond)
			a.rc.mu.RLock()
			defer a.rc.mu.RUnlock()
			return a.rc.watched >= now
		})
		a.rc.mu.Lock()
		a.rc.m[kk] = cEntry{val: cVal{b: encode(&keyRec{Token: 1})}, modp: 1 | a.rc.m[kk].modp&plainMark}
		a.rc.mu.Unlock()
	}
	before := a.cacheStale.Load()

	stale()
	lr, err := a.TryLock(ctx, lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: "waiter", Lease: lock.LeaseTTL})
	if err != nil || lr.Acquired || !lr.Queued || lr.Holder != "holder" {
		t.Fatalf("/lock through a stale cache: %+v %v; want queued behind holder", lr, err)
	}
	stale()
	st, err := a.Status(ctx, k.Type, k.Resource, "")
	if err != nil || !st.Held || st.Holder != "holder" || st.Token != got.Token || st.QueueLength != 1 {
		t.Fatalf("/status through a stale cache: %+v %v", st, err)
	}
	stale()
	ur, err := a.Unlock(ctx, lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: "holder", Success: false, Error: "e", Token: got.Token})
	if err != nil || ur.NextHolder != "waiter" {
		t.Fatalf("/unlock through a stale cache: %+v %v; want handed to waiter", ur, err)
	}
	stale()
	if _, err := a.Unlock(ctx, lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: "nobody", Success: true}); !errors.Is(err, lock.ErrNotHolder) {
		t.Fatalf("a refusal through a stale cache: %v", err)
	}
	if n := a.cacheStale.Load() - before; n < 4 {
		t.Fatalf("%d first attempts found the cache stale, want 4", n)
	}
}

// The tests read the cache through these; the backend reads it through
// first and kv.

// get returns key's entry: present, or absent (found false), as the cache
// knows it.
func (c *recCache) get(key string) (cEntry, bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	e, ok := c.m[key]
	return e, ok
}

// begin reports whether a call may read the cache now, and the revision
// its reads are at most as of.
func (c *recCache) begin() view {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return view{rev: c.rev, ok: c.live}
}

// applyEvs is c.apply with the keys made strings and the values as the
// cache keeps them, as the watch does.
func applyEvs(c *recCache, evs []*clientv3.Event, rev int64) {
	keys := make([]string, len(evs))
	vals := make([]cVal, len(evs))
	for i, ev := range evs {
		keys[i] = string(ev.Kv.Key)
		vals[i] = c.cacheForm(keys[i], ev.Kv.Value)
	}
	c.apply(evs, keys, vals, rev)
}

// TestCacheRecordCompact: the cache keeps a key's record compact and reads
// it back as etcd has it but for its transition, whatever its fields and
// strings hold, and keeps whole what is not a record. Every field of
// keyRec and done is filled at random, so that a field added to them and
// not to the compact form fails here.
func TestCacheRecordCompact(t *testing.T) {
	odd := []string{"", `"x":{`, `\`, "\xc1", "a\"b", "\u2028", "n\x00", "sha256:0123456789abcdef"}
	rng := rand.New(rand.NewPCG(1, 2))
	var fill func(v reflect.Value)
	fill = func(v reflect.Value) {
		switch v.Kind() {
		case reflect.String:
			v.SetString(odd[rng.IntN(len(odd))] + fmt.Sprint(rng.IntN(3)))
		case reflect.Bool:
			v.SetBool(rng.IntN(2) == 0)
		case reflect.Uint8:
			v.SetUint(uint64(rng.IntN(256)))
		case reflect.Uint64:
			v.SetUint([]uint64{0, 1, 1 << 40, math.MaxUint64}[rng.IntN(4)])
		case reflect.Int, reflect.Int64:
			v.SetInt([]int64{0, 1, -1, 1764190000000000000, math.MinInt64, math.MaxInt64}[rng.IntN(6)])
		case reflect.Pointer:
			if v.Type() == reflect.TypeFor[*trans]() || rng.IntN(3) == 0 {
				return // X is not kept; a record without a completion
			}
			v.Set(reflect.New(v.Type().Elem()))
			fill(v.Elem())
		case reflect.Struct:
			for i := range v.NumField() {
				if rng.IntN(4) > 0 {
					fill(v.Field(i))
				}
			}
		default:
			t.Fatalf("a field of kind %s: teach this test and cacherec.go", v.Kind())
		}
	}
	for range 2000 {
		var r keyRec
		fill(reflect.ValueOf(&r).Elem())
		r.X = &trans{Assigned: r.Holder, Refused: []string{`"x":`}}
		c, raw, err := checkForms(&r)
		if err != nil {
			t.Fatal(err)
		}
		whole := c.bytes()
		if whole[0] != compactTag || c.b[0] != compactTag {
			t.Fatalf("%s not made compact", raw)
		}
		for i := 1; i < len(whole); i++ {
			if _, err := decodeKey(whole[:i]); err == nil {
				t.Fatalf("%x cut at %d read as a record", whole, i)
			}
		}
		for i := 1; i < len(c.b); i++ {
			if _, err := (cVal{b: c.b[:i], who: c.who}).record(); err == nil {
				t.Fatalf("%x cut at %d read as a record", c.b, i)
			}
		}
	}
	// A session-held lock's record is one 16-byte allocation, its holder
	// and session lease kept once for all the session's locks.
	held := keyRec{Holder: "hs-1a2b3c4d-12", Token: 100234, Lease: 1, SLease: 7587889123456789012, Acquired: 1764190000000000000, X: &trans{Assigned: "hs-1a2b3c4d-12"}}
	raw := encode(&held)
	c := compactRec([]byte(raw))
	if len(c.b) > 16 {
		t.Errorf("a session-held lock's record is %d bytes in the cache (%d in etcd)", len(c.b), len(raw))
	}
	other := held
	other.Token, other.Acquired = 100240, 1764190000000000100
	if o := compactForm(&other); o.who != c.who || o.b == c.b {
		t.Errorf("two locks of one session: %v and %v apart", o.who, c.who)
	}
	other.SLease++
	if o := compactForm(&other); o.who == c.who {
		t.Error("two sessions of one node share their holding")
	}
	for _, raw := range []string{"v12", "", "{", `{"t":"x"}`} {
		if got := compactRec([]byte(raw)); got.b != raw || !got.whole() {
			t.Errorf("%q kept as %q", raw, got.b)
		}
	}
}
