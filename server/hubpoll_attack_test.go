package server

import (
	"net"
	"strings"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
)

// blockedStream starts a hub stream on the server side of a loopback TCP
// pair (plain TCP: the poller takes it) and offers it more than the two
// sockets' buffers hold, with a client that does not read: it returns
// once the stream's own goroutine waits on the full socket, as it will
// until the write timeout.
func (e *env) blockedStream(t *testing.T) (client net.Conn, st *hubStream, released interface{ Load() int32 }) {
	t.Helper()
	client, server := tcpPair(t)
	_ = client.(*net.TCPConn).SetReadBuffer(4096)
	_ = server.(*net.TCPConn).SetWriteBuffer(4096)
	f := newFakeFeed()
	f.offer(strings.Repeat("x", 1<<20))
	r := e.startRaw(server, f.source(), "HEAD\n\n")
	h := e.srv.hub
	kit.WaitFor(t, "the stream in the hub", func() bool {
		h.mu.Lock()
		defer h.mu.Unlock()
		for s := range h.all {
			st = s
		}
		return st != nil
	})
	if st.fd < 0 {
		t.Fatal("the poller did not take a plain TCP stream")
	}
	kit.WaitFor(t, "a slow write in flight", func() bool {
		return e.stateOf(st) == streamBusy && st.src.(fakeSource).f.fills.Load() == 1
	})
	return client, st, r
}

// fdClosedOf reports whether st's socket is closed, under the hub's mutex.
func (e *env) fdClosedOf(st *hubStream) bool {
	e.srv.hub.mu.Lock()
	defer e.srv.hub.mu.Unlock()
	return st.fdClosed
}

// TestHubPollAttackHalfCloseDuringSlowWrite: a client that half-closes
// (shutdown write) and never reads while a write to its full socket
// waits: the poller sees it leave and ends the stream; its socket (and
// with it the connection's count, --max-conns) must go then, as a reader
// goroutine's close let it go, not when the write timeout (an hour here)
// ends the blocked write.
func TestHubPollAttackHalfCloseDuringSlowWrite(t *testing.T) {
	e := newEnvWith(t, envConfig{opts: Options{WriteTimeout: time.Hour}})
	client, st, released := e.blockedStream(t)
	if err := client.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, "the stream to end", func() bool { return released.Load() == 1 })
	kit.WaitFor(t, "the stream's socket closed", func() bool { return e.fdClosedOf(st) })
	kit.WaitFor(t, "its slow write to return", func() bool { return e.stateOf(st) != streamBusy })
}
