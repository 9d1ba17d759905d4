package memory

import (
	"context"
	"fmt"
	"maps"
	"slices"

	"github.com/dlock/dlock/lock"
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

type refState struct {
	nodes map[string]struct{}
}

type refSave struct {
	resource string
	rec      RefRecord
}

func (m *Backend) loadRefs(ctx context.Context) error {
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

func (s *shard) heldBy(t lock.Type, resource string) bool {
	ks := s.key(lock.Key{Type: t, Resource: resource})
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
func (s *shard) refConflict(k lock.Key) error {
	res := k.Resource
	updNoRef := s.m.cfg.UpdateRequiresNoRef
	switch k.Type {
	case lock.Delete:
		if err := lock.RefPermits(lock.Delete, s.refCount(res), updNoRef); err != nil {
			return err
		}
		if s.heldBy(lock.Pull, res) || s.heldBy(lock.Update, res) {
			return fmt.Errorf("%w: a pull or update of it is running", lock.ErrInUse)
		}
	case lock.Pull:
		if s.heldBy(lock.Delete, res) {
			return lock.ErrDeleting
		}
		if updNoRef && s.heldBy(lock.Update, res) {
			return lock.ErrUpdating
		}
	case lock.Update:
		if s.heldBy(lock.Delete, res) {
			return lock.ErrDeleting
		}
		if err := lock.RefPermits(lock.Update, s.refCount(res), updNoRef); err != nil {
			return err
		}
		if updNoRef && s.heldBy(lock.Pull, res) {
			return fmt.Errorf("%w: a pull of it is running", lock.ErrInUse)
		}
	}
	return nil
}

// refsCompleted applies a successful pull or delete to the references: the
// holder and every waiter it skipped now have the blob.
func (s *shard) refsCompleted(t *txn, h *entry, waiters []*entry) {
	res := h.ks.res
	switch lock.RefEffectOf(h.ks.typ, true) {
	case lock.RefAddNode:
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
	case lock.RefClear:
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

func (m *Backend) persist(ctx context.Context, saves []refSave) error {
	for _, sv := range saves {
		if err := m.cfg.RefStore.Save(ctx, sv.resource, sv.rec); err != nil {
			m.log.Error("saving references failed", "resource_id", sv.resource, "err", err)
			return fmt.Errorf("lock: saving references of %s: %w", sv.resource, err)
		}
	}
	return nil
}

func (m *Backend) refShard(resource string) (*shard, error) {
	if m.cfg.RefStore == nil {
		return nil, lock.ErrRefCountOff
	}
	if err := lock.ValidateResource(resource); err != nil {
		return nil, err
	}
	if m.closed.Load() {
		return nil, lock.ErrClosed
	}
	return m.shardFor(resource), nil
}

func (s *shard) refCountLocked(resource string) lock.RefCount {
	rc := lock.RefCount{Resource: resource}
	if rs := s.refs[resource]; rs != nil {
		rc.Nodes = slices.Sorted(maps.Keys(rs.nodes))
	}
	return rc
}

// RefCount returns a resource's references.
func (m *Backend) RefCount(ctx context.Context, resource string) (lock.RefCount, error) {
	if err := ctx.Err(); err != nil {
		return lock.RefCount{}, err
	}
	s, err := m.refShard(resource)
	if err != nil {
		return lock.RefCount{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.refCountLocked(resource), nil
}

// RefAdd records that node uses resource (a blob it did not pull itself). It
// is refused with ErrDeleting while a delete of the resource is held, and
// with ErrUpdating while an update is held and UpdateRequiresNoRef is set.
func (m *Backend) RefAdd(ctx context.Context, resource, node string) (lock.RefCount, error) {
	s, err := m.refShard(resource)
	if err != nil {
		return lock.RefCount{}, err
	}
	if err := lock.ValidateNode(node); err != nil {
		return lock.RefCount{}, err
	}
	s.mu.Lock()
	if s.heldBy(lock.Delete, resource) {
		s.mu.Unlock()
		return lock.RefCount{}, lock.ErrDeleting
	}
	if m.cfg.UpdateRequiresNoRef && s.heldBy(lock.Update, resource) {
		s.mu.Unlock()
		return lock.RefCount{}, lock.ErrUpdating
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
func (m *Backend) RefRelease(ctx context.Context, resource, node string) (lock.RefCount, error) {
	s, err := m.refShard(resource)
	if err != nil {
		return lock.RefCount{}, err
	}
	if err := lock.ValidateNode(node); err != nil {
		return lock.RefCount{}, err
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
func (m *Backend) RefReleaseNode(ctx context.Context, node string) (int, error) {
	if m.cfg.RefStore == nil {
		return 0, lock.ErrRefCountOff
	}
	if err := lock.ValidateNode(node); err != nil {
		return 0, err
	}
	if m.closed.Load() {
		return 0, lock.ErrClosed
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
