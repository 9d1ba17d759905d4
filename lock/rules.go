package lock

import (
	"errors"
	"fmt"
	"time"
)

// Rules are the settings of docs/DESIGN.md's rules that every backend
// honours the same way: leases, completion retention, the bounds of
// streams and logs, and the limits that answer with an error. Every server
// of one data set runs with the same Rules. An engine's own settings (how
// it stores or spreads its state) are in its own Config, which embeds
// Rules. Start from DefaultRules.
type Rules struct {
	// AllowMultiNodeDownload queues a node that asks for a held key; when
	// false such a request is refused with ErrLockHeld.
	AllowMultiNodeDownload bool
	// UpdateRequiresNoRef refuses updates while a resource is referenced
	// (server-side reference counting only).
	UpdateRequiresNoRef bool
	// CompletedRetention is how long a completion record is kept.
	CompletedRetention time.Duration
	// CompletedMax bounds the number of completion records kept in all.
	CompletedMax int
	// SessionGrace is how long a session outlives its last event stream.
	SessionGrace time.Duration
	// LockTTL is the life of a ttl-leased hold or queue entry after its
	// grant or last renewal.
	LockTTL time.Duration
	// ClaimTimeout is how long a hand-off grant waits for the new holder's
	// confirming TryLock; 0 turns the check off.
	ClaimTimeout time.Duration
	// MaxHold bounds how long any grant may be held; 0 means unlimited.
	MaxHold time.Duration
	// LockDelay keeps a key reserved for this long after a hold ended
	// because its lease ran out (its ttl expired or its session was lost),
	// as Consul's lock-delay does: the holder may have been paused or cut
	// off and still be running, so the key is handed on, to the waiters
	// in their order, only once the delay has passed, and a node that asks
	// meanwhile is queued behind them. Ends by unlock, cancel, claim
	// timeout and max hold are not delayed (docs/DESIGN.md, "Leases").
	// 0 turns the delay off.
	LockDelay time.Duration
	// StreamBuffer is the number of undelivered events a stream may have
	// before it is closed as too slow.
	StreamBuffer int
	// SessionLog is the number of recent events a session keeps so that a
	// reconnecting stream can replay what it missed.
	SessionLog int
	// SessionLogBytes bounds the same log in bytes, counted as the events
	// take on the wire at most, so that no replay builds a response larger
	// than this. At least MinSessionLogBytes, room for the largest event.
	SessionLogBytes int
	// MaxSessions bounds the sessions, streaming or in grace; a stream or
	// a session lease that would open one more is refused with
	// ErrTooManySessions. 0: no limit.
	MaxSessions int
	// MaxSessionsPerNode bounds the open event streams of one node id
	// (each is a session stream of the node's one session); one more is
	// refused with ErrTooManySessions. 0: no limit.
	MaxSessionsPerNode int
	// MaxQueue bounds the waiters of one key; one more is refused with
	// ErrQueueFull. 0: no limit.
	MaxQueue int
	// MaxKeys bounds the keys with state (a holder, waiters or a retained
	// completion record); a request that would add a key is refused with
	// ErrTooManyKeys. A backend may count it in parts that check it
	// concurrently (the memory engine's shards), so it may be passed by a
	// few. 0: no limit.
	MaxKeys int
	// MaxWatchers bounds the streams that watch without a session: key
	// observers and operator feeds. Every event of a watched key is
	// handed to each, so their number must not be a client's choice.
	MaxWatchers int
}

// DefaultRules returns the defaults of docs/RUNNING.md, "Configuration".
func DefaultRules() Rules {
	return Rules{
		AllowMultiNodeDownload: true,
		CompletedRetention:     5 * time.Minute,
		CompletedMax:           100000,
		SessionGrace:           5 * time.Second,
		LockTTL:                60 * time.Second,
		ClaimTimeout:           30 * time.Second,
		StreamBuffer:           1024,
		SessionLog:             4096,
		SessionLogBytes:        1 << 20,
		MaxSessions:            100000,
		MaxSessionsPerNode:     16,
		MaxQueue:               100000,
		MaxKeys:                1000000,
		MaxWatchers:            1024,
	}
}

// MinSessionLogBytes is the least Rules.SessionLogBytes: room for the
// largest event (ids and error text at their longest, every byte escaped).
const MinSessionLogBytes = 16 << 10

// Validate reports the first setting that cannot work.
func (c Rules) Validate() error {
	var errs []error
	if c.CompletedRetention < 0 {
		errs = append(errs, fmt.Errorf("completed retention must not be negative, not %v", c.CompletedRetention))
	}
	if c.CompletedMax < 0 {
		errs = append(errs, fmt.Errorf("completed max must not be negative, not %d", c.CompletedMax))
	}
	if c.SessionGrace <= 0 {
		errs = append(errs, fmt.Errorf("session grace must be positive, not %v", c.SessionGrace))
	}
	if c.LockTTL <= 0 {
		errs = append(errs, fmt.Errorf("lock ttl must be positive, not %v", c.LockTTL))
	}
	if c.ClaimTimeout < 0 {
		errs = append(errs, fmt.Errorf("claim timeout must not be negative, not %v", c.ClaimTimeout))
	}
	if c.MaxHold < 0 {
		errs = append(errs, fmt.Errorf("max hold must not be negative, not %v", c.MaxHold))
	}
	if c.LockDelay < 0 {
		errs = append(errs, fmt.Errorf("lock delay must not be negative (0: off), not %v", c.LockDelay))
	}
	if c.StreamBuffer < 1 {
		errs = append(errs, fmt.Errorf("stream buffer must be at least 1, not %d", c.StreamBuffer))
	}
	if c.SessionLog < 1 {
		errs = append(errs, fmt.Errorf("session log must be at least 1, not %d", c.SessionLog))
	}
	if c.SessionLogBytes < MinSessionLogBytes {
		errs = append(errs, fmt.Errorf("session log bytes must be at least %d, not %d", MinSessionLogBytes, c.SessionLogBytes))
	}
	for _, l := range []struct {
		name string
		v    int
	}{{"max sessions", c.MaxSessions}, {"max sessions per node", c.MaxSessionsPerNode}, {"max queue", c.MaxQueue}, {"max keys", c.MaxKeys}, {"max watchers", c.MaxWatchers}} {
		if l.v < 0 {
			errs = append(errs, fmt.Errorf("%s must not be negative (0: no limit), not %d", l.name, l.v))
		}
	}
	return errors.Join(errs...)
}
