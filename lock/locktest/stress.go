package locktest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/dlock/dlock/lock"
)

// Stress: many goroutines at once, in real time; run with -race.

var stressTests = []test{
	{name: "ManyNodes", run: testStress},
	{name: "OneKeyRace", run: testOneKeyRace},
}

// testStress races hundreds of nodes for a few keys with random success,
// failure and cancellation. After every step it checks that no key has two
// holders and tokens only increase; every wait must end acquired, skipped
// or cancelled within a bound (none forgotten).
func testStress(t *testing.T, s *suite) {
	const workers, rounds = 200, 15
	m := s.open(t, nil)
	keys := []lock.Key{{Type: lock.Pull, Resource: "a"}, {Type: lock.Pull, Resource: "b"}, {Type: lock.Update, Resource: "a"}, {Type: lock.Delete, Resource: "b"}}

	var mu sync.Mutex
	owner := map[lock.Key]string{}
	lastToken := map[lock.Key]uint64{}
	claim := func(k lock.Key, node string, token uint64) error {
		mu.Lock()
		defer mu.Unlock()
		if o := owner[k]; o != "" {
			return fmt.Errorf("%v: %s acquired while %s holds it", k, node, o)
		}
		if token <= lastToken[k] {
			return fmt.Errorf("%v: token %d after %d", k, token, lastToken[k])
		}
		owner[k], lastToken[k] = node, token
		return nil
	}
	disown := func(k lock.Key, node string) error {
		mu.Lock()
		defer mu.Unlock()
		if owner[k] != node {
			return fmt.Errorf("%v: %s releases but %q holds it", k, node, owner[k])
		}
		owner[k] = ""
		return nil
	}
	var counts struct {
		sync.Mutex
		acquired, skipped, cancelled int
	}

	ctx := context.Background()
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			node := fmt.Sprint("w", w)
			st, _, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: node})
			if err != nil {
				t.Error(err)
				return
			}
			defer st.Close()
			wk := &worker{m: m, st: st, node: node, rng: rng, seen: make(map[lock.Key]uint64)}
			for range rounds {
				k := keys[rng.IntN(len(keys))]
				asked := time.Now()
				res, err := m.TryLock(ctx, lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: node})
				took := time.Since(asked)
				if err != nil {
					t.Error(err)
					return
				}
				acquired := res.Acquired
				token := res.Token
				if acquired {
					wk.seen[k] = max(wk.seen[k], token)
				}
				if res.Queued {
					outcome, tok, err := wk.wait(k, took)
					if err != nil {
						t.Error(err)
						return
					}
					counts.Lock()
					switch outcome {
					case "skipped":
						counts.skipped++
					case "cancelled":
						counts.cancelled++
					}
					counts.Unlock()
					acquired, token = outcome == "acquired", tok
				}
				if !acquired {
					continue
				}
				counts.Lock()
				counts.acquired++
				counts.Unlock()
				if err := claim(k, node, token); err != nil {
					t.Error(err)
					return
				}
				runtime.Gosched() // the "work": let others race for the key meanwhile
				if err := disown(k, node); err != nil {
					t.Error(err)
					return
				}
				switch p := rng.IntN(10); {
				case p < 1:
					if r, err := m.Cancel(ctx, k.Type, k.Resource, node); err != nil || !r.Released {
						t.Errorf("cancel by holder: %+v %v", r, err)
						return
					}
				default:
					if _, err := m.Unlock(ctx, lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: node, Success: p < 4, Token: token}); err != nil {
						t.Errorf("unlock by holder %s of %v: %v", node, k, err)
						return
					}
				}
			}
		})
	}
	wg.Wait()
	if s := m.Stats(); s.Held != 0 || s.Queued != 0 {
		t.Fatalf("after every worker finished: %+v", s)
	}
	t.Logf("acquired %d, skipped %d, cancelled %d", counts.acquired, counts.skipped, counts.cancelled)
	if counts.acquired == 0 || counts.skipped == 0 {
		t.Fatalf("the run did not exercise both outcomes: acquired %d, skipped %d", counts.acquired, counts.skipped)
	}
}

