package etcd

import (
	"slices"
	"strings"

	"github.com/dlock/dlock/lock"
)

// keyIndex is the sorted set of the keys with a holder or waiters, by
// resource then type: the order the operators' view walks them in, from any
// cursor, a budget of keys at a time (inspect.go). It exists only while
// someone looks (viewer): the watch's own table is a hash map, which a walk
// could not resume.
//
// It is a list of sorted blocks of at most indexBlock keys: an insert or a
// removal moves at most a block's keys and a block header, and a walk from a
// cursor is two binary searches.
type keyIndex struct {
	blocks [][]lock.Key
	n      int
}

// indexBlock bounds a block; a full one splits in two.
const indexBlock = 512

func compareKeys(a, b lock.Key) int {
	if c := strings.Compare(a.Resource, b.Resource); c != 0 {
		return c
	}
	return lock.CompareTypes(a.Type, b.Type)
}

// newKeyIndex makes an index of keys, which it sorts.
func newKeyIndex(keys []lock.Key) *keyIndex {
	slices.SortFunc(keys, compareKeys)
	x := &keyIndex{n: len(keys)}
	for len(keys) > 0 {
		n := min(len(keys), indexBlock/2)
		x.blocks = append(x.blocks, slices.Clone(keys[:n]))
		keys = keys[n:]
	}
	return x
}

// block returns the block k belongs in: the last one whose first key is
// not after k (the first block for a key before all).
func (x *keyIndex) block(k lock.Key) int {
	i, _ := slices.BinarySearchFunc(x.blocks, k, func(b []lock.Key, k lock.Key) int {
		return compareKeys(b[0], k)
	})
	if i < len(x.blocks) && compareKeys(x.blocks[i][0], k) == 0 {
		return i
	}
	return max(i-1, 0)
}

// set adds k to the index, or takes it out.
func (x *keyIndex) set(k lock.Key, in bool) {
	if len(x.blocks) == 0 {
		if in {
			x.blocks, x.n = [][]lock.Key{{k}}, 1
		}
		return
	}
	bi := x.block(k)
	b := x.blocks[bi]
	i, found := slices.BinarySearchFunc(b, k, compareKeys)
	switch {
	case in && !found:
		b = slices.Insert(b, i, k)
		x.n++
		if len(b) > indexBlock {
			half := slices.Clone(b[len(b)/2:])
			b = slices.Clip(b[:len(b)/2])
			x.blocks = slices.Insert(x.blocks, bi+1, half)
		}
		x.blocks[bi] = b
	case !in && found:
		b = slices.Delete(b, i, i+1)
		x.n--
		if len(b) == 0 {
			x.blocks = slices.Delete(x.blocks, bi, bi+1)
		} else {
			x.blocks[bi] = b
		}
	}
}

// after appends to buf up to n keys that come after from (all keys when
// from is nil), in order, and reports whether the index has more after
// the last one appended.
func (x *keyIndex) after(from *lock.Key, n int, buf []lock.Key) ([]lock.Key, bool) {
	bi, i := 0, 0
	if from != nil && len(x.blocks) > 0 {
		bi = x.block(*from)
		var found bool
		i, found = slices.BinarySearchFunc(x.blocks[bi], *from, compareKeys)
		if found {
			i++
		}
	}
	for ; bi < len(x.blocks); bi, i = bi+1, 0 {
		for _, k := range x.blocks[bi][i:] {
			if n == 0 {
				return buf, true
			}
			buf = append(buf, k)
			n--
		}
	}
	return buf, false
}
