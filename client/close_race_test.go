package client

import (
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/internal/dlocktest"
	"github.com/dlock/dlock/internal/dlocktest/kit"
)

// TestCloseBegunStartsNoGoroutine: once Close has marked the Client closed
// it waits for its goroutines, so a call that began before (a Lock whose
// grant arrives, a wait that opens the session stream) must start none:
// added to the WaitGroup during its Wait, one would outlive Close, or
// make Wait panic. The state between Close's mark and its Wait is set here
// by hand, as Close leaves it.
func TestCloseBegunStartsNoGoroutine(t *testing.T) {
	srv := dlocktest.Start(t, dlocktest.Options{})
	c := newClient(t, srv, "a")
	if err := c.init(); err != nil {
		t.Fatal(err)
	}
	c.mu.Lock()
	c.closed = true
	c.mu.Unlock()
	c.cancel()

	s := c.ensureSession(t.Context())
	select {
	case <-s.tried:
	default:
		t.Fatal("a session asked for after Close began was never tried: its waiters wait for it")
	}
	if !errors.Is(s.lastErr, ErrClosed) {
		t.Errorf("its last error: %v, want %v", s.lastErr, ErrClosed)
	}
	h := c.watch(pull.key(), 7, false, time.Now(), api.Guarantee{})
	if h.ctx.Err() == nil {
		t.Error("a hold recorded after Close began is not lost")
	}
	c.mu.Lock()
	sess, monitor := c.sess, c.monitor
	c.mu.Unlock()
	if sess != nil || monitor {
		t.Fatalf("after Close began: a session stream started %v, the holds' monitor started %v", sess != nil, monitor)
	}
	c.wg.Wait() // nothing to wait for; goleak (TestMain) finds a goroutine started anyway
}

// TestCloseEndsWaits: Close ends the calls that wait, with ErrClosed: a
// Lock queued behind another node's hold, which leaves the line (else
// the node would be granted the key with nobody to release it), and a
// Lock of the same key waiting behind it for this Client's turn.
func TestCloseEndsWaits(t *testing.T) {
	srv := dlocktest.Start(t, dlocktest.Options{})
	a := newClient(t, srv, "a")
	b := newClient(t, srv, "b")
	if r, err := a.Lock(t.Context(), pull); err != nil || !r.Acquired {
		t.Fatalf("a: %+v %v", r, err)
	}
	errs := make(chan error, 2)
	go func() {
		_, err := b.Lock(t.Context(), pull)
		errs <- err
	}()
	srv.WaitQueued(t, pull.key(), 1)
	go func() {
		_, err := b.Lock(t.Context(), pull)
		errs <- err
	}()
	kit.WaitFor(t, "b's second Lock waiting for its turn in b", func() bool {
		b.mu.Lock()
		defer b.mu.Unlock()
		g := b.gates[pull.key()]
		return g != nil && g.users == 2
	})
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		select {
		case err := <-errs:
			if !errors.Is(err, ErrClosed) {
				t.Errorf("a Lock waiting at Close: %v, want %v", err, ErrClosed)
			}
		case <-time.After(kit.Patience):
			t.Fatalf("a Lock still waits %v after Close", kit.Patience)
		}
	}
	st, err := a.Status(t.Context(), pull.Type, pull.Resource)
	if err != nil {
		t.Fatal(err)
	}
	if st.QueueLength != 0 {
		t.Fatalf("b closed, still %d in line behind a: %+v", st.QueueLength, st)
	}
}

// TestCloseEndsWaitsServerSilent: the /cancel a Lock ended by Close sends
// goes to a server that never answers it; the Lock still returns
// ErrClosed, after RequestTimeout, not when the server lets go.
func TestCloseEndsWaitsServerSilent(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	cancels := make(chan struct{}, 16)
	srv := dlocktest.Start(t, dlocktest.Options{Wrap: func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/cancel" {
				cancels <- struct{}{}
				select {
				case <-release:
				case <-r.Context().Done():
				}
				return // no answer: the connection closes
			}
			next.ServeHTTP(w, r)
		})
	}})
	a := newClient(t, srv, "a")
	b := newClient(t, srv, "b")
	b.RequestTimeout = 200 * time.Millisecond
	b.MaxRetries = -1
	if r, err := a.Lock(t.Context(), pull); err != nil || !r.Acquired {
		t.Fatalf("a: %+v %v", r, err)
	}
	errc := make(chan error, 1)
	go func() {
		_, err := b.Lock(t.Context(), pull)
		errc <- err
	}()
	srv.WaitQueued(t, pull.key(), 1)
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-errc:
		if !errors.Is(err, ErrClosed) {
			t.Fatalf("a Lock waiting at Close, its /cancel unanswered: %v, want %v", err, ErrClosed)
		}
	case <-time.After(kit.Patience):
		t.Fatalf("a Lock whose /cancel the server never answers still waits %v after Close", kit.Patience)
	}
	select {
	case <-cancels:
	default:
		t.Fatal("no /cancel reached the server")
	}
}