// worker is one node of testStress: its session stream, and the events it
// took from the stream but has not looked at yet. A wait looks at those
// first and leaves the ones after its outcome for the next wait.
type worker struct {
	m       lock.Backend
	st      lock.Stream
	node    string
	rng     *rand.Rand
	pending []lock.Delivery
	// The highest token of each key this node was granted: older grants
	// are stale events. Tokens are ordered per key only.
	seen map[lock.Key]uint64
}

// next takes the first pending event; nil when none is pending.
func (w *worker) next() *lock.Event {
	if len(w.pending) == 0 {
		return nil
	}
	ev := w.pending[0].Event
	w.pending[0] = lock.Delivery{}
	w.pending = w.pending[1:]
	return ev
}

// wait waits for a queued node's outcome, cancelling now and then: after
// up to 20 ms plus twice what the backend took to queue it (took), so that
// a backend whose calls take longer than 20 ms still sees waits end in a
// grant and in a skip.
func (w *worker) wait(k lock.Key, took time.Duration) (string, uint64, error) {
	giveUp := time.After(time.Duration(w.rng.IntN(20))*time.Millisecond + 2*took)
	deadline := time.After(30 * time.Second)
	for {
		for ev := w.next(); ev != nil; ev = w.next() {
			if ev.Key != k {
				continue
			}
			switch {
			case ev.Name == lock.EventLockAssigned && ev.Node == w.node && ev.Token > w.seen[k]:
				w.seen[k] = ev.Token
				return "acquired", ev.Token, nil
			case ev.Name == lock.EventOperationCompleted && ev.Success:
				return "skipped", 0, nil
			}
		}
		select {
		case <-w.st.Ready():
			w.pending = w.st.Take(w.pending)
		case <-giveUp:
			r, err := w.m.Cancel(context.Background(), k.Type, k.Resource, w.node)
			if err != nil {
				return "", 0, err
			}
			if r.Dequeued {
				return "cancelled", 0, nil
			}
			if r.Released {
				// The cancel raced a grant: its event is on its way and
				// must not be taken for a later grant.
				return "cancelled", 0, w.drainGrant(k)
			}
			giveUp = nil // the outcome is already on its way
		case <-w.st.Done():
			return "", 0, fmt.Errorf("%s: stream closed", w.node)
		case <-deadline:
			return "", 0, fmt.Errorf("%s waiting for %v: forgotten", w.node, k)
		}
	}
}

// drainGrant consumes the event of a grant the node's cancel released.
func (w *worker) drainGrant(k lock.Key) error {
	deadline := time.After(30 * time.Second)
	for {
		for ev := w.next(); ev != nil; ev = w.next() {
			if ev.Key == k && ev.Name == lock.EventLockAssigned && ev.Node == w.node && ev.Token > w.seen[k] {
				w.seen[k] = ev.Token
				return nil
			}
		}
		select {
		case <-w.st.Ready():
			w.pending = w.st.Take(w.pending)
		case <-deadline:
			return fmt.Errorf("%s: no event for the grant its cancel released", w.node)
		}
	}
}

// testOneKeyRace: N goroutines asking for one key at once get exactly one
// holder; the rest are queued in some FIFO order with distinct positions.
func testOneKeyRace(t *testing.T, s *suite) {
	const n = 64
	m := s.open(t, nil)
	for round := range 20 {
		var wg sync.WaitGroup
		results := make([]lock.LockResult, n)
		start := make(chan struct{})
		res := fmt.Sprint("one-", round)
		for i := range n {
			wg.Go(func() {
				<-start
				r, err := m.TryLock(context.Background(), lock.LockRequest{Type: lock.Pull, Resource: res, Node: fmt.Sprint("n", i)})
				if err != nil {
					t.Error(err)
				}
				results[i] = r
			})
		}
		close(start)
		wg.Wait()
		holders, positions := 0, map[int]bool{}
		for _, r := range results {
			if r.Acquired {
				holders++
			} else if r.Queued {
				positions[r.Position] = true
			}
		}
		if holders != 1 || len(positions) != n-1 {
			t.Fatalf("%d holders and %d distinct queue positions, want 1 and %d", holders, len(positions), n-1)
		}
	}
}
