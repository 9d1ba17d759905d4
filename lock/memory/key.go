package memory

import (
	"time"

	"github.com/dlock/dlock/lock"
)

// keyState is one key's holder, queue and retained completion record. A
// held key that nobody waits for is the common case, and the struct is
// laid out for it: what only waiters or completions need hangs off a
// pointer that stays nil until then, and it takes 64 bytes
// (docs/DESIGN.md, "What a held lock costs").
type keyState struct {
	res       string // the resource, one copy for all its keys; it never changes
	holder    *entry
	wq        *waitQueue // allocated at the key's first waiter
	lastToken uint64     // the last token issued: the holder's, while there is one
	rec       *record    // allocated at the key's first completion: a held key needs none
	sib       *keyState  // the next key in the shard's chain (keyTable)
	hash      uint32     // the resource's hash in the shard's keyTable
	typ       lock.Type
	unclaimed bool // the holder has a hand-off grant it has not confirmed: the claim timeout runs
	hasRec    bool
	inQueue   bool // ks has an entry in the shard's record queue
}

func (ks *keyState) key() lock.Key { return lock.Key{Type: ks.typ, Resource: ks.res} }

// record is a completion record and what the server needs to replay an
// unlock whose answer was lost.
type record struct {
	lock.Completion

	at        mono   // CompletedAt on the manager's monotonic clock
	viaUnlock bool   // written by the holder's own /unlock
	next      string // the next_holder that unlock answered
}

func (r *record) retained(now mono, retention time.Duration) bool {
	return time.Duration(now-r.at) < retention
}

func (ks *keyState) recentSuccess(now mono, retention time.Duration) bool {
	return ks.hasRec && ks.rec.Success && ks.rec.retained(now, retention)
}

// replays reports whether req repeats the unlock that wrote the retained record
// (docs/DESIGN.md, "Unlock").
func (ks *keyState) replays(req lock.UnlockRequest, now mono, retention time.Duration) bool {
	r := ks.rec
	return ks.hasRec && r.viaUnlock && r.Node == req.Node && r.Success == req.Success &&
		(req.Token == 0 || req.Token == r.Token) && r.retained(now, retention)
}

// qlen is the number of waiters.
func (ks *keyState) qlen() int {
	if ks.wq == nil {
		return 0
	}
	return ks.wq.len()
}

// delayed reports whether ks is reserved by its lock delay: free, but
// handed to no one, not even a node that asks, until the delay has passed
// (docs/DESIGN.md, "Leases").
func (ks *keyState) delayed() bool { return ks.wq != nil && ks.wq.delay != nil }

// holderNode is the holder's node id, "" when the key is free (as it is,
// with waiters, during a lock delay).
func (ks *keyState) holderNode() string {
	if ks.holder == nil {
		return ""
	}
	return ks.holder.node()
}

// waiter is node's queue entry, nil when node does not wait for ks.
func (ks *keyState) waiter(node string) *entry {
	if ks.wq == nil {
		return nil
	}
	return ks.wq.byNode[node]
}

// hasNode reports whether node holds ks, waits for it, or completed it
// last; an empty node matches every key.
func (ks *keyState) hasNode(node string) bool {
	return node == "" || (ks.holder != nil && ks.holder.node() == node) || ks.waiter(node) != nil ||
		(ks.hasRec && ks.rec.Node == node)
}
