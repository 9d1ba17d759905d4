package lock

import (
	"context"
	"fmt"
	"maps"
	"slices"
)

// RefRecord is the durable form of one resource's references.
type RefRecord struct {
	Nodes []string // sorted; empty once the resource's references are gone
	// Version orders changes: a store keeps the record with the highest
	// version, so changes committed out of order never undo a later one.
	Version uint64
}

// RefStore makes server-side references durable. Save must be atomic and must
// ignore a record whose Version is not above the stored one; Load returns the
// non-empty records and the highest version ever saved.
type RefStore interface {
	Load(ctx context.Context) (refs map[string]RefRecord, maxVersion uint64, err error)
	Save(ctx context.Context, resource string, rec RefRecord) error
}

// RefCount is a resource's reference count: the set of nodes using it.
type RefCount struct {
	Resource string
	Nodes    []string // sorted
}

// Count is the number of nodes referencing the resource.
func (r RefCount) Count() int { return len(r.Nodes) }

// RefPermits is the reference-count rule for starting an operation (docs/DESIGN.md, "Reference rules"):
// delete only when nothing references the resource; update likewise when
// updateRequiresNoRef; pull always.
func RefPermits(t Type, count int, updateRequiresNoRef bool) error {
	if count > 0 && (t == Delete || (t == Update && updateRequiresNoRef)) {
		return fmt.Errorf("%w: %d node(s) reference it", ErrInUse, count)
	}
	return nil
}

// RefEffect is the reference-count rule for a completed operation (docs/DESIGN.md, "Reference rules"):
// a successful pull adds its node, a successful delete clears the resource,
// anything else changes nothing.
type RefEffect uint8

// The effects of RefEffectOf.
const (
	RefNone RefEffect = iota
	RefAddNode
	RefClear
)

// RefEffectOf returns what completing an operation does to the references.
func RefEffectOf(t Type, success bool) RefEffect {
	switch {
	case !success:
		return RefNone
	case t == Pull:
		return RefAddNode
	case t == Delete:
		return RefClear
	}
	return RefNone
}

type refState struct {
	nodes map[string]struct{}
}

type refSave struct {
	resource string
	rec      RefRecord
}

func (m *Memory) loadRefs(ctx context.Context) error {
	refs, maxVersion, err := m.cfg.RefStore.Load(ctx)
	if err != nil {
		return fmt.Errorf("lock: loading references: %w", err)
	}
	m.refVersion.Store(maxVersion)
	for res, rec := range refs {
		if len(rec.Nodes) == 0 {
			continue
		}
		rs := &refState{nodes: make(map[string]struct{}, len(rec.Nodes))}
		for _, n := range rec.Nodes {
			rs.nodes[n] = struct{}{}
		}
		m.shardFor(res).refs[res] = rs
	}
	return nil
}

func (s *shard) heldBy(t Type, resource string) bool {
	ks := s.key(Key{t, resource})
	return ks != nil && ks.holder != nil
}

func (s *shard) refCount(resource string) int {
	if rs := s.refs[resource]; rs != nil {
		return len(rs.nodes)
	}
	return 0
}

// refConflict applies the exclusions of docs/DESIGN.md ("Reference rules") to a new lock of k: a delete must
// never run beside a pull or an update of its resource, and with
// UpdateRequiresNoRef neither may an update beside a pull.
func (s *shard) refConflict(k Key) error {
	res := k.Resource
	updNoRef := s.m.cfg.UpdateRequiresNoRef
	switch k.Type {
	case Delete:
		if err := RefPermits(Delete, s.refCount(res), updNoRef); err != nil {
			return err
		}
		if s.heldBy(Pull, res) || s.heldBy(Update, res) {
			return fmt.Errorf("%w: a pull or update of it is running", ErrInUse)
		}
	case Pull:
		if s.heldBy(Delete, res) {
			return ErrDeleting
		}
		if updNoRef && s.heldBy(Update, res) {
			return ErrUpdating
		}
	case Update:
		if s.heldBy(Delete, res) {
			return ErrDeleting
		}
		if err := RefPermits(Update, s.refCount(res), updNoRef); err != nil {
			return err
		}
		if updNoRef && s.heldBy(Pull, res) {
			return fmt.Errorf("%w: a pull of it is running", ErrInUse)
		}
	}
	return nil
}

// refsCompleted applies a successful pull or delete to the references: the
// holder and every waiter it skipped now have the blob.
func (s *shard) refsCompleted(t *txn, h *entry, waiters []*entry) {
	res := h.ks.res
	switch RefEffectOf(h.ks.typ, true) {
	case RefAddNode:
		rs := s.refs[res]
		if rs == nil {
			rs = &refState{nodes: make(map[string]struct{}, 1+len(waiters))}
			s.refs[res] = rs
		}
		rs.nodes[h.node()] = struct{}{}
		for _, w := range waiters {
			rs.nodes[w.node()] = struct{}{}
		}
		s.refChanged(t, res, rs)
	case RefClear:
		if s.refs[res] != nil {
			delete(s.refs, res)
			s.refChanged(t, res, nil)
		}
	}
}

