// Package lock is dlock's lock state and its rules (docs/DESIGN.md): the
// types of a request and its answer, the errors every backend answers with,
// the Backend interface the server uses, and Memory, the in-process backend.
//
// Memory keeps one holder and one FIFO queue per (operation type, resource),
// spread over shards by FNV-1a of the resource so that every type of one
// resource lands in one shard. Every state transition of a key happens under
// its shard's mutex and nothing under that mutex blocks or does I/O.
// Notifications (grants, completions) are queued per shard while the mutex is
// held and delivered after it is released, in transition order, without ever
// blocking on a slow subscriber.
//
// Files: backend.go (the interface), types.go (requests, answers, errors),
// memory.go (Memory's calls), shard.go (a key's transitions), session.go
// (sessions, their event logs and grace), stream.go (streams and Subscribe),
// events.go (events and the per-shard outbox), refs.go (reference counts),
// tokens.go (fencing tokens), inspect.go and opfeed.go (the operators' view).
//
// The package knows nothing of HTTP: package server maps a Backend to the
// API of docs/API.md, and locktest is the suite every Backend passes.
package lock
