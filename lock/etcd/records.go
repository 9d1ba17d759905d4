package etcd

import (
	"encoding/json"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/dlock/dlock/lock"
)

// The records under the prefix P (docs/DESIGN.md, "An etcd backend"):
//
//	P/epoch                     the data set's epoch
//	P/k/<type>/<res>            keyRec: holder, token, deadlines, queue count, completion
//	                            (<type> is the type's name, as every server of the
//	                            data set numbers a type of its own differently)
//	P/q/<type>/<res>/<seq>/<node>  waitRec: one waiter, in FIFO order (seq in hex, fixed width)
//	P/qn/<type>/<res>/<node>    the waiter's seq: no duplicate entry, and its position;
//	                            one whose P/q/ entry is gone is stale, left by a
//	                            success with many waiters (indexes.go)
//	P/s/<node>                  a session, attached to its etcd lease
//	P/n/<node>/<type>/<res>     the session lease id of a session-leased hold or wait
//	P/r/<res>                   refRec: the nodes referencing the resource
//	P/lost/<node>/<lease>       the claim of the server that ends a lost session
//	P/dropped                   rewritten by every drop of a key's record
//
// Resources and nodes are path-escaped, so that no id contains the "/" that
// separates a resource from the seq after it.

// keyRec is a key's record. Every change of the key's queue writes it too,
// so that its mod revision guards the whole key in a transaction.
type keyRec struct {
	Holder   string `json:"h,omitempty"`
	Token    uint64 `json:"t,omitempty"`   // the holder's token, or the last one issued
	Lease    uint8  `json:"l,omitempty"`   // lock.LeaseSession or lock.LeaseTTL
	SLease   int64  `json:"sl,omitempty"`  // the etcd lease of the holder's session
	Acquired int64  `json:"at,omitempty"`  // unix nanoseconds
	TTL      int64  `json:"ttl,omitempty"` // ttl lease deadline
	Claim    int64  `json:"cl,omitempty"`  // a hand-off not yet confirmed must be by then
	MaxHold  int64  `json:"mh,omitempty"`
	Queue    int    `json:"q,omitempty"`  // waiters
	Seq      uint64 `json:"s,omitempty"`  // the next waiter's seq
	WaitTTL  int64  `json:"wt,omitempty"` // no ttl waiter expires before this
	Delay    int64  `json:"dl,omitempty"` // a free key is reserved until then: its lock delay (delayed)
	Done     *done  `json:"c,omitempty"`  // the retained completion record
	X        *trans `json:"x,omitempty"`  // the transition this write made
}

// done is a completion.
type done struct {
	Node   string `json:"n"`
	Token  uint64 `json:"t"`
	OK     bool   `json:"ok,omitempty"`
	Err    string `json:"e,omitempty"`
	At     int64  `json:"at"`
	Next   string `json:"nx,omitempty"`
	Unlock bool   `json:"u,omitempty"` // written by an unlock: replayable
}

// trans is what a write did that streams are told: every server derives the
// same events, with the same ids, from it (watch.go).
type trans struct {
	Assigned string   `json:"a,omitempty"`  // lock_assigned to this node, with the record's token
	Done     *done    `json:"c,omitempty"`  // operation_completed
	Skip     bool     `json:"k,omitempty"`  // the waiters removed by this write were skipped
	Left     bool     `json:"ix,omitempty"` // their queue indexes were left to a sweep (indexes.go)
	Refused  []string `json:"r,omitempty"`  // waiters refused at promotion (in_use)
	At       int64    `json:"at,omitempty"` // when they were refused
}

// waitRec is one waiter.
type waitRec struct {
	Node   string `json:"n"`
	Lease  uint8  `json:"l"`
	SLease int64  `json:"sl,omitempty"`
	TTL    int64  `json:"ttl,omitempty"`
}

// refRec is a resource's references.
type refRec struct {
	Nodes []string `json:"n"` // sorted
}

// sessRec is a session's record. Lease names the session: its
// session-leased holds and waits, its index entries and its end carry it.
// A record with Home lives on that lease, the home lease of the server
// that made it, and its own lease is reserved, not granted: it is granted,
// and the record put under it, when the session first needs to outlive
// that server, at its first session-leased hold or wait or when another
// server takes one of its streams (docs/DESIGN.md, "Home leases").
type sessRec struct {
	Lease int64 `json:"l"`
	Home  int64 `json:"h,omitempty"`
}

