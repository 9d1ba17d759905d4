// Package memory is the in-process lock engine: a lock.Backend whose state
// lives in one process, sharded so that keys on different shards never
// contend (docs/DESIGN.md, "The memory engine").
//
// It keeps one holder and one FIFO queue per (operation type, resource),
// spread over shards by FNV-1a of the resource so that every type of one
// resource lands in one shard. Every state transition of a key happens
// under its shard's mutex and nothing under that mutex blocks or does I/O.
// Notifications (grants, completions) are queued per shard while the mutex
// is held and delivered after it is released, in transition order, without
// ever blocking on a slow subscriber.
//
// A request reads top-down through the files:
//
//   - backend.go: Backend, its calls (TryLock, Unlock, Cancel, Status),
//     Stats and Close; config.go: its Config (lock.Rules plus shards,
//     stores and logger).
//   - shard.go: a shard and a key's transitions under its mutex (grant,
//     enqueue, release, promote, expire, the lock delay), with keytable.go
//     (the shard's key table) and heap.go (its deadlines).
//   - key.go: a key's holder, queue and completion record; queue.go: its
//     FIFO of waiters; entry.go: a holder or waiter and its lease.
//
// And beside that path, one concern a file: session.go (sessions, their
// replay logs and grace), stream.go (streams and Subscribe), events.go
// (the per-shard outbox and delivery), refs.go (server-side reference
// counts and their RefStore), tokens.go (fencing tokens and the
// CeilingStore), inspect.go and opfeed.go (the operators' view).
package memory
