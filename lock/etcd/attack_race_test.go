package etcd_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/etcd"
)

// grant is an answer that granted a key.
type grant struct {
	k     lock.Key
	token uint64
	node  string
}

// TestAttackRace races nodes on a few keys through three servers of one
// data set, each call on a server picked at random, with session streams
// that open, close (the session lost after a short grace) and move between
// servers, unlocks that are stale, repeated or whose answer was lost, and a
// killer that closes servers at random and opens new ones. It checks what
// docs/DESIGN.md promises: one holder at a time, tokens that increase per
// key, answers that agree with the events, no unlock taken twice, and, once
// every node has gone, every hold and queue place ended and nothing left in
// etcd.
func TestAttackRace(t *testing.T) {
	for _, refs := range []bool{false, true} {
		t.Run(fmt.Sprintf("refs=%v", refs), func(t *testing.T) { attackRace(t, refs, raceMode{}) })
	}
}

// TestAttackRaceStaleCache is TestAttackRace with the servers' caches made
// stale at random before one call in four (etcd.StaleCacheForTest): an
// entry set back to an older version or to a record deleted since, an
// entry forgotten, the cache's revision set back. The cache decides
// nothing (docs/DESIGN.md, "One round trip for a warm call"), so every
// check of TestAttackRace holds.
func TestAttackRaceStaleCache(t *testing.T) {
	for _, refs := range []bool{false, true} {
		t.Run(fmt.Sprintf("refs=%v", refs), func(t *testing.T) { attackRace(t, refs, raceMode{stale: true}) })
	}
}

// TestAttackRaceGrouped is TestAttackRace with every etcd request of the
// servers held back a random moment (up to 2 ms) before it is sent, so that
// many transactions of different keys wait together and share requests
// (docs/DESIGN.md, "Fewer, larger transactions"): every check holds, and
// the run fails if no request carried more than one transaction.
func TestAttackRaceGrouped(t *testing.T) {
	for _, refs := range []bool{false, true} {
		t.Run(fmt.Sprintf("refs=%v", refs), func(t *testing.T) { attackRace(t, refs, raceMode{grouped: true}) })
	}
}

// raceMode is what attackRace does besides racing.
type raceMode struct {
	stale   bool // caches made stale at random (pool.stale)
	grouped bool // requests held back (pool.grouped)
}

