package locktest

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/dlock/dlock/lock"
)

// Server-side reference counting (docs/DESIGN.md, "Reference counting").

var refTests = []test{
	{name: "Rules", run: testRefCountRules},
	{name: "UpdateRequiresNoRef", run: testRefCountUpdateRequiresNoRef},
	{name: "Off", run: testRefCountOff},
}

func refConfig(updNoRef bool) func(*Config) {
	return func(c *Config) { c.RefCounting = true; c.UpdateRequiresNoRef = updNoRef }
}

func testRefCountRules(t *testing.T, s *suite) {
	ctx := context.Background()
	m := s.open(t, refConfig(false))
	if !m.Info().RefCounting {
		t.Fatalf("Info %+v with RefCounting, want reference counting", m.Info())
	}
	mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	mustLock(t, m, lockReq(lock.Pull, "r", "b"))
	mustLock(t, m, lockReq(lock.Pull, "r", "c"))
	if _, err := m.TryLock(ctx, lockReq(lock.Delete, "r", "d")); !errors.Is(err, lock.ErrInUse) {
		t.Fatalf("delete while a pull is held: %v, want ErrInUse", err)
	}
	mustUnlock(t, m, lock.Pull, "r", "a", true)
	if got := refNodes(t, m, "r"); !slices.Equal(got, []string{"a", "b", "c"}) {
		t.Fatalf("pull success references %v, want the holder and every skipped waiter", got)
	}
	if rc, err := m.RefCount(ctx, "r"); err != nil || rc.Resource != "r" || rc.Count() != 3 {
		t.Fatalf("RefCount %+v %v", rc, err)
	}
	if _, err := m.TryLock(ctx, lockReq(lock.Delete, "r", "d")); !errors.Is(err, lock.ErrInUse) {
		t.Fatalf("delete of a referenced resource: %v, want ErrInUse", err)
	}
	// Update is free without update_requires_no_ref, and changes nothing.
	mustLock(t, m, lockReq(lock.Update, "r", "u"))
	mustUnlock(t, m, lock.Update, "r", "u", true)
	for _, n := range []string{"a", "b", "c"} {
		if _, err := m.RefRelease(ctx, "r", n); err != nil {
			t.Fatal(err)
		}
	}
	if got := refNodes(t, m, "r"); len(got) != 0 {
		t.Fatalf("after releases: %v", got)
	}
	if rc, err := m.RefRelease(ctx, "r", "a"); err != nil || rc.Count() != 0 {
		t.Fatalf("a repeated release: %+v %v, want no error and no reference", rc, err)
	}
	// Unreferenced, a delete still never runs beside an update.
	mustLock(t, m, lockReq(lock.Update, "r", "u"))
	if _, err := m.TryLock(ctx, lockReq(lock.Delete, "r", "d")); !errors.Is(err, lock.ErrInUse) {
		t.Fatalf("delete while an update is held: %v, want ErrInUse", err)
	}
	mustUnlock(t, m, lock.Update, "r", "u", true)
	mustLock(t, m, lockReq(lock.Delete, "r", "d"))
	for _, typ := range []lock.Type{lock.Pull, lock.Update} {
		if _, err := m.TryLock(ctx, lockReq(typ, "r", "x")); !errors.Is(err, lock.ErrDeleting) {
			t.Fatalf("%v while deleting: %v, want ErrDeleting", typ, err)
		}
	}
	if _, err := m.RefAdd(ctx, "r", "x"); !errors.Is(err, lock.ErrDeleting) {
		t.Fatalf("refcount add while deleting: %v, want ErrDeleting", err)
	}
	mustUnlock(t, m, lock.Delete, "r", "d", true)
	if rc, err := m.RefAdd(ctx, "r", "x"); err != nil || !slices.Equal(rc.Nodes, []string{"x"}) {
		t.Fatalf("add after delete: %+v %v", rc, err)
	}
	if rc, _ := m.RefAdd(ctx, "r", "x"); rc.Count() != 1 {
		t.Fatalf("a repeated add counted twice: %+v", rc)
	}
	// A failed pull changes nothing.
	mustLock(t, m, lockReq(lock.Pull, "r", "y"))
	mustUnlock(t, m, lock.Pull, "r", "y", false)
	if got := refNodes(t, m, "r"); !slices.Equal(got, []string{"x"}) {
		t.Fatalf("after a failed pull: %v", got)
	}
	mustLock(t, m, lockReq(lock.Pull, "other", "x"))
	mustUnlock(t, m, lock.Pull, "other", "x", true)
	if n, err := m.RefReleaseNode(ctx, "x"); err != nil || n != 2 {
		t.Fatalf("release-all: %d %v, want 2", n, err)
	}
	if got, other := refNodes(t, m, "r"), refNodes(t, m, "other"); len(got)+len(other) != 0 {
		t.Fatalf("after release-all: r %v, other %v", got, other)
	}
	// Durable: a restart forgets nothing.
	mustLock(t, m, lockReq(lock.Pull, "kept", "k"))
	mustUnlock(t, m, lock.Pull, "kept", "k", true)
	m = s.restart(t, m, refConfig(false))
	if got := refNodes(t, m, "kept"); !slices.Equal(got, []string{"k"}) {
		t.Fatalf("after restart: %v", got)
	}
	if got := refNodes(t, m, "r"); len(got) != 0 {
		t.Fatalf("released references came back: %v", got)
	}
}

