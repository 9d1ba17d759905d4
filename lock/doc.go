// Package lock is dlock's in-process lock manager: one holder and one FIFO
// queue per (operation type, resource), spread over shards by FNV-1a of the
// resource so that every type of one resource lands in one shard.
//
// Every state transition of a key happens under its shard's mutex and nothing
// under that mutex blocks or does I/O. Notifications (grants, completions) are
// queued per shard while the mutex is held and delivered after it is released,
// in transition order, without ever blocking on a slow subscriber.
//
// The manager knows nothing of HTTP: the server package maps it to the api.
package lock
