package memory

import (
	"cmp"
	"context"
	"encoding/base64"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/dlock/dlock/lock"
)

// scanBudget is how many keys one InspectKeys call examines before it
// returns a short page and a cursor to go on from. A variable for tests.
var scanBudget = 1 << 16

// keyPos is a place in the walk over a shard's keys. The zero keyPos is
// before every key: no resource id is empty.
type keyPos struct {
	res string
	typ lock.Type
}

func (p keyPos) compare(q keyPos) int {
	if c := strings.Compare(p.res, q.res); c != 0 {
		return c
	}
	return lock.CompareTypes(p.typ, q.typ)
}

type keyCursor struct {
	shard int
	pos   keyPos
}

// Cursors are opaque to callers: base64url of "shard.type.resource".
func (c keyCursor) String() string {
	return base64.RawURLEncoding.EncodeToString(fmt.Appendf(nil, "%d.%d.%s", c.shard, c.pos.typ, c.pos.res))
}

func parseKeyCursor(s string, shards int) (keyCursor, error) {
	if s == "" {
		return keyCursor{}, nil
	}
	bad := fmt.Errorf("%w: cursor %.40q is not one this server gave", lock.ErrInvalid, s)
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil {
		return keyCursor{}, bad
	}
	parts := strings.SplitN(string(b), ".", 3)
	if len(parts) != 3 {
		return keyCursor{}, bad
	}
	shard, err1 := strconv.Atoi(parts[0])
	typ, err2 := strconv.Atoi(parts[1])
	if err1 != nil || err2 != nil || shard < 0 || shard >= shards || typ < 0 || typ > lock.MaxTypes || (typ != 0 && !lock.Type(typ).Valid()) {
		return keyCursor{}, bad
	}
	return keyCursor{shard: shard, pos: keyPos{res: parts[2], typ: lock.Type(typ)}}, nil
}

func pageLimit(n int) int {
	switch {
	case n <= 0:
		return lock.DefaultInspectLimit
	case n > lock.MaxInspectLimit:
		return lock.MaxInspectLimit
	}
	return n
}

// InspectKeys returns a page of the keys that have a holder or waiters.
func (m *Backend) InspectKeys(ctx context.Context, q lock.KeyQuery) (lock.KeyPage, error) {
	if err := ctx.Err(); err != nil {
		return lock.KeyPage{}, err
	}
	if m.closed.Load() {
		return lock.KeyPage{}, lock.ErrClosed
	}
	cur, err := parseKeyCursor(q.Cursor, len(m.shards))
	if err != nil {
		return lock.KeyPage{}, err
	}
	limit := pageLimit(q.Limit)
	var page lock.KeyPage
	for i := cur.shard; i < len(m.shards); i++ {
		var after keyPos
		if i == cur.shard {
			after = cur.pos
		}
		s := m.shards[i]
		s.mu.Lock()
		sel, more, scanned := s.selectKeys(q, after, limit-len(page.Keys))
		now := m.now()
		for _, ks := range sel {
			page.Keys = append(page.Keys, m.keyView(ks, now))
		}
		s.mu.Unlock()
		page.Scanned += scanned
		switch {
		case more:
			last := sel[len(sel)-1].key()
			page.Next = keyCursor{shard: i, pos: keyPos{last.Resource, last.Type}}.String()
			return page, nil
		case i+1 < len(m.shards) && (len(page.Keys) == limit || page.Scanned >= scanBudget):
			page.Next = keyCursor{shard: i + 1}.String()
			return page, nil
		}
	}
	return page, nil
}

// selectKeys returns, in order, the first n held or queued keys after
// pos that match q, and whether more follow. Called with s.mu held; the
// work is one pass over the shard's keys and O(n) memory.
func (s *shard) selectKeys(q lock.KeyQuery, after keyPos, n int) (sel []*keyState, more bool, scanned int) {
	// best is sorted and keeps at most n+1 keys: the one past n says
	// that more follow.
	best := make([]*keyState, 0, min(n+1, 64))
	posOf := func(ks *keyState) keyPos { return keyPos{ks.res, ks.typ} }
	for ks := range s.keys.all() {
		if ks.res < after.res || (q.Resource != "" && !strings.Contains(ks.res, q.Resource)) ||
			(ks.holder == nil && ks.qlen() == 0) || !ks.hasNode(q.Node) {
			continue
		}
		p := posOf(ks)
		if p.compare(after) <= 0 {
			continue
		}
		if len(best) == n+1 && p.compare(posOf(best[n])) >= 0 {
			continue
		}
		i, _ := slices.BinarySearchFunc(best, p, func(b *keyState, p keyPos) int { return posOf(b).compare(p) })
		if len(best) == n+1 {
			best = best[:n]
		}
		best = slices.Insert(best, i, ks)
	}
	if len(best) > n {
		return best[:n], true, s.keys.n
	}
	return best, false, s.keys.n
}

