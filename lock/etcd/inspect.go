package etcd

import (
	"bytes"
	"cmp"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/lock"
)

// The operators' view (lock.Inspector, docs/API.md "GET /ui"), from what
// this server's watch already keeps: the keys' counts and the records its
// calls read first (cache.go), walked in order through an index kept only
// while someone looks (viewer.go). What the watch does not keep is read
// from etcd on demand, bounded, and only for what a page shows: the first
// lock.QueueShown waiters of each key on the page, and the session index
// of each session on the page (docs/DESIGN.md, "The operators' view").

var _ lock.Inspector = (*Backend)(nil)

// scanBudget is how many keys one InspectKeys call examines before it
// returns a short page and a cursor to go on from, as the memory engine's.
// A variable for tests.
var scanBudget = 1 << 16

// Cursors are opaque to callers: base64url of "type.resource", where type is
// a built-in type's number or another type's name, since a cursor one server
// gave may come back to another, which numbers that type differently.
func keyCursor(k lock.Key) string {
	t := strconv.Itoa(int(k.Type))
	if !k.Type.Builtin() {
		t = k.Type.String()
	}
	return base64.RawURLEncoding.EncodeToString(fmt.Appendf(nil, "%s.%s", t, k.Resource))
}

func parseKeyCursor(s string) (*lock.Key, error) {
	if s == "" {
		return nil, nil
	}
	bad := fmt.Errorf("%w: cursor %.40q is not one this server gave", lock.ErrInvalid, s)
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil {
		return nil, bad
	}
	ts, res, ok := strings.Cut(string(b), ".")
	if !ok || res == "" {
		return nil, bad
	}
	var typ lock.Type
	if n, err := strconv.Atoi(ts); err == nil {
		if typ = lock.Type(n); n < 0 || n > lock.MaxTypes || !typ.Builtin() {
			return nil, bad
		}
	} else if typ, err = lock.ParseType(ts); err != nil {
		return nil, err
	}
	return &lock.Key{Type: typ, Resource: res}, nil
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

// inspecting starts an inspection: the view is looked at from now on, and
// the watch has applied this server's own last write, so that a page shows
// what a call just did here.
func (b *Backend) inspecting(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := b.alive(); err != nil {
		return err
	}
	b.vw.look()
	b.w.caughtUp(b.lastCommit.Load(), time.Second)
	return nil
}

// raws returns the cached values of keys (nil for those absent), under one
// read lock, each as etcd has it but for a record's transition: the node
// filter looks for a node's quoted id in them (cacherec.go).
func (c *recCache) raws(keys []string) [][]byte {
	vals := make([]cVal, len(keys))
	found := make([]bool, len(keys))
	c.mu.RLock()
	for i, k := range keys {
		var e cEntry
		e, found[i] = c.m[k]
		vals[i] = e.val
	}
	c.mu.RUnlock()
	out := make([][]byte, len(keys))
	for i, v := range vals {
		if found[i] {
			out[i] = recJSON(v.bytes())
		}
	}
	return out
}

// InspectKeys returns a page of the keys that have a holder or waiters.
func (b *Backend) InspectKeys(ctx context.Context, q lock.KeyQuery) (lock.KeyPage, error) {
	from, err := parseKeyCursor(q.Cursor)
	if err != nil {
		return lock.KeyPage{}, err
	}
	if err := b.inspecting(ctx); err != nil {
		return lock.KeyPage{}, err
	}
	limit := pageLimit(q.Limit)
	x := b.vw.index()
	type match struct {
		k   lock.Key
		rec keyRec
	}
	var (
		page         lock.KeyPage
		found        []match
		batch        []lock.Key
		names, waits []string
		more         bool
		visited      *lock.Key // the last key examined
	)
	// The node filter keeps keys the node holds, waits for, or completed
	// last, as the memory engine's: a record that does not name it at all
	// is not decoded, and its waiting is its queue index in the cache.
	quoted, _ := json.Marshal(q.Node)
	const step = 256
	for len(found) <= limit && page.Scanned < scanBudget {
		batch = batch[:0]
		b.vw.idxMu.Lock()
		batch, more = x.after(from, min(step, scanBudget-page.Scanned), batch)
		b.vw.idxMu.Unlock()
		page.Scanned += len(batch)
		names, waits = names[:0], waits[:0]
		for _, k := range batch {
			names = append(names, b.n.key(k))
			if q.Node != "" {
				waits = append(waits, b.n.queueNode(k, q.Node))
			}
		}
		raws := b.rc.raws(names)
		waiting := b.rc.raws(waits)
		for i, k := range batch {
			visited = &batch[i]
			if q.Resource != "" && !strings.Contains(k.Resource, q.Resource) || raws[i] == nil {
				continue
			}
			if q.Node != "" && waiting[i] == nil && !bytes.Contains(raws[i], quoted) {
				continue
			}
			rec, err := decodeKey(raws[i])
			if err != nil {
				continue
			}
			if q.Node != "" && waiting[i] != nil && !b.indexLive(k, q.Node, waiting[i]) {
				waiting[i] = nil // stale: left by a success (indexes.go)
			}
			if q.Node != "" && waiting[i] == nil && rec.Holder != q.Node && (rec.Done == nil || rec.Done.Node != q.Node) {
				continue
			}
			if !rec.held() && rec.Queue == 0 {
				continue // changed since the index had it
			}
			found = append(found, match{k, rec})
			if len(found) > limit {
				break
			}
		}
		if !more {
			break
		}
		k := *visited
		from = &k
	}
	switch {
	case len(found) > limit:
		found = found[:limit]
		page.Next = keyCursor(found[limit-1].k)
	case more && visited != nil:
		page.Next = keyCursor(*visited)
	}
	now := time.Now()
	page.Keys = make([]lock.KeyView, len(found))
	var queued []int
	for i, m := range found {
		page.Keys[i] = b.keyView(m.k, &m.rec, now)
		if m.rec.Queue > 0 {
			queued = append(queued, i)
		}
	}
	if err := b.readQueues(ctx, page.Keys, queued, now); err != nil {
		return lock.KeyPage{}, err
	}
	return page, nil
}

func (b *Backend) keyView(k lock.Key, r *keyRec, now time.Time) lock.KeyView {
	v := lock.KeyView{Key: k, QueueLength: r.Queue}
	if r.held() {
		v.Holder, v.Token, v.Lease, v.Unclaimed = r.Holder, r.Token, lock.Lease(r.Lease), r.Claim != 0
		v.AcquiredAt = time.Unix(0, r.Acquired)
	}
	if r.retained(now, b.cfg.CompletedRetention) {
		d := r.Done
		v.LastCompleted = &lock.Completion{Node: d.Node, Token: d.Token, Success: d.OK, Error: d.Err, CompletedAt: time.Unix(0, d.At)}
	}
	return v
}

// readQueues reads from etcd, for the keys at idx, their record and the
// first lock.QueueShown waiters, each key's at one revision: the watch
// keeps no waiter, and the record read with them is the one that counts
// them. One transaction per 64 keys, while someone looks at them.
func (b *Backend) readQueues(parent context.Context, views []lock.KeyView, idx []int, now time.Time) error {
	if len(idx) == 0 {
		return nil
	}
	ctx, cancel := b.bound(parent)
	defer cancel()
	for len(idx) > 0 {
		part := idx[:min(len(idx), 64)]
		idx = idx[len(part):]
		ops := make([]clientv3.Op, 0, 2*len(part))
		for _, i := range part {
			k := views[i].Key
			ops = append(ops, clientv3.OpGet(b.n.key(k)),
				clientv3.OpGet(b.n.queue(k), clientv3.WithPrefix(), clientv3.WithLimit(lock.QueueShown),
					clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend)))
		}
		resp, err := b.cli.Txn(ctx).Then(ops...).Commit()
		if err != nil {
			return b.boundErr(parent, ctx, b.etcdErr("reading queues", err))
		}
		for j, i := range part {
			rkvs := resp.Responses[2*j].GetResponseRange().GetKvs()
			if len(rkvs) == 0 {
				views[i].QueueLength = 0 // gone since the cache had it
				continue
			}
			rec, err := decodeKey(rkvs[0].Value)
			if err != nil {
				return err
			}
			views[i] = b.keyView(views[i].Key, &rec, now)
			qkvs := resp.Responses[2*j+1].GetResponseRange().GetKvs()
			views[i].Queue = make([]lock.Waiter, 0, len(qkvs))
			for _, kv := range qkvs {
				var w waitRec
				if err := jsonUnmarshal(kv.Value, &w); err != nil {
					return err
				}
				views[i].Queue = append(views[i].Queue, lock.Waiter{Node: w.Node, Lease: lock.Lease(w.Lease)})
			}
		}
	}
	return nil
}

