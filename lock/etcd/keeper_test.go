package etcd_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/etcd"
)

// TestKeeperSessionsOpeningTogether: many nodes open their session streams
// on one server at once, as a fleet does when it moves from a server that
// died, and take a session-leased lock each: each session, made on the
// other server's home lease and moved onto this one's, gets a lease of its
// own here (docs/DESIGN.md, "Home leases"), which this server keeps alive.
// Every lease must stay kept alive meanwhile, so no stream ends and no
// session is lost. The server's one keepalive stream must be read while
// the sessions open: a server that stopped reading its answers (each open
// kept its first keepalive under the sessions' lock, which every answer
// waited for) left etcd unable to send them, heard no answer for two
// thirds of the TTL, and ended every stream as if cut off from etcd
// (docs/BENCHMARKS.md, "Fleet scale on etcd").
func TestKeeperSessionsOpeningTogether(t *testing.T) {
	const n, workers = 3000, 64
	// The sessions' first server, whose home lease outlives the test
	// (a grace of a minute), makes them and sees their streams close:
	// they wait in their grace, on its home lease, for the nodes to come
	// to b, which moves each onto its home lease and, at its lock, gives
	// it its own lease, with b's grace, and alone keeps them alive.
	home, p := open(t, func(c *etcd.Config) {
		c.SessionGrace = time.Minute
		c.MaxSessions = 2 * n
	})
	b := openAt(t, p, func(c *etcd.Config) {
		c.SessionGrace = 2 * time.Second // TTL 2 s: silence ends streams after 1.33 s
		c.MaxSessions = 2 * n
	})
	// A node tries again when the server answers that etcd is busy
	// (503), as a client does.
	subscribe := func(b *etcd.Backend, i int) (s lock.Stream, err error) {
		for try := 0; try < 10; try++ {
			s, _, err = b.Subscribe(context.Background(), lock.SubscribeRequest{Node: fmt.Sprintf("node-%d", i)})
			if !errors.Is(err, lock.ErrUnavailable) {
				break
			}
		}
		return s, err
	}
	hold := func(b *etcd.Backend, i int) (err error) {
		for try := 0; try < 10; try++ {
			var r lock.LockResult
			r, err = b.TryLock(context.Background(), lock.LockRequest{Type: lock.Pull, Resource: fmt.Sprintf("layer-%d", i), Node: fmt.Sprintf("node-%d", i), Lease: lock.LeaseSession})
			if err == nil && !r.Acquired {
				err = fmt.Errorf("not acquired: %+v", r)
			}
			if !errors.Is(err, lock.ErrUnavailable) {
				break
			}
		}
		return err
	}
	eachNode(t, n, workers, func(i int) error {
		s, err := subscribe(home, i)
		if err != nil {
			return fmt.Errorf("stream %d on its first server: %w", i, err)
		}
		s.Close()
		return nil
	})
	streams := make([]lock.Stream, n)
	defer func() {
		for _, s := range streams {
			if s != nil {
				s.Close()
			}
		}
	}()
	eachNode(t, n, workers, func(i int) error {
		s, err := subscribe(b, i)
		if err != nil {
			return fmt.Errorf("stream %d: %w", i, err)
		}
		streams[i] = s
		if err := hold(b, i); err != nil {
			return fmt.Errorf("lock %d: %w", i, err)
		}
		return nil
	})
	// Every lease kept alive twice more after the last open (a period
	// and more), unless a stream ends first.
	want := etcd.KeepalivesAnsweredForTest(b) + 2*n
	ended := func() int {
		c := 0
		for _, s := range streams {
			select {
			case <-s.Done():
				c++
			default:
			}
		}
		return c
	}
	deadline := time.Now().Add(2 * time.Minute)
	for etcd.KeepalivesAnsweredForTest(b) < want && ended() == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("after 2 minutes, %d of %d more keepalives answered", etcd.KeepalivesAnsweredForTest(b)-(want-2*n), 2*n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if c := ended(); c > 0 {
		t.Fatalf("%d of %d streams ended while the sessions opened: the server stopped keeping their sessions alive (%+v)", c, n, b.Stats())
	}
	if st := b.Stats(); st.SessionsLost != 0 || st.Sessions != n {
		t.Fatalf("sessions %d (want %d), lost %d (want 0)", st.Sessions, n, st.SessionsLost)
	}
}

// eachNode runs fn for 0 to n-1 on workers goroutines, and fails t with
// the errors they returned (each worker stops at its first).
func eachNode(t *testing.T, n, workers int, fn func(i int) error) {
	t.Helper()
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for range workers {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				if err := fn(i); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}
