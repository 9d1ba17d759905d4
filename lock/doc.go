// Package lock is dlock's contract for lock state (docs/DESIGN.md, "The
// Backend seam"): the types of a request and its answer, the errors every
// backend answers with, the Backend interface the server uses (and the
// optional Inspector for the operators' view), the Rules every backend
// honours the same way, the events a stream delivers, and FeedQueue, the
// one bounded queue behind every Feed.
//
// It holds no state and starts no goroutine. The engines live below it,
// each in its own package with its own Config that embeds Rules:
//
//   - lock/memory: the in-process engine, sharded in one process.
//   - lock/etcd: every piece of state in etcd, so that several servers act
//     as one.
//   - lock/locktest: the conformance suite both pass; a new backend's test
//     is one call of locktest.Run.
//
// Files: backend.go (Backend, Inspector, Info, Subscription, Stats),
// types.go (keys, requests, answers, errors, validation), rules.go (Rules
// and their defaults), events.go (events and their size on the wire),
// feed.go (FeedQueue), refs.go (the reference rules' decisions) and
// inspect.go (the operators' view: pages and feed events).
//
// The package knows nothing of HTTP: package server maps a Backend to the
// API of docs/API.md.
package lock