func (r *keyRec) held() bool { return r.Holder != "" }

// delayed reports a key reserved by its lock delay. A hold that ended
// because its lease ran out sets Delay (tx.end), with no holder; until a
// timer finds it passed and clears it (expireTx), the key is handed to no
// one and a newcomer is queued, since the old holder may still be running
// (docs/DESIGN.md, "Leases").
func (r *keyRec) delayed() bool { return r.Delay != 0 }

// bare reports a record with nothing in it at all, not even a completion
// record (the opposite type's success erased it, or none is kept): the
// key is absent, and its timer drops the record at once (deadline).
func (r *keyRec) bare() bool {
	return !r.held() && r.Queue == 0 && r.Done == nil && !r.delayed()
}

// empty reports a record that keeps nothing: the key is absent.
func (r *keyRec) empty(now time.Time, retention time.Duration) bool {
	return !r.held() && r.Queue == 0 && !r.delayed() && !r.retained(now, retention)
}

// retained reports whether the completion record is still to be used.
func (r *keyRec) retained(now time.Time, retention time.Duration) bool {
	return r.Done != nil && now.Sub(time.Unix(0, r.Done.At)) < retention
}

// deadline is the earliest time a timer must look at the key, 0 for none.
func (r *keyRec) deadline(retention time.Duration) int64 {
	var d int64
	early := func(t int64) {
		if t != 0 && (d == 0 || t < d) {
			d = t
		}
	}
	if r.held() {
		if r.Lease == uint8(lock.LeaseTTL) {
			early(r.TTL)
		}
		early(r.Claim)
		early(r.MaxHold)
	}
	if r.Queue > 0 {
		early(r.WaitTTL)
		if !r.held() && !r.delayed() {
			early(1) // waiters of a free key are promoted at once
		}
	}
	if !r.held() {
		early(r.Delay) // the end of the lock delay hands the key on
	}
	if r.Done != nil {
		early(r.Done.At + int64(retention))
	}
	if r.bare() {
		early(1) // an empty record is dropped at once
	}
	return d
}

func encode(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(fmt.Sprintf("etcd backend: encoding %T: %v", v, err)) // only plain structs of strings and numbers
	}
	return string(b)
}

// decodeKey decodes a key's record, as etcd has it or as the cache keeps
// it (cacherec.go).
func decodeKey(b []byte) (keyRec, error) {
	var r keyRec
	if len(b) == 0 {
		return r, nil
	}
	if b[0] == compactTag {
		return decodeCompact(b)
	}
	if r, ok := fastKey(b); ok {
		return r, nil
	}
	if err := json.Unmarshal(b, &r); err != nil {
		return r, fmt.Errorf("etcd backend: a key record that is not ours: %w", err)
	}
	return r, nil
}

// names builds the etcd keys of one data set.
type names struct{ p string }

func esc(s string) string { return url.PathEscape(s) }

func (n names) epoch() string { return n.p + "epoch" }

// dropped is written by every transaction that drops a key's record: a
// grant of a key read absent is guarded by it (tx.load), so that no record
// of the key was made and dropped again between its read and its commit
// with a token the new grant's would not be above.
func (n names) dropped() string { return n.p + "dropped" }
func (n names) keys() string    { return n.p + "k/" }
func (n names) key(k lock.Key) string {
	return n.p + "k/" + k.Type.String() + "/" + esc(k.Resource)
}
func (n names) queue(k lock.Key) string {
	return n.p + "q/" + k.Type.String() + "/" + esc(k.Resource) + "/"
}

// wait is a waiter's key: its seq, in FIFO order, then its node, so that a
// watch learns who left the queue from the key alone, without the deleted
// value (which etcd would read once for each waiter of a success).
func (n names) wait(k lock.Key, seq uint64, node string) string {
	return n.waitSeq(k, seq) + "/" + esc(node)
}