// RecentCompletions returns the latest retained completion of each key
// that matches q (its Cursor is ignored), newest first, at most q.Limit of
// them: one pass over the watch's table of keys, which knows each record's
// time, reading the records of those that could be on the list from the
// cache.
//
// With a node filter, which the table cannot tell, the pass only lists the
// keys by time; their records are read and decoded after it, newest first,
// until the list is full, with neither the watcher's mutex nor the cache's
// lock held across them. Decoded in the pass, every retained record (up to
// CompletedMax, 100,000) was decoded under both while no one of them named
// the node: the watch applied nothing for most of a second, and this
// server's commits waited for the cache (BenchmarkRecentCompletionsByNode).
func (b *Backend) RecentCompletions(ctx context.Context, q lock.KeyQuery) ([]lock.CompletionView, error) {
	if err := b.inspecting(ctx); err != nil {
		return nil, err
	}
	if q.Node != "" {
		return b.recentCompletionsOf(q)
	}
	limit := pageLimit(q.Limit)
	type found struct {
		at  int64
		k   lock.Key
		val cVal
	}
	best := make([]found, 0, limit+1)
	newer := func(f found, at int64) int { return cmp.Compare(at, f.at) } // newest first
	now := time.Now()
	oldest := now.Add(-b.cfg.CompletedRetention).UnixNano()
	w := b.w
	// w.mu, then the cache's read lock: the cache's writers never wait
	// for w.mu while they hold theirs.
	w.mu.Lock()
	b.rc.mu.RLock()
	for k, ki := range w.keys.notPlain() {
		at := ki.doneAt
		if at == 0 || at <= oldest || (q.Resource != "" && !strings.Contains(k.Resource, q.Resource)) {
			continue
		}
		if len(best) == limit && at <= best[limit-1].at {
			continue
		}
		e, ok := b.rc.m[b.n.key(k)]
		if !ok {
			continue
		}
		i, _ := slices.BinarySearchFunc(best, at, newer)
		best = slices.Insert(best, i, found{at, k, e.val})
		if len(best) > limit {
			best = best[:limit]
		}
	}
	b.rc.mu.RUnlock()
	w.mu.Unlock()
	out := make([]lock.CompletionView, 0, len(best))
	for _, f := range best {
		if v, ok := b.completionView(f.k, f.val.bytes(), "", now); ok {
			out = append(out, v)
		}
	}
	return out, nil
}

