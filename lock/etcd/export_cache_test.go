package etcd

import (
	"math/rand/v2"
	"sync"
	"time"
)

// staleHist is what one backend's cache held at the injections so far:
// each key's versions, and the cache's revisions.
type staleHist struct {
	mu   sync.Mutex
	vers map[string][]cEntry
	revs []int64
}

var staleHists sync.Map // *Backend → *staleHist

// StaleCacheForTest makes b's cache what a watch that lags could have
// left it (docs/DESIGN.md, "One round trip for a warm call"): an entry
// set back to a version it had before (or to one of a record deleted
// since), an entry forgotten (not yet seen), or the cache's revision set
// back to one it had. Never a version a key never had: the cache is
// stale, never wrong about a revision. The watch goes on applying changes
// on top of it.
func StaleCacheForTest(b *Backend, r *rand.Rand) {
	h0, _ := staleHists.LoadOrStore(b, &staleHist{vers: map[string][]cEntry{}})
	h := h0.(*staleHist)
	h.mu.Lock()
	defer h.mu.Unlock()
	c := b.rc
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.live {
		return
	}
	for key, e := range c.m {
		vs := h.vers[key]
		if len(vs) == 0 || vs[len(vs)-1].mod() != e.mod() {
			if len(vs) == 8 {
				vs = vs[1:]
			}
			h.vers[key] = append(vs, e)
		}
	}
	if len(h.revs) == 0 || h.revs[len(h.revs)-1] != c.rev {
		if len(h.revs) == 8 {
			h.revs = h.revs[1:]
		}
		h.revs = append(h.revs, c.rev)
	}
	switch r.IntN(3) {
	case 0: // an older version, or a deleted record's last
		var keys []string
		for key := range h.vers {
			keys = append(keys, key)
		}
		if len(keys) == 0 {
			return
		}
		key := keys[r.IntN(len(keys))]
		vs := h.vers[key]
		// The watch's mark is its own view, which no staleness of the
		// cache's record changes: the entry keeps the mark it has now.
		e := vs[r.IntN(len(vs))]
		e.modp = e.mod()
		if c.markedLocked(key) {
			e.modp |= plainMark
		}
		if _, ok := c.m[key]; !ok {
			c.group(key, true)
			delete(c.gone, key)
		}
		c.m[key] = e
	case 1: // not yet seen
		for key, e := range c.m {
			c.remove(key, e)
			return
		}
	default: // a revision the cache had
		c.rev = h.revs[r.IntN(len(h.revs))]
	}
}

// HoldRequestsForTest holds each etcd request of b's grouper (group.go)
// back a random moment of up to d before it is sent: a slow etcd, as seen
// from b, so that what arrives meanwhile waits and leaves together. Call it
// before b's first call.
func HoldRequestsForTest(b *Backend, d time.Duration) {
	hold := func() { time.Sleep(rand.N(d)) }
	b.g.hold.Store(&hold)
}

// GroupedRequestsForTest is the number of b's requests that carried more
// than one transaction.
func GroupedRequestsForTest(b *Backend) uint64 { return b.g.grouped.Load() }

// WriteRequestsForTest is how many write requests the grouper sent, and
// the transactions they carried.
func WriteRequestsForTest(b *Backend) (requests, txns uint64) {
	return b.g.requests.Load(), b.g.txns.Load()
}
