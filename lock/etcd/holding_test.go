package etcd

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
)

// checkCachedValue holds one cached value to etcd's, in every way the
// server reads it (docs/DESIGN.md, "What a server keeps"): a call's first
// read (record), tx.get (bytes, which sibling and the refs, sessions and
// queue index reads decode), the operators' view (recJSON of bytes, in
// which the node filter looks for a quoted holder). A key record reads
// back as etcd's but for its transition; anything else, a value under k/
// that is no record included, byte for byte.
func checkCachedValue(key string, record bool, v cVal, raw []byte) error {
	got := v.bytes()
	want, werr := decodeKey(raw)
	if !record || werr != nil {
		if !bytes.Equal(got, raw) {
			return fmt.Errorf("%s: cached %q, etcd has %q", key, got, raw)
		}
		if record {
			if _, err := v.record(); err == nil {
				return fmt.Errorf("%s: %q, no record in etcd, reads as one from the cache", key, raw)
			}
		}
		return nil
	}
	want.X = nil
	if v.whole() != (want.Holder == "") {
		return fmt.Errorf("%s: holder %q kept apart: %v", key, want.Holder, !v.whole())
	}
	for _, read := range []struct {
		how string
		f   func() (keyRec, error)
	}{
		{"first read", v.record},
		{"tx.get", func() (keyRec, error) { return decodeKey(got) }},
		{"operators' view", func() (keyRec, error) { return decodeKey(recJSON(got)) }},
	} {
		r, err := read.f()
		if err != nil || !reflect.DeepEqual(r, want) {
			return fmt.Errorf("%s: %s reads %+v (%v), etcd has %+v", key, read.how, r, err, want)
		}
	}
	if want.Holder != "" {
		quoted, _ := json.Marshal(want.Holder)
		if !bytes.Contains(recJSON(got), quoted) {
			return fmt.Errorf("%s: the operators' view %s does not name holder %s", key, recJSON(got), quoted)
		}
	}
	return nil
}

// checkForms caches r both ways a server does: from its own write
// (writtenForm, from r) and from etcd's JSON of it (compactRec). The two
// must be one value, which reads back as etcd has r (checkCachedValue).
// It returns that value and the JSON.
func checkForms(r *keyRec) (cVal, []byte, error) {
	raw := []byte(encode(r))
	read, written := compactRec(raw), writtenForm(r, raw)
	if read != written {
		return read, raw, fmt.Errorf("%q: written %x %v, read %x %v", raw, written.b, written.who, read.b, read.who)
	}
	return read, raw, checkCachedValue("k/x", true, read, raw)
}

// TestHoldingFormsAgree: a record this server writes (writtenForm, from
// the record), one the watch or a list reads from etcd (compactRec, from
// the JSON) are the same value, equal as Go values, and read back as the
// JSON etcd has: with a holder and no session lease, a session lease and
// no holder, a holder that is not UTF-8 (which the JSON changes), with
// and without a completion. Records that differ in their holder or session
// lease alone are different values.
func TestHoldingFormsAgree(t *testing.T) {
	holders := []string{"", "n1", "hs-1a2b3c4d-12", "a\xffb", "\xc1", "a\"<b>&\u2028", strings.Repeat("h", 256)}
	sleases := []int64{0, 1, -1, 7587889123456789012}
	dones := []*done{nil, {}, {Node: "n1", Token: 3, OK: true, At: 9}, {Node: "a\xff", Err: "e\xfe", Next: "n\xc1", Unlock: true}}
	seen := map[cVal]holding{}
	for _, h := range holders {
		for _, sl := range sleases {
			for di, d := range dones {
				r := keyRec{Holder: h, SLease: sl, Token: uint64(len(h)) + 7, Lease: 1, Acquired: 5, Done: d, X: &trans{Assigned: h}}
				read, raw, err := checkForms(&r)
				if err != nil {
					t.Error(err)
				}
				if di != 0 {
					continue
				}
				jr, _ := decodeKey(raw)
				if o, ok := seen[read]; ok && o != (holding{jr.Holder, jr.SLease}) {
					t.Errorf("%q: one value for holdings %+v and %+v", raw, o, holding{jr.Holder, jr.SLease})
				}
				seen[read] = holding{jr.Holder, jr.SLease}
			}
		}
	}
	// What is not a record stays whole, and reads as etcd has it.
	for _, raw := range []string{"", "x", "{", `{"h":1}`, "\xc1", "\xc1\x01", "\xc1\x01\x05ab"} {
		v := compactRec([]byte(raw))
		if !v.whole() || v.b != raw {
			t.Errorf("%q kept as %q %v", raw, v.b, v.who)
		}
		if err := checkCachedValue("k/x", true, v, []byte(raw)); err != nil {
			t.Error(err)
		}
	}
}

