package etcd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
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
	c.reset(10, map[string]cEntry{})
	k := n.key(lock.Key{Type: lock.Pull, Resource: "r"})
	qa := n.queueNode(lock.Key{Type: lock.Pull, Resource: "r"}, "a")
	qb := n.queueNode(lock.Key{Type: lock.Pull, Resource: "r"}, "b")
	other := n.queueNode(lock.Key{Type: lock.Pull, Resource: "r2"}, "a")
	c.writeThrough([]clientv3.Op{clientv3.OpPut(k, "v12"), clientv3.OpPut(qa, "1"), clientv3.OpPut(qb, "2"), clientv3.OpPut(other, "3"), clientv3.OpPut(n.p+"n/x/pull/r", "l")}, 12)
	if e, ok := c.get(k); !ok || string(e.val) != "v12" || e.mod != 12 {
		t.Fatalf("written through: %+v %v", e, ok)
	}
	if _, ok := c.get(n.p + "n/x/pull/r"); ok {
		t.Fatal("a kind the cache does not keep was kept")
	}
	// The watch brings an older change of the key after the write: kept
	// as written.
	applyEvs(c, []*clientv3.Event{{Type: clientv3.EventTypePut, Kv: kvOf(k, "v11", 11)}}, 11)
	if e, _ := c.get(k); string(e.val) != "v12" {
		t.Fatalf("an older change overwrote a newer one: %s", e.val)
	}
	// A commit the watch has passed already is left to it.
	applyEvs(c, []*clientv3.Event{{Type: clientv3.EventTypePut, Kv: kvOf(k, "v14", 14)}}, 14)
	c.writeThrough([]clientv3.Op{clientv3.OpPut(k, "v13")}, 13)
	if e, _ := c.get(k); string(e.val) != "v14" {
		t.Fatalf("a passed commit was written through: %s", e.val)
	}
	// A success clears the queue's index with a prefix delete.
	c.writeThrough([]clientv3.Op{clientv3.OpDelete(n.queueNodes(lock.Key{Type: lock.Pull, Resource: "r"}), clientv3.WithPrefix())}, 15)
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
		return ok && e.mod >= held
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
		a.rc.m[kk] = cEntry{val: []byte(encode(&keyRec{Token: 1})), mod: 1}
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

// applyEvs is c.apply with the keys made strings, as the watch does.
func applyEvs(c *recCache, evs []*clientv3.Event, rev int64) {
	keys := make([]string, len(evs))
	for i, ev := range evs {
		keys[i] = string(ev.Kv.Key)
	}
	c.apply(evs, keys, rev)
}

// TestCacheRecordWithoutTrans: the cache keeps a key's record without its
// transition and otherwise as etcd has it, whatever its strings hold, and
// keeps whole what is not a record this server encodes.
func TestCacheRecordWithoutTrans(t *testing.T) {
	odd := []string{"", `"x":{`, `\`, `}"x":{}}`, "a\"b", `{"x":1}`, "\u2028", "\\\"x\\\":"}
	for i := range 200 {
		s := odd[i%len(odd)] + fmt.Sprint(i)
		r := keyRec{Token: uint64(i), Seq: uint64(i / 3)}
		if i%2 == 0 {
			r.Holder, r.Lease, r.SLease, r.Acquired = s, 1, int64(i)<<40, int64(i)<<50
		}
		if i%3 == 0 {
			r.Done = &done{Node: s, Err: s, At: int64(i), Next: odd[(i+1)%len(odd)]}
		}
		if i%5 != 0 {
			r.X = &trans{Assigned: s, Refused: []string{s, `"x":`}, Done: r.Done, Skip: i%7 == 0}
		}
		raw := []byte(encode(&r))
		got, err := decodeKey(withoutTrans(raw))
		if err != nil {
			t.Fatalf("%s: %v", raw, err)
		}
		want := r
		want.X = nil
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("%s kept as %s", raw, withoutTrans(raw))
		}
		if r.X == nil && !bytes.Equal(withoutTrans(raw), raw) {
			t.Fatalf("%s changed to %s", raw, withoutTrans(raw))
		}
	}
	for _, raw := range []string{`{"x":{"a":"n"}}`, `v12`, `{"h":"n","x":{"a":"n"},"t":3}`, `{"h":"n","x":{"a":"n"`, `{"h":"n","x":1}`} {
		got := string(withoutTrans([]byte(raw)))
		want := raw
		if raw == `{"x":{"a":"n"}}` {
			want = `{}`
		}
		if got != want {
			t.Errorf("%s kept as %s, want %s", raw, got, want)
		}
	}
}
