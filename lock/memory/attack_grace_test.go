package memory

import (
	"math/rand/v2"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/dlock/dlock/lock"
)

// TestAttackGraceGuarantee: a holder's session streams open and close at
// random (a client reconnecting, moving between servers) while it asks
// /status, and a waiter waits. Whatever a grant or a /status answered as
// Guaranteed at t, the key must still be the holder's at every later
// instant before t + Guaranteed: in grace /status says what is left, a
// stream that opens stops the grace, one that closes starts a whole grace
// again. Another goroutine churns a second node's streams and asks its
// /status throughout, so that -race sees the session, grace heap and shard
// mutexes taken together. Fake time (synctest): each instant checked is
// exact. 24 seeds.
func TestAttackGraceGuarantee(t *testing.T) {
	for seed := range uint64(24) {
		synctest.Test(t, func(t *testing.T) {
			const grace = 2 * time.Second
			m := newMemory(t, func(c *Config) { c.SessionGrace = grace; c.ClaimTimeout = 0 })
			rng := rand.New(rand.NewPCG(seed, 0))
			var streams []*stream
			open := func() { streams = append(streams, subscribe(t, m, "h", nil)) }
			open()
			r := mustLock(t, m, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "h", Lease: lock.LeaseSession})
			if !r.Acquired {
				t.Fatal(r)
			}
			ws := subscribe(t, m, "w", nil)
			_ = ws
			if q := mustLock(t, m, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "w", Lease: lock.LeaseSession}); !q.Queued {
				t.Fatal(q)
			}
			until := time.Now().Add(r.Guaranteed)

			stop := make(chan struct{})
			var wg sync.WaitGroup
			wg.Go(func() {
				mustLock(t, m, lock.LockRequest{Type: lock.Pull, Resource: "other", Node: "o", Lease: lock.LeaseSession})
				for {
					st, _, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: "o"})
					if err != nil {
						t.Error(err)
						return
					}
					m.Status(t.Context(), lock.Pull, "other", "o")
					st.Close()
					m.Status(t.Context(), lock.Pull, "other", "o")
					select {
					case <-stop:
						return
					case <-time.After(7 * time.Millisecond):
					}
				}
			})
			defer func() { close(stop); wg.Wait() }()

			handed := false
			for step := 0; step < 400 && !handed; step++ {
				switch rng.IntN(4) {
				case 0:
					open()
				case 1:
					if len(streams) > 0 {
						i := rng.IntN(len(streams))
						streams[i].Close()
						streams = append(streams[:i], streams[i+1:]...)
					}
				case 2:
					st := status(t, m, lock.Pull, "r", "h")
					if st.Holder == "h" {
						until = later(until, time.Now().Add(st.Guaranteed))
					}
				}
				time.Sleep(time.Duration(rng.IntN(int(grace/time.Millisecond))) * time.Millisecond)
				synctest.Wait()
				st := status(t, m, lock.Pull, "r", "")
				if st.Holder != "h" {
					handed = true
					if now := time.Now(); now.Before(until) {
						t.Fatalf("seed %d, step %d: the key went to %q %v before the end of what was guaranteed to h", seed, step, st.Holder, until.Sub(now))
					}
				}
			}
			if !handed {
				t.Logf("seed %d: the key stayed h's through 400 steps", seed)
			}
			for _, st := range streams {
				st.Close()
			}
		})
	}
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