// recentCompletionsOf is RecentCompletions of the records q.Node completed.
func (b *Backend) recentCompletionsOf(q lock.KeyQuery) ([]lock.CompletionView, error) {
	limit := pageLimit(q.Limit)
	type cand struct {
		at int64
		k  lock.Key
	}
	now := time.Now()
	oldest := now.Add(-b.cfg.CompletedRetention).UnixNano()
	w := b.w
	w.mu.Lock()
	cands := make([]cand, 0, w.nDone)
	for k, ki := range w.keys.notPlain() {
		if at := ki.doneAt; at != 0 && at > oldest && (q.Resource == "" || strings.Contains(k.Resource, q.Resource)) {
			cands = append(cands, cand{at, k})
		}
	}
	w.mu.Unlock()
	slices.SortFunc(cands, func(a, b cand) int { return cmp.Compare(b.at, a.at) })
	// A record that does not name the node at all is not decoded.
	quoted, _ := json.Marshal(q.Node)
	out := make([]lock.CompletionView, 0, min(limit, len(cands)))
	names := make([]string, 0, 256)
	for len(cands) > 0 && len(out) < limit {
		part := cands[:min(len(cands), 256)]
		cands = cands[len(part):]
		names = names[:0]
		for _, c := range part {
			names = append(names, b.n.key(c.k))
		}
		for i, raw := range b.rc.raws(names) {
			if raw == nil || !bytes.Contains(raw, quoted) {
				continue
			}
			if v, ok := b.completionView(part[i].k, raw, q.Node, now); ok {
				out = append(out, v)
				if len(out) == limit {
					break
				}
			}
		}
	}
	return out, nil
}

// completionView is the retained completion of k's record raw, if it has
// one (of node, unless node is empty).
func (b *Backend) completionView(k lock.Key, raw []byte, node string, now time.Time) (lock.CompletionView, bool) {
	r, err := decodeKey(raw)
	if err != nil || !r.retained(now, b.cfg.CompletedRetention) || (node != "" && r.Done.Node != node) {
		return lock.CompletionView{}, false
	}
	d := r.Done
	return lock.CompletionView{Key: k, NextHolder: d.Next,
		Completion: lock.Completion{Node: d.Node, Token: d.Token, Success: d.OK, Error: d.Err, CompletedAt: time.Unix(0, d.At)}}, true
}

