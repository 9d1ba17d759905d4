package main

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/internal/dlocktest/kit"
)

// What the attack tests share: a holder's Lost watched, a waiter's Lock
// run in the background, and the moment the waiter is in the queue.

// lostAt records when a client's Lost closed.
func lostAt(lost <-chan struct{}) <-chan time.Time {
	out := make(chan time.Time, 1)
	go func() {
		<-lost
		out <- time.Now()
	}()
	return out
}

// grant is a waiter's Lock, and when it returned.
type grant struct {
	r   client.Result
	at  time.Time
	err error
}

// lockLater runs c.Lock in the background; its outcome arrives once.
func lockLater(ctx context.Context, c *client.Client, key client.Request) <-chan grant {
	out := make(chan grant, 1)
	go func() {
		r, err := c.Lock(ctx, key)
		out <- grant{r, time.Now(), err}
	}()
	return out
}

// awaitQueued waits until status shows one waiter on the key, held by
// holder ("": whoever holds it).
func awaitQueued(t *testing.T, holder string, status func() (api.StatusResponse, error)) {
	t.Helper()
	kit.Await(t, "the waiter to queue", func() error {
		st, err := status()
		if err != nil {
			return err
		}
		if st.QueueLength != 1 || (holder != "" && st.Holder != holder) {
			return errors.New("not queued yet")
		}
		return nil
	})
}

// stoppedFirst checks, once the waiter was granted (g), that the holder
// whose Lost is watched by lost had already taken its hold as lost, at least
// half its margin before (docs/DESIGN.md, "The holder stops first": dlock
// run's SIGKILL comes half the margin after Lost), and returns when Lost
// closed. fault names what happened at since.
func stoppedFirst(t *testing.T, fault string, since time.Time, g grant, lost <-chan time.Time, margin time.Duration) time.Time {
	t.Helper()
	var lostT time.Time
	select {
	case lostT = <-lost:
	default:
		t.Fatalf("the waiter was granted %v after the %s, and the holder's Lost is still open: two holders", g.at.Sub(since), fault)
	}
	gap := g.at.Sub(lostT)
	t.Logf("%s → holder lost %v; → waiter granted %v; gap %v (margin %v)", fault, lostT.Sub(since), g.at.Sub(since), gap, margin)
	if gap < margin/2 {
		t.Errorf("the holder's Lost closed only %v before the waiter was granted: less than half the margin (%v)", gap, margin/2)
	}
	return lostT
}
