package etcd

import (
	"testing"

	"github.com/dlock/dlock/lock"
)

// TestDonesStayBounded: a key that completes again and again, while the
// completion records stay under the cap, does not grow the heap of
// completion records by one entry a completion (a server that ran for
// months would have held every completion it ever saw), and the live
// record stays in it.
func TestDonesStayBounded(t *testing.T) {
	b := &Backend{cfg: DefaultConfig()}
	b.rc = newRecCache(b.n)
	w := newWatcher(b)
	k := lock.Key{Type: lock.Pull, Resource: "sha256:hot"}
	const n = 20000
	for i := range n {
		w.track(change{k: k, rec: keyRec{Token: uint64(i + 1), Done: &done{Node: "n", Token: uint64(i + 1), OK: true, At: int64(i + 1), Unlock: true}}})
	}
	if w.nDone != 1 {
		t.Fatalf("%d completion records counted, want 1", w.nDone)
	}
	if len(w.dones) > 2*w.nDone+1024 {
		t.Fatalf("the heap holds %d entries after %d completions of one key", len(w.dones), n)
	}
	live := false
	for _, d := range w.dones {
		live = live || d.k == k && d.at == n
	}
	if !live {
		t.Fatal("the live completion record left the heap")
	}
}