// refChanged queues the durable save of a resource's new references.
func (s *shard) refChanged(t *txn, res string, rs *refState) {
	rec := RefRecord{Version: s.m.refVersion.Add(1)}
	if rs != nil {
		rec.Nodes = slices.Sorted(maps.Keys(rs.nodes))
	}
	t.saves = append(t.saves, refSave{res, rec})
}

func (m *Memory) persist(ctx context.Context, saves []refSave) error {
	for _, sv := range saves {
		if err := m.cfg.RefStore.Save(ctx, sv.resource, sv.rec); err != nil {
			m.log.Error("saving references failed", "resource_id", sv.resource, "err", err)
			return fmt.Errorf("lock: saving references of %s: %w", sv.resource, err)
		}
	}
	return nil
}

func (m *Memory) refShard(resource string) (*shard, error) {
	if m.cfg.RefStore == nil {
		return nil, ErrRefCountOff
	}
	if err := ValidateResource(resource); err != nil {
		return nil, err
	}
	if m.closed.Load() {
		return nil, ErrClosed
	}
	return m.shardFor(resource), nil
}

func (s *shard) refCountLocked(resource string) RefCount {
	rc := RefCount{Resource: resource}
	if rs := s.refs[resource]; rs != nil {
		rc.Nodes = slices.Sorted(maps.Keys(rs.nodes))
	}
	return rc
}

// RefCount returns a resource's references.
func (m *Memory) RefCount(ctx context.Context, resource string) (RefCount, error) {
	if err := ctx.Err(); err != nil {
		return RefCount{}, err
	}
	s, err := m.refShard(resource)
	if err != nil {
		return RefCount{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.refCountLocked(resource), nil
}

// RefAdd records that node uses resource (a blob it did not pull itself). It
// is refused with ErrDeleting while a delete of the resource is held, and
// with ErrUpdating while an update is held and UpdateRequiresNoRef is set.
func (m *Memory) RefAdd(ctx context.Context, resource, node string) (RefCount, error) {
	s, err := m.refShard(resource)
	if err != nil {
		return RefCount{}, err
	}
	if err := ValidateNode(node); err != nil {
		return RefCount{}, err
	}
	s.mu.Lock()
	if s.heldBy(Delete, resource) {
		s.mu.Unlock()
		return RefCount{}, ErrDeleting
	}
	if m.cfg.UpdateRequiresNoRef && s.heldBy(Update, resource) {
		s.mu.Unlock()
		return RefCount{}, ErrUpdating
	}
	t := txn{}
	rs := s.refs[resource]
	if rs == nil {
		rs = &refState{nodes: make(map[string]struct{}, 1)}
		s.refs[resource] = rs
	}
	if _, ok := rs.nodes[node]; !ok {
		rs.nodes[node] = struct{}{}
		s.refChanged(&t, resource, rs)
	}
	rc := s.refCountLocked(resource)
	return rc, s.commit(ctx, t)
}

// RefRelease records that node no longer uses resource.
func (m *Memory) RefRelease(ctx context.Context, resource, node string) (RefCount, error) {
	s, err := m.refShard(resource)
	if err != nil {
		return RefCount{}, err
	}
	if err := ValidateNode(node); err != nil {
		return RefCount{}, err
	}
	s.mu.Lock()
	t := txn{}
	s.releaseRef(&t, resource, node)
	rc := s.refCountLocked(resource)
	return rc, s.commit(ctx, t)
}

func (s *shard) releaseRef(t *txn, resource, node string) {
	rs := s.refs[resource]
	if rs == nil {
		return
	}
	if _, ok := rs.nodes[node]; !ok {
		return
	}
	delete(rs.nodes, node)
	if len(rs.nodes) == 0 {
		delete(s.refs, resource)
		rs = nil
	}
	s.refChanged(t, resource, rs)
}

// RefReleaseNode releases every reference of node (a decommissioned node) and
// returns how many it had.
func (m *Memory) RefReleaseNode(ctx context.Context, node string) (int, error) {
	if m.cfg.RefStore == nil {
		return 0, ErrRefCountOff
	}
	if err := ValidateNode(node); err != nil {
		return 0, err
	}
	if m.closed.Load() {
		return 0, ErrClosed
	}
	n := 0
	for _, s := range m.shards {
		s.mu.Lock()
		t := txn{}
		for res, rs := range s.refs {
			if _, ok := rs.nodes[node]; ok {
				s.releaseRef(&t, res, node)
				n++
			}
		}
		if err := s.commit(ctx, t); err != nil {
			return n, err
		}
	}
	return n, nil
}
