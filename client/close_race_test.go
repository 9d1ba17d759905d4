package client

import (
	"errors"
	"testing"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/internal/dlocktest"
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
