package etcd

import (
	"iter"
	"strings"

	"github.com/dlock/dlock/lock"
)

// keyTable is the watch's table of the keys with a record (watcher.keys):
// what the timers and counts need of each (docs/DESIGN.md, "What a server
// keeps"). Most keys of a busy data set are held and nothing more: no
// deadline (a session lease's hold), no completion record, no waiters.
// Such a key is a mark on its entry in the record cache (cEntry.plain),
// which costs no byte; any other key is a slot of 48 bytes in the table,
// its lock.Key and its keyInfo. A key is in one of the two or in neither,
// and get gives back exactly what set stored, so track's previous state,
// and with it every count, is what one map gave.
//
// The cache is written ahead of the watch by this server's own commits,
// so its entries are not the watch's view; the mark is. Only the table
// sets or clears a mark, the cache's own changes carry it over, and a
// mark whose entry a write-through deleted stays in the cache's gone set
// until the watch applies that delete (cache.go).
//
// A key is marked only under its etcd key as this server names it
// (names.key). A record under another spelling of the same key (one no
// server writes: "%61" for "a") stays in the table, where it shares the
// key's entry as it always did.
type keyTable struct {
	n     names
	c     *recCache
	info  map[lock.Key]keyInfo // every key but the plainly held
	plain int                  // the plainly held: the keys marked in c
}

// plainHeld is the keyInfo of a key held and nothing more.
var plainHeld = keyInfo{held: true, kept: true}

func newKeyTable(n names, c *recCache) keyTable {
	return keyTable{n: n, c: c, info: map[lock.Key]keyInfo{}}
}

// plainKey is the etcd key under which k is marked: key, the record's
// etcd key as the watch has it, when it is k's own (no copy is made);
// else k's, made anew (never a mark's key: a lookup or a clear).
func (t *keyTable) plainKey(k lock.Key, key string) (string, bool) {
	if t.n.isKey(key, k) {
		return key, true
	}
	return t.n.key(k), false
}

// get returns the keyInfo of k, whose record's etcd key is key, and
// whether k has a record.
func (t *keyTable) get(k lock.Key, key string) (keyInfo, bool) {
	if ki, ok := t.info[k]; ok {
		return ki, true
	}
	pk, _ := t.plainKey(k, key)
	if t.c.marked(pk) {
		return plainHeld, true
	}
	return keyInfo{}, false
}

// getKey is get for who has no etcd key at hand.
func (t *keyTable) getKey(k lock.Key) (keyInfo, bool) { return t.get(k, t.n.key(k)) }

// timed returns k's keyInfo if k is not plainly held: what a deadline or a
// completion record is checked against, which a plainly held key has not.
func (t *keyTable) timed(k lock.Key) (keyInfo, bool) {
	ki, ok := t.info[k]
	return ki, ok
}

// set makes ki the keyInfo of k, whose record's etcd key is key, and
// returns what get returned before: the watch's track reads a key's
// previous state and stores its new one with one visit to the cache.
func (t *keyTable) set(k lock.Key, key string, ki keyInfo) (old keyInfo, had bool) {
	pk, own := t.plainKey(k, key)
	plain := ki == plainHeld && own
	old, had = t.info[k]
	if plain {
		delete(t.info, k)
	} else {
		t.info[k] = ki
	}
	return t.previous(pk, plain, old, had)
}

// del forgets k, whose record's etcd key is key, and returns what get
// returned before.
func (t *keyTable) del(k lock.Key, key string) (old keyInfo, had bool) {
	pk, _ := t.plainKey(k, key)
	old, had = t.info[k]
	delete(t.info, k)
	return t.previous(pk, false, old, had)
}

// previous sets pk's mark to plain and returns k's previous keyInfo: old
// if the map had it (had), else plainHeld if pk was marked. A key is in
// the map or marked, never both.
func (t *keyTable) previous(pk string, plain bool, old keyInfo, had bool) (keyInfo, bool) {
	was := t.c.mark(pk, plain)
	t.plain += b2i(plain) - b2i(was)
	if !had && was {
		return plainHeld, true
	}
	return old, had
}

// len is the number of keys with a record.
func (t *keyTable) len() int { return len(t.info) + t.plain }

// notPlain yields the keys that are not plainly held and their keyInfo:
// the keys with a deadline, a completion record or waiters are among them.
func (t *keyTable) notPlain() iter.Seq2[lock.Key, keyInfo] {
	return func(yield func(lock.Key, keyInfo) bool) {
		for k, ki := range t.info {
			if !yield(k, ki) {
				return
			}
		}
	}
}

// plainKeys returns the etcd keys of the plainly held keys (names.parseKey
// reads each back), appended to dst.
func (t *keyTable) plainKeys(dst []string) []string { return t.c.appendMarked(dst) }

// isKey reports whether etcdKey is k's record's etcd key as n names it
// (n.key(k)), without making that string.
func (n names) isKey(etcdKey string, k lock.Key) bool {
	rest, ok := strings.CutPrefix(etcdKey, n.p)
	if !ok {
		return false
	}
	if rest, ok = strings.CutPrefix(rest, "k/"); !ok {
		return false
	}
	if rest, ok = strings.CutPrefix(rest, k.Type.String()); !ok {
		return false
	}
	return len(rest) > 0 && rest[0] == '/' && rest[1:] == esc(k.Resource)
}
