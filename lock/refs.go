package lock

import (
	"fmt"
)

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
