package memory

import (
	"time"
	"unique"

	"github.com/dlock/dlock/lock"
)

// entry is a holder or a queue entry: a queue entry becomes the holder on a
// hand-off, keeping its lease. It keeps only what cannot be derived, in 64
// bytes: the holder's token is its key's last token, its lease is a
// session lease exactly while it is in a session, and of its deadlines it
// keeps the earliest alone: the claim timeout and max hold are fixed
// offsets from the grant, and a ttl lease is renewed whenever the entry is
// scheduled (docs/DESIGN.md, "What a held lock costs").
type entry struct {
	// id is the node's interned id: every entry of a node shares one copy
	// of it, the session's for a session lease, where a copy each cost a
	// string each (docs/DESIGN.md, "What a held lock costs").
	id   unique.Handle[string]
	ks   *keyState
	sess *session // the session of a session lease; nil for a ttl lease
	// sprev and snext link the entries of sess (session.ents), guarded
	// by sess.mu.
	sprev, snext *entry
	grantedAt    mono
	at           mono // the earliest deadline (schedule): the entry's place in the heap
	// hidx and qidx index the shard's heap and the key's queue: int32
	// bounds each at 2³¹ entries, 128 GiB of them.
	hidx int32 // -1 when not in the heap
	qidx int32 // while queued
}

// lease is e's lease once attached.
func (e *entry) lease() lock.Lease {
	if e.sess != nil {
		return lock.LeaseSession
	}
	return lock.LeaseTTL
}

// node is e's node id.
func (e *entry) node() string { return e.id.Value() }

// deadline is e's earliest deadline as of now, zero when it has none: a
// ttl lease renewed now, and for a holder the claim timeout (while
// unclaimed) and max hold, both counted from the grant.
func (e *entry) deadline(cfg *Config, now mono) mono {
	var at mono
	if e.sess == nil {
		at = now.add(cfg.LockTTL)
	}
	if ks := e.ks; ks.holder == e {
		if ks.unclaimed {
			at = earliest(at, e.grantedAt.add(cfg.ClaimTimeout))
		}
		if cfg.MaxHold > 0 {
			at = earliest(at, e.grantedAt.add(cfg.MaxHold))
		}
	}
	return at
}

// guaranteed is how long from now holder h's hold is sure to stand
// (docs/DESIGN.md, "Leases"): a session lease stands while its session
// streams and through the grace after, a ttl lease for the ttl after its
// last renewal (every caller has just renewed it), and either ends sooner
// at a claim timeout or max hold. Called under the shard's mutex.
func (s *shard) guaranteed(h *entry, now mono) time.Duration {
	cfg := &s.m.cfg
	left := cfg.LockTTL
	if ss := h.sess; ss != nil {
		left = ss.guaranteed(s.m, now)
	}
	if at := h.deadline(cfg, now); at != 0 {
		left = min(left, time.Duration(at-now))
	}
	return max(left, 0)
}

// earliest is the earlier of two deadlines, where zero means none.
func earliest(a, b mono) mono {
	if a == 0 || b < a {
		return b
	}
	return a
}

// detach takes e off its session's list of entries, when it has a session.
func (e *entry) detach() {
	if s := e.sess; s != nil {
		s.mu.Lock()
		if !s.ended { // an ended session's list is gone (endSessions)
			s.unlink(e)
		}
		s.mu.Unlock()
		e.sess = nil
	}
}
