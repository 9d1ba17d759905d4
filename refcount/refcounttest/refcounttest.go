// Package refcounttest is the conformance suite every refcount.Storage
// passes, in the style of containerd's content testsuite: a storage's test
// calls Run with a constructor.
package refcounttest

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/refcount"
)

// Run runs the suite. newStorage returns a new, empty storage; a storage
// that keeps files puts them under t.TempDir().
func Run(t *testing.T, newStorage func(t *testing.T) refcount.Storage) {
	t.Run("GetSetDelete", func(t *testing.T) { testGetSetDelete(t, newStorage(t)) })
	t.Run("Update", func(t *testing.T) { testUpdate(t, newStorage(t)) })
	t.Run("Rules", func(t *testing.T) { testRules(t, newStorage(t)) })
	t.Run("ConcurrentUpdates", func(t *testing.T) { testConcurrent(t, newStorage(t)) })
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func nodes(t *testing.T, s refcount.Storage, res string) []string {
	t.Helper()
	r, err := s.Get(res)
	must(t, err)
	return r.Nodes
}

func testGetSetDelete(t *testing.T, s refcount.Storage) {
	if n := nodes(t, s, "sha256:none"); len(n) != 0 {
		t.Fatalf("unknown resource has %v", n)
	}
	must(t, s.Set("a", refcount.Ref{Nodes: []string{"n2", "n1", "n2"}}))
	if n := nodes(t, s, "a"); !slices.Equal(n, []string{"n1", "n2"}) {
		t.Fatalf("after Set: %v, want the sorted set", n)
	}
	must(t, s.Set("b", refcount.Ref{Nodes: []string{"n3"}}))
	must(t, s.Delete("a"))
	if n := nodes(t, s, "a"); len(n) != 0 {
		t.Fatalf("after Delete: %v", n)
	}
	if n := nodes(t, s, "b"); !slices.Equal(n, []string{"n3"}) {
		t.Fatalf("Delete touched another resource: %v", n)
	}
	must(t, s.Delete("never-there"))
	must(t, s.Set("b", refcount.Ref{}))
	if n := nodes(t, s, "b"); len(n) != 0 {
		t.Fatalf("Set of an empty Ref must delete: %v", n)
	}
}

func testUpdate(t *testing.T, s refcount.Storage) {
	boom := errors.New("boom")
	must(t, s.Set("a", refcount.Ref{Nodes: []string{"n1"}}))
	err := s.Update("a", func(r *refcount.Ref) error {
		r.Nodes = append(r.Nodes, "n9")
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("Update returned %v, want fn's error", err)
	}
	if n := nodes(t, s, "a"); !slices.Equal(n, []string{"n1"}) {
		t.Fatalf("a failed Update wrote %v", n)
	}
	must(t, s.Update("a", func(r *refcount.Ref) error {
		r.Nodes = append(r.Nodes, "n0")
		return nil
	}))
	if n := nodes(t, s, "a"); !slices.Equal(n, []string{"n0", "n1"}) {
		t.Fatalf("after Update: %v", n)
	}
}

func testRules(t *testing.T, s refcount.Storage) {
	m := refcount.NewCounter(s)
	const blob = "sha256:aaa"
	check := func(t lock.Type, want bool) func(*testing.T) {
		return func(tt *testing.T) {
			tt.Helper()
			ok, why, err := m.CanPerformOperation(t, blob)
			must(tt, err)
			if ok != want {
				tt.Fatalf("CanPerformOperation(%v) = %v (%s), want %v", t, ok, why, want)
			}
		}
	}
	if skip, _, err := m.ShouldSkipOperation(lock.Pull, blob); err != nil || skip {
		t.Fatalf("pull of an unreferenced blob: skip=%v %v", skip, err)
	}
	check(lock.Delete, true)(t)
	must(t, m.UpdateRefCount(lock.Pull, blob, "n1", false)) // failed pull: nothing
	if n := nodes(t, s, blob); len(n) != 0 {
		t.Fatalf("a failed pull referenced %v", n)
	}
	must(t, m.UpdateRefCount(lock.Pull, blob, "n1", true))
	must(t, m.UpdateRefCount(lock.Pull, blob, "n1", true)) // twice counts once
	must(t, m.Add(blob, "n2"))
	if r, _ := m.Get(blob); r.Count() != 2 || !r.Has("n1") || !r.Has("n2") {
		t.Fatalf("after pulls and an add: %v", r.Nodes)
	}
	if skip, why, _ := m.ShouldSkipOperation(lock.Pull, blob); !skip || why == "" {
		t.Fatal("pull of a referenced blob must be skipped, with a reason")
	}
	if skip, _, _ := m.ShouldSkipOperation(lock.Delete, blob); skip {
		t.Fatal("only pulls are skipped")
	}
	check(lock.Delete, false)(t)
	check(lock.Update, true)(t)
	m.UpdateRequiresNoRef = true
	check(lock.Update, false)(t)
	must(t, m.UpdateRefCount(lock.Update, blob, "n3", true)) // update changes nothing
	must(t, m.UpdateRefCount(lock.Delete, blob, "n3", false))
	if r, _ := m.Get(blob); r.Count() != 2 {
		t.Fatalf("update or failed delete changed the count: %v", r.Nodes)
	}
	must(t, m.Release(blob, "n1"))
	must(t, m.Release(blob, "n1"))
	must(t, m.Release(blob, "n2"))
	check(lock.Delete, true)(t)
	check(lock.Update, true)(t)
	must(t, m.Add(blob, "n4"))
	must(t, m.UpdateRefCount(lock.Delete, blob, "n5", true)) // delete clears
	if r, _ := m.Get(blob); r.Count() != 0 {
		t.Fatalf("after a successful delete: %v", r.Nodes)
	}
	if err := m.Add("", "n1"); !errors.Is(err, lock.ErrInvalid) {
		t.Fatalf("Add with no resource: %v", err)
	}
}

func testConcurrent(t *testing.T, s refcount.Storage) {
	const workers, each = 16, 12
	m := refcount.NewCounter(s)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range each {
				if err := m.UpdateRefCount(lock.Pull, "hot", fmt.Sprintf("n%d-%d", w, i), true); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if r, _ := m.Get("hot"); r.Count() != workers*each {
		t.Fatalf("%d concurrent adds left %d references: updates were lost", workers*each, r.Count())
	}
	for w := range workers {
		wg.Go(func() {
			for i := range each {
				if i%2 == 0 {
					if err := m.Release("hot", fmt.Sprintf("n%d-%d", w, i)); err != nil {
						t.Error(err)
					}
				}
			}
		})
	}
	wg.Wait()
	if r, _ := m.Get("hot"); r.Count() != workers*each/2 {
		t.Fatalf("after concurrent releases: %d references, want %d", r.Count(), workers*each/2)
	}
}
