package lock

import (
	"context"
	"time"
)

// Backend holds every piece of lock state and decides every rule of
// docs/DESIGN.md: who holds a key and who waits, what a success or a failure
// tells the waiters, which lease ends what, whether a reference refuses a
// delete, and which events each node's stream receives, with ids a
// reconnecting stream resumes from. The HTTP server, its event streams and
// its metrics use a Backend and nothing else (docs/DESIGN.md, "The Backend
// seam"; the etcd mapping below is expanded in "An etcd backend").
//
// Every method is safe for concurrent use. Calls that can wait (on a lock,
// on storage, on another server) take a context; its end abandons the wait,
// never a half-made change. Errors are this package's sentinels (ErrInvalid,
// ErrLockHeld, ErrNotHolder, ErrQueueFull, ErrClosed, ...), wrapped with
// detail, so that one table (package api) maps every backend's errors to the
// same HTTP answers.
//
// Two implementations exist: package lock/memory, in one process, and
// package lock/etcd, which keeps every piece of state in etcd so that
// several servers act as one. A backend's test is one call of
// locktest.Run, the suite every backend passes.
type Backend interface {
	// TryLock asks for req's key: it is granted, or the node is queued, or
	// told to skip the work (a recent success, or a hand-off confirmed).
	TryLock(ctx context.Context, req LockRequest) (LockResult, error)
	// Unlock ends the holder's hold with its outcome: a success tells every
	// waiter to skip, a failure hands the key to the next in line.
	Unlock(ctx context.Context, req UnlockRequest) (UnlockResult, error)
	// Cancel takes node out of the key's queue, or releases its hold
	// without an outcome (the next in line is handed the key).
	Cancel(ctx context.Context, t Type, resource, node string) (CancelResult, error)
	// Status describes a key; with node, it also gives node's position and
	// renews a ttl lease node has on the key.
	Status(ctx context.Context, t Type, resource, node string) (Status, error)

	// RefCount, RefAdd, RefRelease and RefReleaseNode are the server-side
	// reference counts; ErrRefCountOff when Info().RefCounting is false.
	RefCount(ctx context.Context, resource string) (RefCount, error)
	RefAdd(ctx context.Context, resource, node string) (RefCount, error)
	RefRelease(ctx context.Context, resource, node string) (RefCount, error)
	RefReleaseNode(ctx context.Context, node string) (int, error)

	// Subscribe opens a node's session stream and/or an observer of one
	// key. A session stream keeps the node's session, and the holds leased
	// to it, alive while it is open.
	Subscribe(ctx context.Context, req SubscribeRequest) (Stream, Subscription, error)

	// Info describes the backend; it does not change while it is open.
	Info() Info
	// Stats returns gauges and counters for metrics.
	Stats() Stats
	// Close ends every stream and timer. Calls after it return ErrClosed.
	Close() error
}

// Checker is a backend that can say whether it can serve calls now: one
// whose state lives elsewhere, such as an etcd cluster out of reach, may
// not (GET /readyz). Ready returns nil, or an error wrapping
// ErrUnavailable that says why.
type Checker interface {
	Ready() error
}

// Inspector is what a backend offers the operators' live view (/ui): pages of
// keys and sessions, and a feed of what changes. It is optional: the server
// serves /ui only for a backend that implements it.
type Inspector interface {
	InspectKeys(ctx context.Context, q KeyQuery) (KeyPage, error)
	RecentCompletions(ctx context.Context, q KeyQuery) ([]CompletionView, error)
	InspectSessions(ctx context.Context, q SessionQuery) (SessionPage, error)
	WatchOps(ctx context.Context) (OpStream, error)
}

// Info describes a backend.
type Info struct {
	// Epoch names the backend's lock state: it changes when the state was
	// lost (a restart of an in-memory backend), and a client that sees it
	// change knows its holds and queue places are gone.
	Epoch string
	// RefCounting reports whether server-side reference counts are kept.
	RefCounting bool
	// LockTTL is the lease of a ttl hold; streams ping well within it.
	LockTTL time.Duration
}

