package refcount

import (
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/dlock/dlock/lock"
)

// Ref is a resource's references: the set of nodes that use it. Its count
// is len(Nodes), so a node that pulls twice counts once.
type Ref struct {
	Nodes []string `json:"nodes"` // sorted, no duplicates
}

// Count is the number of nodes referencing the resource.
func (r Ref) Count() int { return len(r.Nodes) }

// Has reports whether node references the resource.
func (r Ref) Has(node string) bool {
	_, ok := slices.BinarySearch(r.Nodes, node)
	return ok
}

// add inserts node, keeping Nodes sorted; it reports whether r changed.
func (r *Ref) add(node string) bool {
	i, ok := slices.BinarySearch(r.Nodes, node)
	if ok {
		return false
	}
	r.Nodes = slices.Insert(r.Nodes, i, node)
	return true
}

func (r *Ref) remove(node string) bool {
	i, ok := slices.BinarySearch(r.Nodes, node)
	if !ok {
		return false
	}
	r.Nodes = slices.Delete(r.Nodes, i, i+1)
	return true
}

// Storage keeps references. Implementations are safe for concurrent use;
// the file and bbolt ones also across processes on one machine.
type Storage interface {
	// Get returns a resource's references; an unknown resource has none.
	Get(resource string) (Ref, error)
	// Set replaces a resource's references; an empty Ref deletes them.
	Set(resource string, ref Ref) error
	// Delete removes a resource's references.
	Delete(resource string) error
	// Update reads, changes and writes a resource's references as one
	// atomic step: concurrent updates, also from other processes, are
	// never lost. If fn returns an error nothing is written.
	Update(resource string, fn func(*Ref) error) error
}

// Errors of the package.
var (
	// ErrCorrupt is a storage file that cannot be read as references. It
	// is never reset silently: a lost reference lets a blob in use be deleted.
	ErrCorrupt = errors.New("refcount: storage is corrupt")
	// ErrNetworkFS is a file or bbolt storage on a network filesystem,
	// where flock and mmap do not protect it across machines.
	ErrNetworkFS = errors.New("refcount: storage path is on a network filesystem")
)

// Counter applies the reference-count rules (docs/DESIGN.md, "Reference rules") to a Storage. The
// rules are the lock package's, which the server applies too, so client-side
// and server-side counting never disagree.
type Counter struct {
	Storage Storage
	// UpdateRequiresNoRef refuses updates of a referenced resource.
	UpdateRequiresNoRef bool
}

// NewCounter returns a Counter over s.
func NewCounter(s Storage) *Counter { return &Counter{Storage: s} }

// ShouldSkipOperation reports whether the operation need not run: a pull of
// a resource some node already references (the blob is there).
func (m *Counter) ShouldSkipOperation(t lock.Type, resource string) (bool, string, error) {
	if t != lock.Pull {
		return false, "", nil
	}
	ref, err := m.Storage.Get(resource)
	if err != nil {
		return false, "", err
	}
	if ref.Count() > 0 {
		return true, fmt.Sprintf("resource is referenced by %d node(s)", ref.Count()), nil
	}
	return false, "", nil
}

// CanPerformOperation reports whether the operation may run now: a delete
// only when nothing references the resource, an update likewise when
// UpdateRequiresNoRef. The reason says why not.
func (m *Counter) CanPerformOperation(t lock.Type, resource string) (bool, string, error) {
	ref, err := m.Storage.Get(resource)
	if err != nil {
		return false, "", err
	}
	if err := lock.RefPermits(t, ref.Count(), m.UpdateRequiresNoRef); err != nil {
		return false, err.Error(), nil
	}
	return true, "", nil
}

// UpdateRefCount records a completed operation: a successful pull adds node,
// a successful delete clears the resource, anything else changes nothing.
// Call it before unlocking, so that no waiter is told "done" before the
// reference exists (docs/DESIGN.md, "Reference rules").
func (m *Counter) UpdateRefCount(t lock.Type, resource, node string, success bool) error {
	switch lock.RefEffectOf(t, success) {
	case lock.RefAddNode:
		return m.Add(resource, node)
	case lock.RefClear:
		return m.Storage.Delete(resource)
	}
	return nil
}

// Add records that node uses resource, also one it did not pull itself.
func (m *Counter) Add(resource, node string) error {
	if err := validate(resource, node); err != nil {
		return err
	}
	return m.Storage.Update(resource, func(r *Ref) error { r.add(node); return nil })
}

// Release records that node no longer uses resource.
func (m *Counter) Release(resource, node string) error {
	if err := validate(resource, node); err != nil {
		return err
	}
	return m.Storage.Update(resource, func(r *Ref) error { r.remove(node); return nil })
}

// Get returns a resource's references.
func (m *Counter) Get(resource string) (Ref, error) { return m.Storage.Get(resource) }

func validate(resource, node string) error {
	if err := lock.ValidateResource(resource); err != nil {
		return err
	}
	return lock.ValidateNode(node)
}

// Memory is an in-memory Storage for one process.
type Memory struct {
	mu   sync.Mutex
	refs map[string]Ref
}

// NewMemory returns an empty in-memory Storage.
func NewMemory() *Memory { return &Memory{refs: make(map[string]Ref)} }

func (s *Memory) Get(resource string) (Ref, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return Ref{Nodes: slices.Clone(s.refs[resource].Nodes)}, nil
}

func (s *Memory) Set(resource string, ref Ref) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.setLocked(resource, ref)
	return nil
}

func (s *Memory) setLocked(resource string, ref Ref) {
	if ref.Count() == 0 {
		delete(s.refs, resource)
		return
	}
	s.refs[resource] = normalized(ref)
}

func (s *Memory) Delete(resource string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.refs, resource)
	return nil
}

func (s *Memory) Update(resource string, fn func(*Ref) error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := Ref{Nodes: slices.Clone(s.refs[resource].Nodes)}
	if err := fn(&r); err != nil {
		return err
	}
	s.setLocked(resource, r)
	return nil
}

// normalized returns a sorted copy of ref without duplicates.
func normalized(ref Ref) Ref {
	n := slices.Clone(ref.Nodes)
	slices.Sort(n)
	return Ref{Nodes: slices.Compact(n)}
}
