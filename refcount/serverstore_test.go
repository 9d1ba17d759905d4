package refcount

import (
	"context"
	"path/filepath"
	"slices"
	"testing"

	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/memory"
)

func TestServerStore(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "refs.db")
	s, err := OpenServerStore(path)
	if err != nil {
		t.Fatal(err)
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(s.Save(ctx, "a", memory.RefRecord{Nodes: []string{"n1", "n2"}, Version: 2}))
	must(s.Save(ctx, "a", memory.RefRecord{Nodes: []string{"n1"}, Version: 1})) // older: ignored
	must(s.Save(ctx, "b", memory.RefRecord{Nodes: []string{"n3"}, Version: 3}))
	must(s.Save(ctx, "b", memory.RefRecord{Version: 4}))                        // cleared
	must(s.Save(ctx, "b", memory.RefRecord{Nodes: []string{"n3"}, Version: 3})) // late, older: must not resurrect
	must(s.Close())

	s, err = OpenServerStore(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	refs, maxV, err := s.Load(ctx)
	must(err)
	if maxV != 4 || len(refs) != 1 || !slices.Equal(refs["a"].Nodes, []string{"n1", "n2"}) {
		t.Fatalf("after reopening: %v, max version %d", refs, maxV)
	}
	// The tombstone is gone, but the version survives it.
	_, maxV, err = s.Load(ctx)
	must(err)
	if maxV != 4 {
		t.Fatalf("max version after dropping tombstones: %d", maxV)
	}
}

// A manager restarted over the same database forgets no reference.
func TestServerStoreWithMemory(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "refs.db")
	open := func() (*memory.Backend, *ServerStore) {
		s, err := OpenServerStore(path)
		if err != nil {
			t.Fatal(err)
		}
		cfg := memory.DefaultConfig()
		cfg.RefStore = s
		m, err := memory.New(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		return m, s
	}
	m, s := open()
	if _, err := m.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: "blob", Node: "a"}); err != nil {
		t.Fatal(err)
	}
	if _, err := m.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: "blob", Node: "b"}); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: "blob", Node: "a", Success: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := m.RefAdd(ctx, "other", "c"); err != nil {
		t.Fatal(err)
	}
	m.Close()
	s.Close()

	m, s = open()
	defer s.Close()
	defer m.Close()
	rc, err := m.RefCount(t.Context(), "blob")
	if err != nil || !slices.Equal(rc.Nodes, []string{"a", "b"}) {
		t.Fatalf("after restart: %+v %v", rc, err)
	}
	if _, err := m.TryLock(ctx, lock.LockRequest{Type: lock.Delete, Resource: "other", Node: "d"}); err == nil {
		t.Fatal("delete of a resource referenced before the restart was allowed")
	}
}
