// Package refcount keeps reference counts of shared resources: which nodes
// use a blob, so that a delete can be refused while any does (docs/DESIGN.md, "Reference rules").
//
// ServerStore makes the dlock server's references durable (--refcount=server).
// The rules themselves live beside the lock manager (lock.RefPermits and
// lock.RefEffectOf) so that every mode applies the same table.
package refcount