func testRefCountUpdateRequiresNoRef(t *testing.T, s *suite) {
	ctx := context.Background()
	m := s.open(t, refConfig(true))
	mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	if _, err := m.TryLock(ctx, lockReq(lock.Update, "r", "u")); !errors.Is(err, lock.ErrInUse) {
		t.Fatalf("update while a pull is held: %v, want ErrInUse", err)
	}
	mustUnlock(t, m, lock.Pull, "r", "a", true)
	if _, err := m.TryLock(ctx, lockReq(lock.Update, "r", "u")); !errors.Is(err, lock.ErrInUse) {
		t.Fatalf("update of a referenced resource: %v, want ErrInUse", err)
	}
	if _, err := m.RefRelease(ctx, "r", "a"); err != nil {
		t.Fatal(err)
	}
	mustLock(t, m, lockReq(lock.Update, "r", "u"))
	if _, err := m.TryLock(ctx, lockReq(lock.Pull, "r", "p")); !errors.Is(err, lock.ErrUpdating) {
		t.Fatalf("pull while updating: %v, want ErrUpdating", err)
	}
	if _, err := m.RefAdd(ctx, "r", "p"); !errors.Is(err, lock.ErrUpdating) {
		t.Fatalf("add while updating: %v, want ErrUpdating", err)
	}
	if _, err := m.TryLock(ctx, lockReq(lock.Delete, "r", "d")); !errors.Is(err, lock.ErrInUse) {
		t.Fatalf("delete while updating: %v, want ErrInUse", err)
	}
	mustUnlock(t, m, lock.Update, "r", "u", true)
	if rc, err := m.RefAdd(ctx, "r", "p"); err != nil || rc.Count() != 1 {
		t.Fatalf("add after the update: %+v %v", rc, err)
	}
}

func testRefCountOff(t *testing.T, s *suite) {
	ctx := context.Background()
	m := s.open(t, nil)
	if _, err := m.RefCount(ctx, "r"); !errors.Is(err, lock.ErrRefCountOff) {
		t.Fatalf("RefCount: %v, want ErrRefCountOff", err)
	}
	if _, err := m.RefAdd(ctx, "r", "a"); !errors.Is(err, lock.ErrRefCountOff) {
		t.Fatalf("RefAdd: %v, want ErrRefCountOff", err)
	}
	if _, err := m.RefRelease(ctx, "r", "a"); !errors.Is(err, lock.ErrRefCountOff) {
		t.Fatalf("RefRelease: %v, want ErrRefCountOff", err)
	}
	if _, err := m.RefReleaseNode(ctx, "a"); !errors.Is(err, lock.ErrRefCountOff) {
		t.Fatalf("RefReleaseNode: %v, want ErrRefCountOff", err)
	}
	mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	if r := mustLock(t, m, lockReq(lock.Delete, "r", "b")); !r.Acquired { // types are independent without refcount
		t.Fatalf("delete beside a pull without reference counting: %+v", r)
	}
	mustUnlock(t, m, lock.Pull, "r", "a", true)
	if r := mustLock(t, m, lockReq(lock.Update, "r", "c")); !r.Acquired {
		t.Fatalf("update beside a delete without reference counting: %+v", r)
	}
}
