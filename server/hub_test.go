package server

import (
	"context"
	"fmt"
	"net"
	"runtime"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/rawhttp"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/memory"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// stallStream opens node's session stream on a connection that never reads,
// with a small receive buffer, and gives node grants until the server's
// write to it finds the socket full. The env's stream buffer must hold the
// events that pile up meanwhile (stallConfig).
func (e *env) stallStream(node string) net.Conn {
	e.t.Helper()
	c := e.dial()
	_ = c.(*net.TCPConn).SetReadBuffer(4096)
	if _, err := fmt.Fprintf(c, "GET /subscribe?node_id=%s HTTP/1.1\r\nHost: x\r\n\r\n", node); err != nil {
		e.t.Fatal(err)
	}
	kit.WaitFor(e.t, node+"'s session", func() bool { return e.sessionStreams(node) == 1 })
	full := testutil.ToFloat64(e.srv.metrics.fullSockets)
	ctx := context.Background()
	for i := 0; testutil.ToFloat64(e.srv.metrics.fullSockets) == full; i++ {
		if i == 1_000_000 {
			e.t.Fatalf("%d events written to a stream that is not read, and the socket never filled", i)
		}
		// A grant is a lock_assigned event of about 130 bytes on node's
		// stream.
		k := lock.Key{Type: lock.Pull, Resource: fmt.Sprintf("stall-%s-%d", node, i)}
		if _, err := e.m.TryLock(ctx, lock.LockRequest{Type: k.Type, Resource: k.Resource, Node: node}); err != nil {
			e.t.Fatal(err)
		}
		if _, err := e.m.Unlock(ctx, lock.UnlockRequest{Type: k.Type, Resource: k.Resource, Node: node, Success: true}); err != nil {
			e.t.Fatal(err)
		}
	}
	return c
}

// stallConfig leaves room in a stream's buffer for every event stallStream
// writes.
func stallConfig(c *memory.Config) { c.StreamBuffer = 1 << 20 }

// sessionStreams is the number of node's open session streams.
func (e *env) sessionStreams(node string) int {
	page, err := e.m.InspectSessions(context.Background(), lock.SessionQuery{Node: node})
	if err != nil {
		e.t.Fatal(err)
	}
	for _, v := range page.Sessions {
		if v.Node == node {
			return v.Streams
		}
	}
	return 0
}

// TestStalledStreamsDoNotDelayOthers: streams whose peers stop reading,
// more of them than there are writers, each with a write blocked on a full
// socket for as long as the write timeout allows (an hour here), do not
// delay another stream's events.
func TestStalledStreamsDoNotDelayOthers(t *testing.T) {
	e := newEnvWith(t, envConfig{mod: stallConfig, opts: Options{WriteTimeout: time.Hour}})
	for i := range runtime.GOMAXPROCS(0) + 1 {
		e.stallStream(fmt.Sprintf("stalled-%d", i))
	}
	s := e.subscribe("node_id=b", "")
	s.Next(t) // subscribed
	got := make(chan error, 1)
	go func() {
		var ev rawhttp.Event
		err := rawhttp.ReadEvent(s.R, &ev)
		if err == nil && ev.Name != "lock_assigned" {
			err = fmt.Errorf("got %q, want lock_assigned", ev.Name)
		}
		got <- err
	}()
	if code, _ := e.call("POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"b"}`); code != 200 {
		t.Fatalf("lock: %d", code)
	}
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(kit.Patience):
		t.Fatalf("b's event did not arrive within %v while other streams were stalled", kit.Patience)
	}
}

// TestStalledStreamEndsAfterWriteTimeout: a stream whose peer stops reading
// is closed once a write has waited for the write timeout, and its session
// then loses its stream.
func TestStalledStreamEndsAfterWriteTimeout(t *testing.T) {
	e := newEnvWith(t, envConfig{mod: stallConfig, opts: Options{WriteTimeout: 100 * time.Millisecond}})
	e.stallStream("a")
	// The data the socket holds may take long to cross a 4 KiB window:
	// the count of open connections says the server closed it.
	kit.WaitFor(t, "the stalled connection to be closed", func() bool { return e.srv.conns.Load() == 0 })
	if n := e.sessionStreams("a"); n != 0 {
		t.Fatalf("a has %d session streams after its only connection closed", n)
	}
}
