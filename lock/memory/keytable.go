package memory

import (
	"hash/maphash"
	"iter"

	"github.com/dlock/dlock/lock"
)

// keyTable holds a shard's keys, found by resource and type. It is a hash
// table whose chains run through keyState.sib, the keys of one resource
// in one chain, and each key carries its hash. A key costs the table one
// bucket pointer, 8 to 16 bytes at the load it keeps, where a Go map from
// resource to key cost some 25 (a string and a pointer per slot, at the
// map's load), and neither a lookup along a chain nor a resize hashes a
// resource again (docs/DESIGN.md, "What a held lock costs"). The seed is
// random: which resources share a chain is not a client's choice.
//
// A resize is spread over the calls that follow it, as a Go map's growth
// is, so that no request waits for a whole table to move: until it is
// done, the keys of old[done:] are still there, and each call moves a few
// more buckets (a lookup too, so that a resize does not slow lookups for
// long where keys seldom change).
type keyTable struct {
	seed    maphash.Seed
	buckets []*keyState // a power of two of them, at least minBuckets
	old     []*keyState // the buckets before a resize, nil when none goes on
	done    int         // old[:done] are moved
	n       int
}

// Each call moves old buckets until it has looked at moveBuckets of them
// or moved moveKeys keys. A growth (old buckets hold a key each, at most)
// is then done within len(old)/moveKeys changes, long before the table is
// full again, len(old) more keys; a shrink (old holds fewer than
// len(old)/8 keys) within len(old)/64 changes, before the next could be
// due, len(old)/16 fewer keys. A resize due while another goes on waits
// for it to end.
const (
	minBuckets  = 16
	moveBuckets = 64
	moveKeys    = 8
)

func newKeyTable() keyTable {
	return keyTable{seed: maphash.MakeSeed(), buckets: make([]*keyState, minBuckets)}
}

func (t *keyTable) hash(res string) uint32 { return uint32(maphash.String(t.seed, res)) }

func slot(buckets []*keyState, h uint32) *(*keyState) {
	return &buckets[h&uint32(len(buckets)-1)]
}

// chains returns the chains a key of hash h may be in: its bucket, and
// while a resize goes on, its old bucket if not moved yet (else nil).
func (t *keyTable) chains(h uint32) (cur, old **keyState) {
	cur = slot(t.buckets, h)
	if t.old != nil {
		if j := int(h & uint32(len(t.old)-1)); j >= t.done {
			old = &t.old[j]
		}
	}
	return cur, old
}

// get returns the key (typ, res), nil if the table has none.
func (t *keyTable) get(typ lock.Type, res string) *keyState {
	if t.old != nil {
		t.move()
	}
	h := t.hash(res)
	cur, old := t.chains(h)
	for ks := *cur; ks != nil; ks = ks.sib {
		if ks.hash == h && ks.typ == typ && ks.res == res {
			return ks
		}
	}
	if old != nil {
		for ks := *old; ks != nil; ks = ks.sib {
			if ks.hash == h && ks.typ == typ && ks.res == res {
				return ks
			}
		}
	}
	return nil
}

// resource returns the copy of res that the table's keys of res share,
// res itself if it has none: a new key takes it, so that the keys of one
// resource share one copy.
func (t *keyTable) resource(res string) string {
	h := t.hash(res)
	cur, old := t.chains(h)
	for _, c := range [...]**keyState{cur, old} {
		for o := deref(c); o != nil; o = o.sib {
			if o.hash == h && o.res == res {
				return o.res
			}
		}
	}
	return res
}

// add adds ks, which the table does not have.
func (t *keyTable) add(ks *keyState) {
	h := t.hash(ks.res)
	cur, _ := t.chains(h)
	ks.hash, ks.sib, *cur = h, *cur, ks
	t.n++
	t.move()
	if t.old == nil && t.n > len(t.buckets) {
		t.resize(2 * len(t.buckets))
	}
}

func deref(c **keyState) *keyState {
	if c == nil {
		return nil
	}
	return *c
}

// remove takes ks out of the table; false if it was not in it.
func (t *keyTable) remove(ks *keyState) bool {
	cur, old := t.chains(ks.hash)
	p := cur
	for *p != nil && *p != ks {
		p = &(*p).sib
	}
	if *p == nil && old != nil {
		p = old
		for *p != nil && *p != ks {
			p = &(*p).sib
		}
	}
	if *p == nil {
		return false
	}
	*p, ks.sib = ks.sib, nil
	t.n--
	t.move()
	if t.old == nil && len(t.buckets) > minBuckets && t.n < len(t.buckets)/8 {
		t.resize(len(t.buckets) / 2)
	}
	return true
}

// resize starts moving the keys to n buckets.
func (t *keyTable) resize(n int) {
	t.old, t.done = t.buckets, 0
	t.buckets = make([]*keyState, n)
	t.move()
}

// move moves a step of old buckets, ending the resize after the last.
func (t *keyTable) move() {
	for i, moved := 0, 0; i < moveBuckets && moved < moveKeys && t.old != nil; i++ {
		for ks := t.old[t.done]; ks != nil; moved++ {
			next := ks.sib
			b := slot(t.buckets, ks.hash)
			ks.sib, *b = *b, ks
			ks = next
		}
		t.old[t.done] = nil
		if t.done++; t.done == len(t.old) {
			t.old, t.done = nil, 0
		}
	}
}

// all yields every key, in no order. The table must not be used otherwise
// during the walk: a lookup moves keys.
func (t *keyTable) all() iter.Seq[*keyState] {
	return func(yield func(*keyState) bool) {
		for _, b := range [...][]*keyState{t.buckets, t.old[t.done:]} {
			for _, ks := range b {
				for ; ks != nil; ks = ks.sib {
					if !yield(ks) {
						return
					}
				}
			}
		}
	}
}