// InspectSessions returns a page of the sessions, streaming or in grace.
// The watch knows every session; a session's streams are this server's
// and those the other servers write while someone looks (presence.go), and
// its keys are read from its index in etcd, for the sessions on the page.
func (b *Backend) InspectSessions(ctx context.Context, q lock.SessionQuery) (lock.SessionPage, error) {
	var after string
	if q.Cursor != "" {
		c, err := base64.RawURLEncoding.DecodeString(q.Cursor)
		if err != nil || len(c) == 0 {
			return lock.SessionPage{}, fmt.Errorf("%w: cursor %.40q is not one this server gave", lock.ErrInvalid, q.Cursor)
		}
		after = string(c)
	}
	if err := b.inspecting(ctx); err != nil {
		return lock.SessionPage{}, err
	}
	limit := pageLimit(q.Limit)
	type sess struct {
		node    string
		lease   int64
		streams int
	}
	best := make([]sess, 0, min(limit+1, 64))
	byNode := func(s sess, node string) int { return strings.Compare(s.node, node) }
	var page lock.SessionPage
	w := b.w
	w.mu.Lock()
	page.Total = len(w.sessions)
	for node, s := range w.sessions {
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
		best = slices.Insert(best, i, sess{node: node, lease: s.lease})
	}
	for i := range best {
		best[i].streams = len(w.streams[best[i].node])
	}
	w.mu.Unlock()
	if len(best) > limit {
		best = best[:limit]
		page.Next = base64.RawURLEncoding.EncodeToString([]byte(best[limit-1].node))
	}
	page.Sessions = make([]lock.SessionView, len(best))
	nodes := make([]string, len(best))
	leases := make([]int64, len(best))
	for i, s := range best {
		n := s.streams + b.pres.remote(s.node)
		page.Sessions[i] = lock.SessionView{Node: s.node, Streams: n, InGrace: n == 0}
		nodes[i], leases[i] = s.node, s.lease
	}
	keys, err := b.sessionKeys(ctx, nodes, leases)
	if err != nil {
		return lock.SessionPage{}, err
	}
	for i, n := range keys {
		page.Sessions[i].Keys = n
	}
	return page, nil
}

// maxIndexRead bounds the index entries read for one session of a page.
const maxIndexRead = 10000

// sessionKeys counts, for each node's session, the keys it holds or waits
// for under its session lease. A node's index in etcd (P/n/<node>/) names
// every key it held or waited for under a session lease and keeps the
// entries until the session ends; an entry counts when it is of this
// session's lease and the cached record still has the node as holder with
// that lease, or the node in its queue.
func (b *Backend) sessionKeys(parent context.Context, nodes []string, leases []int64) ([]int, error) {
	out := make([]int, len(nodes))
	ctx, cancel := b.bound(parent)
	defer cancel()
	for start := 0; start < len(nodes); start += 128 {
		end := min(len(nodes), start+128)
		ops := make([]clientv3.Op, 0, end-start)
		for _, node := range nodes[start:end] {
			ops = append(ops, clientv3.OpGet(b.n.nodeIndex(node), clientv3.WithPrefix(), clientv3.WithLimit(maxIndexRead)))
		}
		resp, err := b.cli.Txn(ctx).Then(ops...).Commit()
		if err != nil {
			return nil, b.boundErr(parent, ctx, b.etcdErr("reading sessions' indexes", err))
		}
		for j, r := range resp.Responses {
			i := start + j
			lease := strconv.FormatInt(leases[i], 16)
			quoted, _ := json.Marshal(nodes[i])
			for _, kv := range r.GetResponseRange().GetKvs() {
				_, k, ok := b.n.parseNodeIndex(string(kv.Key))
				if !ok || string(kv.Value) != lease {
					continue
				}
				if raw := b.rc.raws([]string{b.n.key(k)})[0]; bytes.Contains(raw, quoted) {
					if rec, err := decodeKey(raw); err == nil && rec.Holder == nodes[i] && rec.SLease == leases[i] {
						out[i]++
						continue
					}
				}
				if idx := b.rc.raws([]string{b.n.queueNode(k, nodes[i])})[0]; idx != nil && b.indexLive(k, nodes[i], idx) {
					out[i]++
				}
			}
		}
	}
	return out, nil
}

// indexLive reports whether node's queue index of k, whose value is raw,
// is a place in k's queue as this server's watch keeps it: a success with
// many waiters leaves their indexes for a moment (indexes.go). A queue the
// watch cannot vouch for takes the index at its word.
func (b *Backend) indexLive(k lock.Key, node string, raw []byte) bool {
	seq, err := indexSeq(raw)
	if err != nil {
		return false
	}
	return b.qs.holds(b.qs.recID(b.n.key(k)), seq, node)
}