// waitSeq is the prefix of the waiter at seq, and the end of a range of the
// waiters before seq.
func (n names) waitSeq(k lock.Key, seq uint64) string {
	return n.queue(k) + fmt.Sprintf("%016x", seq)
}
func (n names) queueNodes(k lock.Key) string {
	return n.p + "qn/" + k.Type.String() + "/" + esc(k.Resource) + "/"
}
func (n names) queueNode(k lock.Key, node string) string { return n.queueNodes(k) + esc(node) }
func (n names) sessions() string                         { return n.p + "s/" }
func (n names) session(node string) string               { return n.p + "s/" + esc(node) }
func (n names) nodeIndexes() string                      { return n.p + "n/" }
func (n names) nodeIndex(node string) string             { return n.p + "n/" + esc(node) + "/" }
func (n names) nodeKey(node string, k lock.Key) string {
	return n.nodeIndex(node) + k.Type.String() + "/" + esc(k.Resource)
}
func (n names) refs() string          { return n.p + "r/" }
func (n names) ref(res string) string { return n.p + "r/" + esc(res) }
func (n names) lost(node string, l int64) string {
	return n.p + "lost/" + esc(node) + "/" + strconv.FormatInt(l, 16)
}

// parseKey reads a key back from its record's etcd key ("P/k/<type>/<res>").
func (n names) parseKey(etcdKey string) (lock.Key, bool) {
	rest, ok := strings.CutPrefix(etcdKey, n.keys())
	if !ok {
		return lock.Key{}, false
	}
	ts, res, ok := strings.Cut(rest, "/")
	if !ok {
		return lock.Key{}, false
	}
	// A type a server of the data set took from a caller: this one may
	// never have seen it, and must name the key all the same.
	t, err := lock.InternType(ts)
	if err != nil {
		return lock.Key{}, false
	}
	r, err := url.PathUnescape(res)
	if err != nil {
		return lock.Key{}, false
	}
	return lock.Key{Type: t, Resource: r}, true
}

// parseWait reads the key and the node of a waiter's etcd key
// ("P/q/<type>/<res>/<seq>/<node>").
func (n names) parseWait(etcdKey string) (lock.Key, string, bool) {
	rest, ok := strings.CutPrefix(etcdKey, n.p+"q/")
	if !ok {
		return lock.Key{}, "", false
	}
	i := strings.LastIndexByte(rest, '/')
	if i < 0 {
		return lock.Key{}, "", false
	}
	node, err := url.PathUnescape(rest[i+1:])
	if err != nil {
		return lock.Key{}, "", false
	}
	rest = rest[:i]
	if i = strings.LastIndexByte(rest, '/'); i < 0 {
		return lock.Key{}, "", false
	}
	k, ok := n.parseKey(n.keys() + rest[:i])
	return k, node, ok
}

// parseNode reads the node of a session's etcd key ("P/s/<node>").
func (n names) parseNode(etcdKey string) (string, bool) {
	rest, ok := strings.CutPrefix(etcdKey, n.sessions())
	if !ok {
		return "", false
	}
	node, err := url.PathUnescape(rest)
	return node, err == nil
}

// parseNodeIndex reads a node index entry ("P/n/<node>/<type>/<res>").
func (n names) parseNodeIndex(etcdKey string) (string, lock.Key, bool) {
	rest, ok := strings.CutPrefix(etcdKey, n.nodeIndexes())
	if !ok {
		return "", lock.Key{}, false
	}
	ns, kp, ok := strings.Cut(rest, "/")
	if !ok {
		return "", lock.Key{}, false
	}
	node, err := url.PathUnescape(ns)
	if err != nil {
		return "", lock.Key{}, false
	}
	k, ok := n.parseKey(n.keys() + kp)
	return node, k, ok
}

// parseRef reads a resource back from its references' etcd key.
func (n names) parseRef(etcdKey string) (string, bool) {
	rest, ok := strings.CutPrefix(etcdKey, n.refs())
	if !ok {
		return "", false
	}
	r, err := url.PathUnescape(rest)
	return r, err == nil
}

// holdEnds are what ends a hold, read from its record: its lease (a ttl
// deadline or a session's etcd lease) and its claim and max hold deadlines,
// in unix nanoseconds, 0 for none.
type holdEnds struct {
	lease               uint8
	slease              int64
	ttl, claim, maxHold int64
}

func endsOf(rec *keyRec) holdEnds {
	return holdEnds{lease: rec.Lease, slease: rec.SLease, ttl: rec.TTL, claim: rec.Claim, maxHold: rec.MaxHold}
}