func (m *Backend) keyView(ks *keyState, now mono) lock.KeyView {
	v := lock.KeyView{Key: ks.key(), QueueLength: ks.qlen()}
	if h := ks.holder; h != nil {
		v.Holder, v.Token, v.Lease, v.AcquiredAt, v.Unclaimed = h.node(), ks.lastToken, h.lease(), m.wall(h.grantedAt), ks.unclaimed
	}
	if v.QueueLength > 0 {
		v.Queue = make([]lock.Waiter, 0, min(v.QueueLength, lock.QueueShown))
		// The queue has holes where waiters left (shard.go, waitQueue.remove).
		for _, e := range ks.wq.q[ks.wq.head:] {
			if len(v.Queue) == lock.QueueShown {
				break
			}
			if e != nil {
				v.Queue = append(v.Queue, lock.Waiter{Node: e.node(), Lease: e.lease()})
			}
		}
	}
	if ks.hasRec && ks.rec.retained(now, m.cfg.CompletedRetention) {
		c := ks.rec.Completion
		v.LastCompleted = &c
	}
	return v
}

// RecentCompletions returns the latest retained completion of each key
// that matches q (its Cursor is ignored), newest first, at most q.Limit
// of them. The work is one pass over the retained records, which
// Config.CompletedMax bounds, one shard at a time.
func (m *Backend) RecentCompletions(ctx context.Context, q lock.KeyQuery) ([]lock.CompletionView, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if m.closed.Load() {
		return nil, lock.ErrClosed
	}
	limit := pageLimit(q.Limit)
	type found struct {
		at mono
		v  lock.CompletionView
	}
	best := make([]found, 0, limit+1)
	newer := func(a found, at mono) int { return cmp.Compare(at, a.at) } // newest first
	for _, s := range m.shards {
		s.mu.Lock()
		now := m.now()
		rq := &s.records
		for _, ref := range rq.buf[rq.head:] {
			ks := ref.ks
			// A key is in the record queue at most once (inQueue), and a
			// key with a record is never forgotten: no duplicates.
			if !ks.hasRec || !ks.rec.retained(now, m.cfg.CompletedRetention) ||
				(q.Resource != "" && !strings.Contains(ks.res, q.Resource)) ||
				(q.Node != "" && ks.rec.Node != q.Node) {
				continue
			}
			r := ks.rec
			if len(best) == limit && r.at <= best[limit-1].at {
				continue
			}
			i, _ := slices.BinarySearchFunc(best, r.at, newer)
			best = slices.Insert(best, i, found{r.at, lock.CompletionView{Key: ks.key(), Completion: r.Completion, NextHolder: r.next}})
			if len(best) > limit {
				best = best[:limit]
			}
		}
		s.mu.Unlock()
	}
	out := make([]lock.CompletionView, len(best))
	for i, f := range best {
		out[i] = f.v
	}
	return out, nil
}

// InspectSessions returns a page of the sessions, streaming or in grace.
// The work is one pass over the session table's node ids and O(limit)
// memory; only the sessions on the page are looked into.
func (m *Backend) InspectSessions(ctx context.Context, q lock.SessionQuery) (lock.SessionPage, error) {
	if err := ctx.Err(); err != nil {
		return lock.SessionPage{}, err
	}
	if m.closed.Load() {
		return lock.SessionPage{}, lock.ErrClosed
	}
	var after string
	if q.Cursor != "" {
		b, err := base64.RawURLEncoding.DecodeString(q.Cursor)
		if err != nil || len(b) == 0 {
			return lock.SessionPage{}, fmt.Errorf("%w: cursor %.40q is not one this server gave", lock.ErrInvalid, q.Cursor)
		}
		after = string(b)
	}
	limit := pageLimit(q.Limit)
	best := make([]*session, 0, min(limit+1, 64))
	byNode := func(s *session, node string) int { return strings.Compare(s.node, node) }
	var page lock.SessionPage
	m.sess.mu.Lock()
	page.Total = len(m.sess.m)
	for node, s := range m.sess.m {
		if node <= after || (q.Node != "" && !strings.Contains(node, q.Node)) {
			continue
		}
		if len(best) == limit+1 && node >= best[limit].node {
			continue
		}
		i, _ := slices.BinarySearchFunc(best, node, byNode)
		if len(best) == limit+1 {
			best = best[:limit]
		}
		best = slices.Insert(best, i, s)
	}
	if len(best) > limit {
		best = best[:limit]
		page.Next = base64.RawURLEncoding.EncodeToString([]byte(best[limit-1].node))
	}
	page.Sessions = make([]lock.SessionView, 0, len(best))
	for _, s := range best {
		s.mu.Lock()
		page.Sessions = append(page.Sessions, lock.SessionView{Node: s.node, Streams: len(s.streams), InGrace: len(s.streams) == 0, Keys: s.nents})
		s.mu.Unlock()
	}
	m.sess.mu.Unlock()
	return page, nil
}
