package lock

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"
	"time"
)

// TestStress races hundreds of nodes for a few keys with random success,
// failure and cancellation. After every step it checks that no key has two
// holders and tokens only increase; every wait must end acquired, skipped
// or cancelled within a bound (none forgotten).
func TestStress(t *testing.T) {
	const workers, rounds = 200, 15
	m := newMemory(t, nil)
	keys := []Key{{Pull, "a"}, {Pull, "b"}, {Update, "a"}, {Delete, "b"}}

	var mu sync.Mutex
	owner := map[Key]string{}
	lastToken := map[Key]uint64{}
	claim := func(k Key, node string, token uint64) error {
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
	disown := func(k Key, node string) error {
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
			st, _, err := m.Subscribe(t.Context(), SubscribeRequest{Node: node})
			if err != nil {
				t.Error(err)
				return
			}
			defer st.Close()
			// The highest token of each key this node was granted: older
			// grants are stale events. Tokens are ordered per key only.
			seen := make(map[Key]uint64)
			for range rounds {
				k := keys[rng.IntN(len(keys))]
				res, err := m.TryLock(ctx, LockRequest{Type: k.Type, Resource: k.Resource, Node: node})
				if err != nil {
					t.Error(err)
					return
				}
				acquired := res.Acquired
				token := res.Token
				if acquired {
					seen[k] = max(seen[k], token)
				}
				if res.Queued {
					last := seen[k]
					outcome, tok, err := wait(st.(*stream), k, node, &last, rng, m)
					seen[k] = last
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
					if _, err := m.Unlock(ctx, UnlockRequest{Type: k.Type, Resource: k.Resource, Node: node, Success: p < 4, Token: token}); err != nil {
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

// wait waits for a queued node's outcome, cancelling now and then.
func wait(st *stream, k Key, node string, seen *uint64, rng *rand.Rand, m *Memory) (string, uint64, error) {
	giveUp := time.After(time.Duration(rng.IntN(20)) * time.Millisecond)
	deadline := time.After(30 * time.Second)
	var pending []Delivery
	for {
		for len(pending) > 0 {
			ev := pending[0].Event
			pending = pending[1:]
			if ev.Key != k {
				continue
			}
			switch {
			case ev.Name == EventLockAssigned && ev.Node == node && ev.Token > *seen:
				*seen = ev.Token
				st.requeue(pending)
				return "acquired", ev.Token, nil
			case ev.Name == EventOperationCompleted && ev.Success:
				st.requeue(pending)
				return "skipped", 0, nil
			}
		}
		select {
		case <-st.Ready():
			pending = st.Take(pending)
		case <-giveUp:
			r, err := m.Cancel(context.Background(), k.Type, k.Resource, node)
			if err != nil {
				return "", 0, err
			}
			if r.Dequeued {
				st.requeue(pending)
				return "cancelled", 0, nil
			}
			if r.Released {
				// The cancel raced a grant: its event is on its way and
				// must not be taken for a later grant.
				st.requeue(pending)
				return "cancelled", 0, drainGrant(st, k, node, seen)
			}
			giveUp = nil // the outcome is already on its way
		case <-st.Done():
			return "", 0, fmt.Errorf("%s: stream closed", node)
		case <-deadline:
			return "", 0, fmt.Errorf("%s waiting for %v: forgotten", node, k)
		}
	}
}

func drainGrant(st *stream, k Key, node string, seen *uint64) error {
	deadline := time.After(30 * time.Second)
	var pending []Delivery
	for {
		for i, d := range pending {
			if ev := d.Event; ev.Key == k && ev.Name == EventLockAssigned && ev.Node == node && ev.Token > *seen {
				*seen = ev.Token
				st.requeue(pending[i+1:])
				return nil
			}
		}
		pending = pending[:0]
		select {
		case <-st.Ready():
			pending = st.Take(pending)
		case <-deadline:
			return fmt.Errorf("%s: no event for the grant its cancel released", node)
		}
	}
}

// TestOneKeyRace: N goroutines asking for one key at once get exactly one
// holder; the rest are queued in some FIFO order with distinct positions.
func TestOneKeyRace(t *testing.T) {
	const n = 64
	for range 20 {
		m := newMemory(t, nil)
		var wg sync.WaitGroup
		results := make([]LockResult, n)
		start := make(chan struct{})
		for i := range n {
			wg.Go(func() {
				<-start
				r, err := m.TryLock(context.Background(), LockRequest{Type: Pull, Resource: "one", Node: fmt.Sprint("n", i)})
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
		m.Close()
	}
}

// requeue puts events a test took but did not use back in front, so the
// next wait sees them.
func (st *stream) requeue(ds []Delivery) {
	if len(ds) == 0 {
		return
	}
	st.mu.Lock()
	st.queue = append(append([]Delivery(nil), ds...), st.queue...)
	st.mu.Unlock()
	select {
	case st.ready <- struct{}{}:
	default:
	}
}