// FuzzHoldingForms is TestHoldingFormsAgree for any holder, session
// lease and completion strings.
func FuzzHoldingForms(f *testing.F) {
	f.Add("hs-1", int64(7), uint64(1), true, "n", "failed", "next")
	f.Add("", int64(7), uint64(0), false, "", "", "")
	f.Add("a\xffb", int64(0), uint64(1<<63), true, "\xc1", "\u2028", "<&>")
	f.Fuzz(func(t *testing.T, holder string, slease int64, token uint64, withDone bool, node, errText, next string) {
		r := keyRec{Holder: holder, SLease: slease, Token: token, X: &trans{Assigned: holder}}
		if withDone {
			r.Done = &done{Node: node, Err: errText, Next: next, At: 1}
		}
		if _, _, err := checkForms(&r); err != nil {
			t.Error(err)
		}
	})
}

// checkCacheIsEtcd waits for b's cache to settle on what etcd has under
// prefix p, then holds every entry to etcd's value, as checkCachedValue
// reads it, and to its mod revision; it holds no key etcd has not. The
// data set is read at R, the cache once the watch passed R, and the data
// set again: unchanged since R, or all again.
func checkCacheIsEtcd(t *testing.T, ctx context.Context, cli *clientv3.Client, b *Backend, p, who string) {
	t.Helper()
	snapshot := func(rev int64) (map[string]*mvccpb.KeyValue, int64) {
		var opts []clientv3.OpOption
		if rev > 0 {
			opts = append(opts, clientv3.WithRev(rev))
		}
		resp, err := cli.Get(ctx, p, append(opts, clientv3.WithPrefix())...)
		if err != nil {
			t.Fatal(err)
		}
		m := map[string]*mvccpb.KeyValue{}
		for _, kv := range resp.Kvs {
			if b.rc.holds(string(kv.Key)) {
				m[string(kv.Key)] = kv
			}
		}
		return m, resp.Header.Revision
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		want, rev := snapshot(0)
		if !b.w.caughtUp(rev, 10*time.Second) {
			t.Fatalf("%s: the watch did not reach %d", who, rev)
		}
		b.rc.mu.RLock()
		got := make(map[string]cEntry, len(b.rc.m))
		for k, e := range b.rc.m {
			got[k] = e
		}
		b.rc.mu.RUnlock()
		names := mapKeys(want)
		raws := b.rc.raws(names)
		after, _ := snapshot(0)
		if !sameMods(want, after) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: the data set did not settle", who)
			}
			continue // changed meanwhile (a timer of the servers): again
		}
		var errs []string
		for i, key := range names {
			kv := want[key]
			e, ok := got[key]
			switch {
			case !ok:
				errs = append(errs, fmt.Sprintf("%s: not cached (etcd has it at %d)", key, kv.ModRevision))
				continue
			case e.mod() != kv.ModRevision:
				errs = append(errs, fmt.Sprintf("%s: cached at %d, etcd has it at %d", key, e.mod(), kv.ModRevision))
				continue
			}
			record := strings.HasPrefix(key, b.n.keys())
			if err := checkCachedValue(key, record, e.val, kv.Value); err != nil {
				errs = append(errs, err.Error())
			}
			if r := recJSON(e.val.bytes()); !bytes.Equal(raws[i], r) {
				errs = append(errs, fmt.Sprintf("%s: raws gives %q, the entry %q", key, raws[i], r))
			}
		}
		for key, e := range got {
			if want[key] == nil {
				errs = append(errs, fmt.Sprintf("%s: cached at %d, gone from etcd", key, e.mod()))
			}
		}
		for _, e := range errs {
			t.Errorf("%s: %s", who, e)
		}
		return
	}
}

func mapKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

func sameMods(a, b map[string]*mvccpb.KeyValue) bool {
	if len(a) != len(b) {
		return false
	}
	for k, kv := range a {
		if o := b[k]; o == nil || o.ModRevision != kv.ModRevision {
			return false
		}
	}
	return true
}

