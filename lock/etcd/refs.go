package etcd

import (
	"context"
	"fmt"
	"slices"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/lock"
)

// The references of a resource are one record, P/r/<res>, changed in the
// same transaction as the key whose rules read it (docs/DESIGN.md,
// "Reference rules"). A success that skips ten thousand waiters is one
// write, however many nodes it adds.

func (b *Backend) refsOn() error {
	if err := b.alive(); err != nil {
		return err
	}
	if !b.refCounting {
		return lock.ErrRefCountOff
	}
	return nil
}

// RefCount returns the nodes referencing resource.
func (b *Backend) RefCount(ctx context.Context, resource string) (lock.RefCount, error) {
	if err := lock.ValidateResource(resource); err != nil {
		return lock.RefCount{}, err
	}
	if err := b.refsOn(); err != nil {
		return lock.RefCount{}, err
	}
	bctx, cancel := b.bound(ctx)
	defer cancel()
	resp, err := b.cli.Get(bctx, b.n.ref(resource))
	if err != nil {
		return lock.RefCount{}, b.boundErr(ctx, bctx, b.etcdErr("reading references", err))
	}
	rc := lock.RefCount{Resource: resource}
	if len(resp.Kvs) > 0 {
		var r refRec
		if err := jsonUnmarshal(resp.Kvs[0].Value, &r); err != nil {
			return lock.RefCount{}, err
		}
		rc.Nodes = r.Nodes
	}
	return rc, nil
}

// RefAdd adds node to resource's references; refused while a delete (or,
// with UpdateRequiresNoRef, an update) of it is held.
func (b *Backend) RefAdd(ctx context.Context, resource, node string) (lock.RefCount, error) {
	return b.refChange(ctx, resource, node, true)
}

// RefRelease removes node from resource's references.
func (b *Backend) RefRelease(ctx context.Context, resource, node string) (lock.RefCount, error) {
	return b.refChange(ctx, resource, node, false)
}

func (b *Backend) refChange(ctx context.Context, resource, node string, add bool) (lock.RefCount, error) {
	if err := lock.ValidateResource(resource); err != nil {
		return lock.RefCount{}, err
	}
	if err := lock.ValidateNode(node); err != nil {
		return lock.RefCount{}, err
	}
	if err := b.refsOn(); err != nil {
		return lock.RefCount{}, err
	}
	var out lock.RefCount
	// The pull key's stripe and record guard nothing here; run reads the
	// delete and update records as siblings.
	_, err := b.run(ctx, lock.Key{Type: lock.Pull, Resource: resource}, func(t *tx) error {
		r, err := t.refs()
		if err != nil {
			return err
		}
		nodes := slices.Clone(r.Nodes)
		i, found := slices.BinarySearch(nodes, node)
		if add {
			if del, err := t.sibling(lock.Delete); err != nil {
				return err
			} else if del.held() {
				return lock.ErrDeleting
			}
			if b.cfg.UpdateRequiresNoRef {
				if upd, err := t.sibling(lock.Update); err != nil {
					return err
				} else if upd.held() {
					return lock.ErrUpdating
				}
			}
			if !found {
				nodes = slices.Insert(nodes, i, node)
				t.op(clientv3.OpPut(b.n.ref(resource), encode(refRec{Nodes: nodes})))
			}
		} else if found {
			nodes = slices.Delete(nodes, i, i+1)
			if len(nodes) == 0 {
				t.op(clientv3.OpDelete(b.n.ref(resource)))
			} else {
				t.op(clientv3.OpPut(b.n.ref(resource), encode(refRec{Nodes: nodes})))
			}
		}
		out = lock.RefCount{Resource: resource, Nodes: nodes}
		return nil
	})
	if err != nil {
		return lock.RefCount{}, err
	}
	return out, nil
}

// RefReleaseNode removes every reference of node. It reads every
// resource's references, a thousand at a time, and changes each one that
// names node in a transaction of its own: not atomic across resources, as
// as in the memory engine.
func (b *Backend) RefReleaseNode(ctx context.Context, node string) (int, error) {
	if err := lock.ValidateNode(node); err != nil {
		return 0, err
	}
	if err := b.refsOn(); err != nil {
		return 0, err
	}
	var named []string
	bctx, cancel := b.bound(ctx)
	defer cancel()
	err := b.w.page(bctx, b.n.refs(), 0, func(kv kvLike) {
		var r refRec
		if jsonUnmarshal(kv.Value, &r) != nil {
			return
		}
		if _, ok := slices.BinarySearch(r.Nodes, node); !ok {
			return
		}
		if res, ok := b.n.parseRef(string(kv.Key)); ok {
			named = append(named, res)
		}
	})
	if err != nil {
		return 0, b.boundErr(ctx, bctx, err)
	}
	n := 0
	for _, res := range named {
		before, err := b.RefCount(ctx, res)
		if err != nil {
			return n, err
		}
		if _, ok := slices.BinarySearch(before.Nodes, node); !ok {
			continue
		}
		if _, err := b.RefRelease(ctx, res, node); err != nil {
			return n, fmt.Errorf("releasing %s of %s: %w", res, node, err)
		}
		n++
	}
	return n, nil
}
