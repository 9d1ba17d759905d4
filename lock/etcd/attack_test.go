package etcd_test

// Attacks on the etcd backend (attack_*_test.go): a hostile client and an
// operator who kills things at the worst moment. Each test waits for states
// (liveness bounds only) and fails when a rule of docs/DESIGN.md is broken.

import (
	"cmp"
	"context"
	"errors"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/etcd"
)

// withPrefix is c on the data set at prefix p.
func withPrefix(c etcd.Config, p string) etcd.Config {
	c.Prefix = p
	return c
}

// newBackend opens a backend on cli's etcd at prefix p, closed at cleanup.
func newBackend(t *testing.T, cli *clientv3.Client, p string, cfg etcd.Config) *etcd.Backend {
	t.Helper()
	b, err := etcd.New(t.Context(), cli, withPrefix(cfg, p))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// pool is the servers of one data set that a test calls at random, some of
// which a killer closes and replaces at random moments.
type pool struct {
	t   *testing.T
	p   string
	cfg etcd.Config

	mu  sync.Mutex
	bs  []*etcd.Backend
	all []*etcd.Backend

	// stale: pick makes the cache of the server it picks stale, one time
	// in four (etcd.StaleCacheForTest).
	stale bool
	// grouped: every server opened holds its requests back
	// (etcd.HoldRequestsForTest).
	grouped bool
}

// newPoolWith opens n servers of the data set at p; grouped holds every
// etcd request of the servers back a random moment before it is sent
// (etcd.HoldRequestsForTest).
func newPoolWith(t *testing.T, p string, cfg etcd.Config, n int, grouped bool) *pool {
	pl := &pool{t: t, p: p, cfg: cfg, grouped: grouped}
	for range n {
		b := pl.open()
		pl.bs = append(pl.bs, b)
	}
	t.Cleanup(func() {
		pl.mu.Lock()
		defer pl.mu.Unlock()
		for _, b := range pl.all {
			b.Close()
		}
	})
	return pl
}

func (pl *pool) open() *etcd.Backend {
	b, err := etcd.New(context.Background(), etcdtest.Shared(pl.t).Client(pl.t), withPrefix(pl.cfg, pl.p))
	if err != nil {
		pl.t.Errorf("opening a server: %v", err)
		return nil
	}
	if pl.grouped {
		etcd.HoldRequestsForTest(b, 2*time.Millisecond)
	}
	pl.mu.Lock()
	pl.all = append(pl.all, b)
	pl.mu.Unlock()
	return b
}

func (pl *pool) pick(r *rand.Rand) *etcd.Backend {
	pl.mu.Lock()
	b := pl.bs[r.IntN(len(pl.bs))]
	pl.mu.Unlock()
	if pl.stale && r.IntN(4) == 0 {
		etcd.StaleCacheForTest(b, r)
	}
	return b
}

// kill closes server i, as a SIGKILL would end it, and opens another in
// its place.
func (pl *pool) kill(i int) {
	pl.mu.Lock()
	old := pl.bs[i]
	pl.mu.Unlock()
	old.Close()
	nb := pl.open()
	if nb == nil {
		return
	}
	pl.mu.Lock()
	pl.bs[i] = nb
	pl.mu.Unlock()
}

// retryable is an answer a client takes to another server.
func retryable(err error) bool {
	return errors.Is(err, lock.ErrClosed) || errors.Is(err, lock.ErrUnavailable)
}

// do calls f on random servers until one answers other than retryable.
func do[T any](pl *pool, r *rand.Rand, f func(b *etcd.Backend) (T, error)) (T, error) {
	for i := 0; ; i++ {
		v, err := f(pl.pick(r))
		if !retryable(err) || i == 100 {
			return v, err
		}
	}
}

// history is what the observers of a data set's keys received.
type history struct {
	mu     sync.Mutex
	events map[lock.Key][]lock.Delivery
}

// observeAll opens an observer of each key on b and collects their events
// until the test's end; it fails the test if one ends early.
func observeAll(t *testing.T, b lock.Backend, keys []lock.Key) (*history, func()) {
	h := &history{events: map[lock.Key][]lock.Delivery{}}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for _, k := range keys {
		st, _, err := b.Subscribe(context.Background(), lock.SubscribeRequest{Observe: &k})
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer st.Close()
			for {
				select {
				case <-st.Ready():
					got := st.Take(nil)
					h.mu.Lock()
					h.events[k] = append(h.events[k], got...)
					h.mu.Unlock()
				case <-st.Done():
					t.Errorf("the observer of %v ended (slow %v)", k, st.Slow())
					return
				case <-stop:
					got := st.Take(nil)
					h.mu.Lock()
					h.events[k] = append(h.events[k], got...)
					h.mu.Unlock()
					return
				}
			}
		}()
	}
	var once sync.Once
	stopAll := func() { once.Do(func() { close(stop); wg.Wait() }) }
	t.Cleanup(stopAll) // before b closes: cleanups run last in, first out
	return h, stopAll
}

// check holds one key's events to the state machine of docs/DESIGN.md:
// ids increase, tokens strictly increase, a grant comes only when the key
// has no holder (the end of the last hold comes in the same revision as a
// hand-off, with the lower index), and every end is of the holder. It
// returns the node of every token granted.
func (h *history) check(t *testing.T, k lock.Key) map[uint64]string {
	t.Helper()
	h.mu.Lock()
	evs := slices.Clone(h.events[k])
	h.mu.Unlock()
	grants := map[uint64]string{}
	for i := 1; i < len(evs); i++ {
		if evs[i].ID <= evs[i-1].ID {
			t.Errorf("%v: event id %d after %d", k, evs[i].ID, evs[i-1].ID)
		}
	}
	// Within a revision, the end of a hold (index 1) goes before the
	// grant (index 0) that hands the key on.
	slices.SortStableFunc(evs, func(a, b lock.Delivery) int {
		if a.ID/8 != b.ID/8 {
			return cmp.Compare(a.ID, b.ID)
		}
		return cmp.Compare(b.ID%8, a.ID%8)
	})
	holder, last := "", uint64(0)
	for _, d := range evs {
		ev := d.Event
		switch ev.Name {
		case lock.EventLockAssigned:
			if holder != "" {
				t.Errorf("%v: %s granted token %d (id %d) while %s holds: two holders", k, ev.Node, ev.Token, d.ID, holder)
			}
			if ev.Token <= last {
				t.Errorf("%v: token %d granted to %s after token %d", k, ev.Token, ev.Node, last)
			}
			holder, last = ev.Node, ev.Token
			grants[ev.Token] = ev.Node
		case lock.EventOperationCompleted:
			if ev.Node != holder {
				t.Errorf("%v: operation_completed of %s (id %d) while %q holds", k, ev.Node, d.ID, holder)
			}
			holder = ""
		}
	}
	return grants
}
