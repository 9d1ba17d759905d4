package etcd

import (
	"context"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/lock"
)

// A success tells its waiters by deleting their queue entries (P/q/) in its
// own transaction: the delete of a waiter's entry is what every server's
// watch tells the waiter by (watch.go). Each waiter also has a queue index
// (P/qn/), which only says where a node waits. A success with more than
// leaveIndexesOver waiters leaves those indexes to a sweep a moment later:
// its transaction then deletes half the keys, and every watch decodes half
// the events, before a waiter is told (docs/DESIGN.md, "An etcd backend",
// "Queue indexes a success leaves").
//
// An index left behind is stale: its queue entry is gone. A reader takes
// an index for a place only with its entry (tx.waiting), and a node that
// queues again writes its index anew, so a stale one is never read as a
// place. The sweep deletes the stale indexes of a key in one transaction
// guarded by the key's record: a node that queues meanwhile writes the
// record, and the sweep reads again. Every server schedules the sweep, on
// the success its watch applies (trans.Left) and for every key whose
// indexes outnumber its waiters when it lists the state, so that a server
// that dies right after its success leaves the sweep to the others; each
// waits sweepAfter plus a random share of it, and finds nothing left to
// do when another server swept first.
type indexSweeper struct {
	b *Backend

	mu   sync.Mutex
	due  map[lock.Key]time.Time
	kick chan struct{}

	// over and after are leaveIndexesOver and sweepAfter, which tests
	// change (export_indexes_test.go).
	over  atomic.Int64
	after atomic.Int64 // nanoseconds

	sweeps atomic.Uint64 // sweeps that deleted (dlock_etcd_queue_index_sweeps_total)
}

const (
	// leaveIndexesOver is the most waiters whose indexes a success
	// deletes itself: a small queue's indexes cost its transaction little,
	// and the sweep would cost a second write.
	leaveIndexesOver = 64
	// sweepAfter is how long after a success its indexes are swept, at
	// the least: long enough that the sweep's deletes do not compete with
	// the telling of the waiters for etcd and the servers' CPU.
	sweepAfter = time.Second
	// sweepBatch bounds the deletes of one sweep transaction, within the
	// 128 operations etcd allows one by default.
	sweepBatch = 100
)

func newIndexSweeper(b *Backend) *indexSweeper {
	s := &indexSweeper{b: b, due: map[lock.Key]time.Time{}, kick: make(chan struct{}, 1)}
	s.over.Store(leaveIndexesOver)
	s.after.Store(int64(sweepAfter))
	return s
}

// leaves reports whether a success with waiters waiters leaves their
// indexes to the sweep.
func (s *indexSweeper) leaves(waiters int) bool { return int64(waiters) > s.over.Load() }

// schedule has k swept at the soonest of at and any time asked before.
func (s *indexSweeper) schedule(k lock.Key, at time.Time) {
	s.mu.Lock()
	if d, ok := s.due[k]; !ok || at.Before(d) {
		s.due[k] = at
	}
	s.mu.Unlock()
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// later is when a sweep asked for now runs: sweepAfter and a random share
// of it from now, so that the servers of a data set do not all sweep at
// once.
func (s *indexSweeper) later() time.Time {
	a := time.Duration(s.after.Load())
	if a <= 0 {
		return time.Now()
	}
	return time.Now().Add(a + rand.N(a))
}

// takeDue removes and returns the keys due by now, and says how long
// until the next of the others is (an hour when none is): one look at the
// keys for all that are due, however many a list scheduled at once.
func (s *indexSweeper) takeDue(now time.Time) ([]lock.Key, time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var keys []lock.Key
	wait := time.Hour
	for k, at := range s.due {
		if d := at.Sub(now); d > 0 {
			wait = min(wait, d)
			continue
		}
		keys = append(keys, k)
		delete(s.due, k)
	}
	return keys, wait
}

// run sweeps each key when it is due, until the backend closes. A key
// asked for again while it is swept is swept again when next due.
func (s *indexSweeper) run() {
	b := s.b
	defer b.wg.Done()
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		keys, wait := s.takeDue(time.Now())
		for _, k := range keys {
			more, err := b.sweepIndexes(k)
			switch {
			case b.ctx.Err() != nil:
				return
			case err != nil:
				// etcd did not answer, or the key's calls kept it busy:
				// the indexes are harmless meanwhile, and swept later.
				b.log.Warn("etcd backend: sweeping the queue indexes a success left failed", "key", k.String(), "err", err)
				s.schedule(k, time.Now().Add(max(time.Second, time.Duration(s.after.Load()))))
			case more:
				s.schedule(k, time.Now())
			}
		}
		if len(keys) > 0 {
			continue
		}
		t.Reset(wait)
		select {
		case <-b.ctx.Done():
			return
		case <-s.kick:
		case <-t.C:
		}
	}
}

// sweepIndexes deletes k's stale queue indexes, at most sweepBatch of them
// while the key has waiters; more says that some are left.
func (b *Backend) sweepIndexes(k lock.Key) (more bool, err error) {
	prefix := b.n.queueNodes(k)
	if !b.rc.mayHoldGroup(prefix) {
		return false, nil // swept already, as far as this server's watch knows
	}
	ctx, cancel := context.WithTimeout(b.ctx, 30*time.Second)
	defer cancel()
	var wrote bool
	_, err = b.run(ctx, k, func(t *tx) error {
		more = false
		defer func() { wrote = len(t.ops) > 0 }()
		if t.rec.Queue == 0 {
			// No waiter: every index is stale. The guard of the record
			// holds off a node that queues meanwhile.
			t.op(clientv3.OpDelete(prefix, clientv3.WithPrefix()))
			return nil
		}
		ws, err := t.head(0)
		if err != nil {
			return err
		}
		live := make(map[string]bool, len(ws))
		for _, w := range ws {
			live[b.n.queueNode(k, w.Node)] = true
		}
		resp, err := b.cli.Get(t.ctx, prefix, clientv3.WithPrefix(), clientv3.WithKeysOnly(), t.atRead())
		if err != nil {
			return t.readErr("reading the queue indexes", err)
		}
		for _, kv := range resp.Kvs {
			if key := string(kv.Key); !live[key] {
				if len(t.ops) == sweepBatch {
					more = true
					break
				}
				t.op(clientv3.OpDelete(key))
			}
		}
		return nil
	})
	if err == nil && wrote {
		b.ix.sweeps.Add(1)
	}
	return more, err
}

// scheduleStale has swept every key of a list whose indexes outnumber its
// waiters: left by a success whose servers all stopped before sweeping.
// indexes counts each key's indexes, and queues its waiters, both by the
// key's "<type>/<res>".
func (s *indexSweeper) scheduleStale(indexes, queues map[string]int) {
	for id, n := range indexes {
		if n <= queues[id] {
			continue
		}
		if k, ok := s.b.n.parseKey(s.b.n.keys() + id); ok {
			s.schedule(k, s.later())
		}
	}
}

// indexID is the "<type>/<res>" of the key whose queue index is key
// ("P/qn/<type>/<res>/<node>").
func (n names) indexID(key string) (string, bool) {
	rest, ok := strings.CutPrefix(key, n.p+"qn/")
	if !ok {
		return "", false
	}
	i := strings.LastIndexByte(rest, '/')
	if i < 0 {
		return "", false
	}
	return rest[:i], true
}
