package etcd

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
)

// TestTypeFromAnotherServer: a key whose type another server of the data
// set took from a caller — a name this process has never parsed — is named
// and served all the same, found by the list at start and by the watch
// after it (docs/DESIGN.md, "Other types"). Its records are written here as
// that server's TryLock writes them, since in this process any TryLock of
// the type would have taken the name already.
func TestTypeFromAnotherServer(t *testing.T) {
	// Names of this run's own (-count runs it again in the same process).
	run := rand.Uint32()
	listed, watched := fmt.Sprintf("listed-%08x", run), fmt.Sprintf("watched-%08x", run)
	for _, name := range []string{listed, watched} {
		if _, ok := lock.LookupType(name); ok {
			t.Fatalf("this process knows %q already: the test needs a name nothing else parses", name)
		}
	}
	srv := etcdtest.Shared(t)
	cli := srv.Client(t)
	cfg := DefaultConfig()
	cfg.Prefix = etcdtest.Prefix(t)
	n := names{p: cfg.Prefix}
	ctx := context.Background()
	hold := func(typ string) {
		t.Helper()
		now := time.Now()
		rec := keyRec{Holder: "a", Token: 7, Lease: uint8(lock.LeaseTTL), Acquired: now.UnixNano(), TTL: now.Add(time.Hour).UnixNano()}
		if _, err := cli.Put(ctx, n.keys()+typ+"/"+esc("sha256:aa"), encode(&rec)); err != nil {
			t.Fatal(err)
		}
	}
	hold(listed)
	b, err := New(ctx, cli, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	hold(watched)
	kit.WaitFor(t, "the watch to bring the second type", func() bool {
		_, ok := lock.LookupType(watched)
		return ok
	})
	for _, name := range []string{listed, watched} {
		typ, ok := lock.LookupType(name)
		if !ok {
			t.Fatalf("%s: the backend never named its key", name)
		}
		st, err := b.Status(ctx, typ, "sha256:aa", "")
		if err != nil || !st.Held || st.Holder != "a" || st.Token != 7 {
			t.Fatalf("%s: status %+v %v, want held by a with token 7", name, st, err)
		}
		if r, err := b.TryLock(ctx, lock.LockRequest{Type: typ, Resource: "sha256:aa", Node: "b", Lease: lock.LeaseTTL}); err != nil || !r.Queued {
			t.Fatalf("%s: b asks: %+v %v, want queued", name, r, err)
		}
		if u, err := b.Unlock(ctx, lock.UnlockRequest{Type: typ, Resource: "sha256:aa", Node: "a", Error: "failed"}); err != nil || u.NextHolder != "b" {
			t.Fatalf("%s: a fails: %+v %v, want b next", name, u, err)
		}
	}
	// The operators' view walks them, by name.
	page, err := b.InspectKeys(ctx, lock.KeyQuery{})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, v := range page.Keys {
		got = append(got, v.Key.String()+" "+v.Holder)
	}
	if want := []string{listed + ":sha256:aa b", watched + ":sha256:aa b"}; len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("keys %q, want %q", got, want)
	}
}