// TestHoldingCacheIsEtcd: after locks held under session and ttl leases,
// queues, hand-offs, failures and successes (completions), cancels and
// references, made through this server (written through, and watched) and
// another (watched only), some at once on the same keys, and values put in
// etcd that are not this server's records (a session lease without a
// holder, a holder that is not UTF-8, no record at all), this server's
// cache is etcd's data set as every reader of it reads it, and so is the
// cache a new server's list makes.
func TestHoldingCacheIsEtcd(t *testing.T) {
	p := etcdtest.Prefix(t)
	cfg := DefaultConfig()
	cfg.RefCounting = true
	cfg.SessionGrace = time.Hour
	b1, _ := countingBackend(t, p, cfg)
	b2, _ := countingBackend(t, p, cfg)
	ctx := t.Context()
	cli := etcdtest.Shared(t).Client(t)
	keys := []lock.Key{{Type: lock.Pull, Resource: "sha256:a"}, {Type: lock.Update, Resource: "sha256:a"}, {Type: lock.Pull, Resource: "r<&>\u2028"}, {Type: lock.Delete, Resource: "b"}}
	var wg sync.WaitGroup
	for w := range 6 {
		wg.Go(func() {
			node := fmt.Sprint("node-", w)
			b := []*Backend{b1, b2, b1}[w%3]
			for i := range 12 {
				k := keys[(w+i)%len(keys)]
				lease := []lock.Lease{lock.LeaseSession, lock.LeaseTTL}[(w+i)%2]
				r, err := b.TryLock(ctx, lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: node, Lease: lease})
				if err != nil {
					continue // refused by a reference rule, or a conflict: the records are what is checked
				}
				switch {
				case r.Acquired:
					_, _ = b.Unlock(ctx, lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: node, Success: i%3 == 0, Error: []string{"", "failed: \"x\" <y>", ""}[i%3]})
				case r.Queued && i%2 == 0:
					_, _ = b.Cancel(ctx, k.Type, k.Resource, node)
				}
				if i%4 == 0 {
					_, _ = b.RefAdd(ctx, k.Resource, node)
				}
				if i%4 == 2 {
					_, _ = b.RefRelease(ctx, k.Resource, node)
				}
			}
			// Each node keeps one lock: held, or waiting.
			k := keys[w%len(keys)]
			_, _ = b.TryLock(ctx, lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: node, Lease: lock.LeaseSession})
		})
	}
	wg.Wait()
	// A reference no release above takes back: the check holds one.
	if _, err := b1.RefAdd(ctx, "kept", "node-keeper"); err != nil {
		t.Fatal(err)
	}
	// Values no server writes, under keys no server reads as a lock's.
	for key, val := range map[string]string{
		"k/odd-slease":    `{"t":5,"sl":77,"q":1}`,
		"k/odd-holder":    "{\"h\":\"a\xffb\",\"t\":3,\"sl\":9,\"c\":{\"n\":\"c\xfe\",\"t\":1,\"at\":2}}",
		"k/odd-ttlholder": `{"h":"n","t":3,"l":2,"ttl":99}`,
		"k/odd-json":      `{"h":1}`,
		"k/odd-text":      "not a record",
		"k/odd-tag":       "\xc1\x01",
		"k/odd-empty":     "",
	} {
		if _, err := cli.Put(ctx, p+key, val); err != nil {
			t.Fatal(err)
		}
	}
	for key, want := range map[string]string{"k/odd-empty": "", "k/odd-holder": "a\ufffdb"} {
		resp, err := cli.Get(ctx, p+key)
		if err != nil || len(resp.Kvs) != 1 {
			t.Fatal(resp, err)
		}
		if r, err := decodeKey(resp.Kvs[0].Value); err != nil || r.Holder != want {
			t.Fatalf("%s: %+v %v", key, r, err)
		}
	}
	checkCacheIsEtcd(t, ctx, cli, b1, p, "the server of most calls")
	checkCacheIsEtcd(t, ctx, cli, b2, p, "the other server")
	b3, _ := countingBackend(t, p, cfg)
	checkCacheIsEtcd(t, ctx, cli, b3, p, "a new server's list")
	// The cache kept every kind it keeps, so that the check held them all.
	kinds := map[string]bool{}
	b3.rc.mu.RLock()
	for key, e := range b3.rc.m {
		kind, _, _ := strings.Cut(key[len(p):], "/")
		kinds[kind] = true
		if kind == "k" && !e.val.whole() {
			kinds["k, holder apart"] = true
		}
	}
	b3.rc.mu.RUnlock()
	for _, kind := range []string{"k", "k, holder apart", "s", "qn", "r"} {
		if !kinds[kind] {
			t.Errorf("no entry of kind %s cached: %v", kind, kinds)
		}
	}
}
