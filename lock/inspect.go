package lock

import (
	"time"
)

// What an operator's live view reads (docs/API.md, GET /ui): paged,
// filtered snapshots of keys, completions and sessions. Each call reads
// one shard at a time under its mutex and does bounded work: it never
// copies every key, however many there are.

// Limits of the inspection calls.
const (
	// MaxInspectLimit bounds a page of keys or sessions.
	MaxInspectLimit = 200
	// DefaultInspectLimit is the page size when none is asked for.
	DefaultInspectLimit = 50
	// QueueShown is the number of waiters of one key a KeyView lists;
	// QueueLength has the full length.
	QueueShown = 50
)

// KeyQuery selects the keys of InspectKeys and the completions of
// RecentCompletions.
type KeyQuery struct {
	// Resource keeps keys whose resource id contains it.
	Resource string
	// Node keeps keys this node holds, waits for, or completed last.
	Node string
	// Cursor continues a walk where the page that returned it ended; ""
	// starts one.
	Cursor string
	// Limit is the page size: 0 means DefaultInspectLimit, more than
	// MaxInspectLimit means MaxInspectLimit.
	Limit int
}

// Waiter is one queue entry.
type Waiter struct {
	Node  string
	Lease Lease
}

// KeyView is a held key as an operator sees it.
type KeyView struct {
	Key        Key
	Holder     string
	Token      uint64
	Lease      Lease
	AcquiredAt time.Time
	// Unclaimed: the key was handed to Holder, which has not confirmed
	// the grant yet.
	Unclaimed bool
	// Queue is the first QueueShown waiters, in order.
	Queue       []Waiter
	QueueLength int
	// LastCompleted is the key's retained completion record, if any.
	LastCompleted *Completion
}

// KeyPage is one page of a walk over the held keys: in shard order, then
// by resource and type within a shard. A key granted during a walk may or
// may not appear in it, like any concurrent change.
type KeyPage struct {
	Keys []KeyView
	// Next continues the walk; "" when it is complete. A page may be short
	// (even empty) and still have a Next: the call ran out of its budget.
	Next string
	// Scanned is the number of keys the call examined.
	Scanned int
}

// CompletionView is a retained completion record and the key it ended.
type CompletionView struct {
	Key Key
	Completion
	// NextHolder is the node the key went to, when the record was written
	// by the holder's own unlock; else "".
	NextHolder string
}

// SessionQuery selects the sessions of InspectSessions.
type SessionQuery struct {
	// Node keeps sessions whose node id contains it.
	Node string
	// Cursor continues a walk; "" starts one.
	Cursor string
	// Limit is the page size, as KeyQuery's.
	Limit int
}

// SessionView is a node's session as an operator sees it.
type SessionView struct {
	Node    string
	Streams int  // open event streams
	InGrace bool // no stream open: the session ends unless one opens in time
	Keys    int  // keys the session holds or waits for under a session lease
}

// SessionPage is one page of a walk over the sessions, by node id.
type SessionPage struct {
	Sessions []SessionView
	Next     string // "" when the walk is complete
	Total    int    // sessions in all
}

// The operator feed: every transition, for an operator's live view
// (docs/API.md, GET /ui/events). It costs nothing while nobody watches:
// each hook reads one atomic counter before it builds anything.

// Operator-only event names: a node joined or left a key's queue without
// being granted it. Session streams and observers never get them; a waiter
// that becomes holder is reported by lock_assigned, and the waiters a
// success sends away by operation_completed.
const (
	EventQueueJoined = "queue_joined"
	EventQueueLeft   = "queue_left"
)

// OpEvent is one transition on the operator feed: a lock event (Event is
// set) or a change of a node's session (Session is set).
type OpEvent struct {
	Event   *Event
	Session *SessionChange
}

// SessionChange reports a session's state after a stream opened or
// closed, or after the session ended.
type SessionChange struct {
	Node    string
	Streams int  // open streams; 0 with Ended false means in grace
	Ended   bool // the session is gone
}