// SubscribeRequest names what a stream receives.
type SubscribeRequest struct {
	// Node, when not empty, opens Node's session stream.
	Node string
	// Observe, when not nil, also receives every event of this key.
	Observe *Key
	// LastID, when HasLast, replays the session's retained events after it.
	LastID  uint64
	HasLast bool
}

// Feed is a bounded stream of T: wait on Ready, then Take what arrived,
// until Done is closed; then call Close. A feed that does not keep up is
// closed by its backend, and Slow reports true.
type Feed[T any] interface {
	// Ready receives when items are waiting to be taken.
	Ready() <-chan struct{}
	// Take appends the waiting items, in order, to buf and returns it.
	Take(buf []T) []T
	// Done is closed when the feed ended: by Close, by the backend's Close,
	// or because it did not keep up.
	Done() <-chan struct{}
	// Ended reports whether the feed ended: Done is closed. It makes no
	// channel, as Done may (a server with Notify needs none).
	Ended() bool
	// Slow reports whether the feed was closed for not keeping up.
	Slow() bool
	// Notify makes the feed also call f whenever items start waiting and
	// once when it ends, so that a server can keep thousands of idle
	// streams without a goroutine waiting on each Ready (docs/DESIGN.md,
	// "Event streams"). f must not block. Set it once, before waiting;
	// when items are waiting or the feed has ended already, f is called at
	// once.
	Notify(f func())
	// Close ends the feed. Closing a node's last session stream starts the
	// session's grace.
	Close()
}

// Stream is a session stream or key observer (Backend.Subscribe).
type Stream = Feed[Delivery]

// OpStream is the operators' feed (Inspector.WatchOps).
type OpStream = Feed[OpEvent]

// Stats is a snapshot of the manager's gauges and counters.
type Stats struct {
	Keys     int    // keys with a holder, a queue or a completion record
	Held     int    // keys with a holder
	Queued   int    // queue entries
	Sessions int    // open sessions, streaming or in grace
	Grants   uint64 // grants, direct and by hand-off
	Handoffs uint64 // grants by hand-off
	Expiries uint64 // holds and queue entries ended by a lease
	// SessionsLost counts sessions ended by their grace running out that
	// held or waited for something under their lease, released then;
	// SessionsClosed those that ended with nothing leased: a node that
	// closed its streams and went, a clean end (docs/DESIGN.md, "Sessions
	// and events").
	SessionsLost   uint64
	SessionsClosed uint64
	SlowStreams    uint64 // streams closed for not keeping up

	// Requests refused by a limit (docs/SECURITY.md).
	RefusedSessions    uint64 // Config.MaxSessions
	RefusedNodeStreams uint64 // Config.MaxSessionsPerNode
	RefusedQueue       uint64 // Config.MaxQueue
	RefusedKeys        uint64 // Config.MaxKeys
	RefusedWatchers    uint64 // Config.MaxWatchers
	TruncatedErrors    uint64 // unlock error texts cut to MaxErrorLen
	ReplayGaps         uint64 // reconnects whose replay missed events the log let go
}

// Subscription is what Subscribe returns besides the stream.
type Subscription struct {
	// ID is the id of the subscribed event: a reconnect that sends it as its
	// last event id replays everything after it. After a Last-Event-ID it
	// is that id, unless events after it were let go (Missed): then it is
	// the id of the newest one let go, so the replay starts after a gap the
	// client can see (docs/DESIGN.md, "Event ids and replay").
	ID uint64
	// Replay holds, in order, the session's retained events after the last
	// event id; they take at most Config.SessionLogBytes on the api.
	Replay []Delivery
	// Missed reports that events after the last event id are no longer
	// kept: the log's bounds let them go, or the session ended and began
	// anew.
	Missed bool
}
