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
// Such a key is a slot in a set of etcd keys, 16 bytes, the watch's copy
// of its etcd key that the cache keeps too; any other key is a slot of
// 48 bytes in the table, its lock.Key and its keyInfo. A key is in one of
// the two or in neither, and get gives back exactly what set stored, so
// track's previous state, and with it every count, is what one map gave.
//
// A key is in the set only under its etcd key as this server names it
// (names.key). A record under another spelling of the same key (one no
// server writes: "%61" for "a") stays in the table, where it shares the
// key's entry as it always did.
type keyTable struct {
	n     names
	info  map[lock.Key]keyInfo // every key but the plainly held
	plain map[string]struct{}  // the plainly held, by etcd key
}

// plainHeld is the keyInfo of a key held and nothing more.
var plainHeld = keyInfo{held: true, kept: true}

func newKeyTable(n names) keyTable {
	return keyTable{n: n, info: map[lock.Key]keyInfo{}, plain: map[string]struct{}{}}
}

// plainKey is the etcd key under which k is in the set: key, the record's
// etcd key as the watch has it, when it is k's own (no copy is made);
// else k's, made anew (never a set's key: a lookup or a delete).
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
	if _, ok := t.plain[pk]; ok {
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

// set makes ki the keyInfo of k, whose record's etcd key is key.
func (t *keyTable) set(k lock.Key, key string, ki keyInfo) {
	pk, own := t.plainKey(k, key)
	if ki == plainHeld && own {
		delete(t.info, k)
		t.plain[pk] = struct{}{}
		return
	}
	delete(t.plain, pk)
	t.info[k] = ki
}

// del forgets k, whose record's etcd key is key.
func (t *keyTable) del(k lock.Key, key string) {
	pk, _ := t.plainKey(k, key)
	delete(t.info, k)
	delete(t.plain, pk)
}

// len is the number of keys with a record.
func (t *keyTable) len() int { return len(t.info) + len(t.plain) }

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

// plainKeys yields the etcd keys of the plainly held keys (names.parseKey
// reads each back).
func (t *keyTable) plainKeys() iter.Seq[string] {
	return func(yield func(string) bool) {
		for key := range t.plain {
			if !yield(key) {
				return
			}
		}
	}
}

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
