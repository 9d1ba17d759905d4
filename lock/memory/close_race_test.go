package memory

import (
	"bytes"
	"context"
	"errors"
	"runtime"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/lock"
)

// TestSubscribeObserverRacesClose: an observer whose Subscribe passed its
// closed check before Close, and reaches the table of observers after
// Close went through it, must end (or be refused with ErrClosed): nothing
// else will ever end it, and its reader waits on it for ever. Subscribe,
// as WatchOps, checks closed again once its stream is in the tables; it
// checked only before, and this test waited its patience out.
//
// The order is forced by the table's RWMutex, not by time: the test holds
// it for writing while Subscribe (past its check: it took its watcher's
// place) waits to add, and Close waits to read it; an RWMutex lets the
// readers waiting at Unlock in before the writer.
func TestSubscribeObserverRacesClose(t *testing.T) {
	m := newMemory(t, nil)
	k := lock.Key{Type: lock.Pull, Resource: "r"}

	m.obs.mu.Lock()
	held := true
	defer func() {
		if held {
			m.obs.mu.Unlock()
		}
	}()
	type opened struct {
		st  lock.Stream
		err error
	}
	subc := make(chan opened, 1)
	go func() {
		st, _, err := m.Subscribe(context.Background(), lock.SubscribeRequest{Observe: &k})
		subc <- opened{st, err}
	}()
	kit.WaitFor(t, "Subscribe past its closed check (its watcher's place taken)", func() bool {
		return m.watchers.Load() == 1
	})
	closec := make(chan error, 1)
	go func() { closec <- m.Close() }()
	kit.WaitFor(t, "Close waiting to read the table of observers", func() bool {
		return goroutineBlockedIn("memory.(*Backend).Close", "sync.(*RWMutex).RLock")
	})
	m.obs.mu.Unlock()
	held = false

	if err := <-closec; err != nil {
		t.Fatalf("Close: %v", err)
	}
	var o opened
	select {
	case o = <-subc:
	case <-time.After(kit.Patience):
		t.Fatalf("Subscribe did not return within %v", kit.Patience)
	}
	if o.err != nil {
		if !errors.Is(o.err, lock.ErrClosed) {
			t.Fatalf("Subscribe racing Close: %v, want nil or %v", o.err, lock.ErrClosed)
		}
		return // refused: fine
	}
	defer o.st.Close()
	select {
	case <-o.st.Done():
	case <-time.After(kit.Patience):
		t.Fatalf("an observer Subscribe opened across Close is still open %v after Close returned: its reader waits for ever", kit.Patience)
	}
}

// goroutineBlockedIn reports whether a goroutine's stack has both frames.
func goroutineBlockedIn(frames ...string) bool {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	for _, g := range bytes.Split(buf, []byte("\n\n")) {
		all := true
		for _, f := range frames {
			if !bytes.Contains(g, []byte(f)) {
				all = false
				break
			}
		}
		if all {
			return true
		}
	}
	return false
}