func attackRace(t *testing.T, refs bool, mode raceMode) {
	cfg := etcd.DefaultConfig()
	cfg.LockTTL = 2 * time.Second
	cfg.SessionGrace = time.Second
	cfg.ClaimTimeout = time.Second
	cfg.CompletedRetention = 2 * time.Second
	if refs {
		cfg.RefCounting = true
	}
	p := etcdtest.Prefix(t)
	pl := newPoolWith(t, p, cfg, 3, mode.grouped)
	pl.stale = mode.stale
	monitor := newBackend(t, etcdtest.Shared(t).Client(t), p, cfg)
	var keys []lock.Key
	for _, res := range []string{"a", "b/c%2F"} {
		for _, typ := range []lock.Type{lock.Pull, lock.Update, lock.Delete} {
			keys = append(keys, lock.Key{Type: typ, Resource: res})
		}
	}
	hist, stopObs := observeAll(t, monitor, keys)

	var (
		mu      sync.Mutex
		answers []grant
	)
	fail := func(format string, args ...any) { t.Errorf(format, args...) }
	const nodes = 10
	dur := 4 * time.Second
	end := time.Now().Add(dur)
	var wg sync.WaitGroup
	for i := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(i), uint64(time.Now().UnixNano())))
			node := fmt.Sprintf("n%d/é%%", i)
			holds := map[lock.Key]uint64{}
			var st lock.Stream
			var lastID uint64
			closeStream := func() {
				if st != nil {
					st.Close()
					st = nil
				}
			}
			defer closeStream()
			for time.Now().Before(end) {
				// What the stream told: grants by hand-off.
				if st != nil {
					for _, d := range st.Take(nil) {
						if d.ID <= lastID {
							fail("%s: stream id %d after %d", node, d.ID, lastID)
						}
						lastID = d.ID
						if d.Event.Name == lock.EventLockAssigned && d.Event.Node == node {
							holds[d.Event.Key] = d.Event.Token
						}
					}
					select {
					case <-st.Done():
						closeStream()
					default:
					}
				}
				k := keys[r.IntN(len(keys))]
				switch op := r.IntN(100); {
				case op < 30:
					lease := lock.Lease(r.IntN(3))
					res, err := do(pl, r, func(b *etcd.Backend) (lock.LockResult, error) {
						return b.TryLock(context.Background(), lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: node, Lease: lease, SkipRecent: r.IntN(2) == 0})
					})
					switch {
					case err == nil && res.Acquired:
						if res.Holder != node || res.Token == 0 {
							fail("%s: TryLock %v: %+v", node, k, res)
						}
						holds[k] = res.Token
						mu.Lock()
						answers = append(answers, grant{k, res.Token, node})
						mu.Unlock()
					case err == nil:
						delete(holds, k)
					case errors.Is(err, lock.ErrInUse), errors.Is(err, lock.ErrDeleting), errors.Is(err, lock.ErrUpdating), errors.Is(err, lock.ErrTooManySessions):
					default:
						fail("%s: TryLock %v: %v", node, k, err)
					}
				case op < 55:
					tok, ok := holds[k]
					if !ok {
						continue
					}
					delete(holds, k)
					req := lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: node, Success: r.IntN(2) == 0, Error: "boom"}
					if req.Success {
						req.Error = ""
					}
					switch r.IntN(4) {
					case 0:
						req.Token = 0
					case 1: // stale: must change nothing
						stale := req
						stale.Token = tok - 1
						_, err := do(pl, r, func(b *etcd.Backend) (lock.UnlockResult, error) { return b.Unlock(context.Background(), stale) })
						if !errors.Is(err, lock.ErrStaleToken) && !errors.Is(err, lock.ErrNotHolder) {
							fail("%s: a stale unlock of %v: %v", node, k, err)
						}
						req.Token = tok
					default:
						req.Token = tok
					}
					if r.IntN(3) == 0 {
						// The answer is lost: the call gives up at once.
						ctx, cancel := context.WithTimeout(context.Background(), time.Duration(r.IntN(3000))*time.Microsecond)
						_, _ = pl.pick(r).Unlock(ctx, req)
						cancel()
					}
					res, err := do(pl, r, func(b *etcd.Backend) (lock.UnlockResult, error) { return b.Unlock(context.Background(), req) })
					if err != nil {
						if !errors.Is(err, lock.ErrNotHolder) {
							fail("%s: Unlock %v: %v", node, k, err)
						}
						continue
					}
					if r.IntN(3) == 0 { // repeated on another server
						again, err := do(pl, r, func(b *etcd.Backend) (lock.UnlockResult, error) { return b.Unlock(context.Background(), req) })
						switch {
						case err == nil && (!again.Replayed || again.NextHolder != res.NextHolder):
							fail("%s: a repeated Unlock of %v: %+v after %+v, want a replay of it", node, k, again, res)
						case err != nil && !errors.Is(err, lock.ErrNotHolder):
							fail("%s: a repeated Unlock of %v: %v", node, k, err)
						}
					}
				case op < 65:
					res, err := do(pl, r, func(b *etcd.Backend) (lock.CancelResult, error) {
						return b.Cancel(context.Background(), k.Type, k.Resource, node)
					})
					if err != nil || (res.Dequeued && res.Released) {
						fail("%s: Cancel %v: %+v %v", node, k, res, err)
					}
					delete(holds, k)
				case op < 85:
					s, err := do(pl, r, func(b *etcd.Backend) (lock.Status, error) {
						return b.Status(context.Background(), k.Type, k.Resource, node)
					})
					if err != nil {
						fail("%s: Status %v: %v", node, k, err)
					} else if s.Held && s.Holder == node && holds[k] != 0 && s.Token < holds[k] {
						fail("%s: Status %v: token %d below %d granted", node, k, s.Token, holds[k])
					}
				default:
					if st != nil {
						closeStream()
						continue
					}
					b := pl.pick(r)
					s, sub, err := b.Subscribe(context.Background(), lock.SubscribeRequest{Node: node, HasLast: lastID != 0, LastID: lastID})
					if retryable(err) || errors.Is(err, lock.ErrTooManySessions) {
						continue
					}
					if err != nil {
						fail("%s: Subscribe: %v", node, err)
						continue
					}
					st = s
					for _, d := range sub.Replay {
						if d.ID <= lastID && !sub.Missed {
							fail("%s: replayed id %d, not after %d", node, d.ID, lastID)
						}
					}
					if n := len(sub.Replay); n > 0 {
						lastID = max(lastID, sub.Replay[n-1].ID)
					}
					lastID = max(lastID, sub.ID)
				}
			}
		}()
	}
	// The killer.
	wg.Add(1)
	go func() {
		defer wg.Done()
		r := rand.New(rand.NewPCG(99, uint64(time.Now().UnixNano())))
		for time.Now().Add(500 * time.Millisecond).Before(end) {
			time.Sleep(time.Duration(200+r.IntN(400)) * time.Millisecond)
			pl.kill(r.IntN(3))
		}
	}()
	wg.Wait()

	// Every node has gone: every hold and queue place must end, by its
	// lease, its session or its claim timeout.
	for _, k := range keys {
		etcd.Eventually(t, fmt.Sprintf("%v to be free with no waiter", k), func() bool {
			s, err := monitor.Status(context.Background(), k.Type, k.Resource, "")
			return err == nil && !s.Held && s.QueueLength == 0
		})
	}
	cli := etcdtest.Shared(t).Client(t)
	var left []string
	leftOver := func() bool {
		left = left[:0]
		resp, err := cli.Get(context.Background(), p, clientv3.WithPrefix())
		if err != nil {
			return false
		}
		for _, kv := range resp.Kvs {
			rest := strings.TrimPrefix(string(kv.Key), p)
			if rest != "epoch" && rest != "dropped" && !strings.HasPrefix(rest, "k/") && !strings.HasPrefix(rest, "r/") && !strings.HasPrefix(rest, "lost/") {
				left = append(left, rest+" = "+string(kv.Value))
			}
		}
		return len(left) == 0
	}
	deadline := time.Now().Add(time.Minute)
	for !leftOver() {
		if time.Now().After(deadline) {
			dumpHistory(t, cli, p)
			t.Fatalf("a minute after every node went, left in etcd: %q", left)
		}
		time.Sleep(10 * time.Millisecond)
	}
	stopObs()
	for _, k := range keys {
		grants := hist.check(t, k)
		mu.Lock()
		for _, a := range answers {
			if a.k == k && grants[a.token] != a.node {
				t.Errorf("%v: token %d answered to %s, granted to %q by the events", k, a.token, a.node, grants[a.token])
			}
		}
		mu.Unlock()
	}
	t.Logf("%d grants answered", len(answers))
	if mode.grouped {
		var grouped uint64
		pl.mu.Lock()
		for _, b := range pl.all {
			grouped += etcd.GroupedRequestsForTest(b)
		}
		pl.mu.Unlock()
		if grouped == 0 {
			t.Fatal("no request carried more than one transaction")
		}
		t.Logf("%d requests carried more than one transaction", grouped)
	}
}

func dumpHistory(t *testing.T, cli *clientv3.Client, p string) {
	resp, err := cli.Get(context.Background(), p+"q/", clientv3.WithPrefix())
	if err != nil || len(resp.Kvs) == 0 {
		return
	}
	from := resp.Kvs[0].CreateRevision - 3
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch := cli.Watch(ctx, p, clientv3.WithPrefix(), clientv3.WithRev(from))
	deadline := time.After(5 * time.Second)
	for {
		select {
		case r := <-ch:
			for _, ev := range r.Events {
				if strings.Contains(string(ev.Kv.Key), "/s/") || strings.Contains(string(ev.Kv.Key), "/lost/") {
					continue
				}
				t.Logf("rev %d %s %s = %s", ev.Kv.ModRevision, ev.Type, strings.TrimPrefix(string(ev.Kv.Key), p), ev.Kv.Value)
			}
			if len(r.Events) > 0 && r.Events[0].Kv.ModRevision > from+60 {
				return
			}
		case <-deadline:
			return
		}
	}
}
