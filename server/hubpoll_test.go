package server

import (
	"bufio"
	"bytes"
	"fmt"
	"net"
	"net/http"
	"runtime"
	"sync/atomic"
	"testing"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"
)

// openPlain opens node's session stream on a plain TCP connection and
// reads its events from then on.
func (e *env) openPlain(node string) (net.Conn, *evLog) {
	e.t.Helper()
	c := e.dial()
	if _, err := fmt.Fprintf(c, "GET /subscribe?node_id=%s HTTP/1.1\r\nHost: x\r\n\r\n", node); err != nil {
		e.t.Fatal(err)
	}
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		e.t.Fatal(err)
	}
	l := readEvents(resp.Body)
	l.waitData(e.t.(*testing.T), `"subscribed"`)
	return c, l
}

// readers counts the goroutines blocked reading a stream (readLoop).
func readers() int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return bytes.Count(buf[:n], []byte("server.(*hubStream).readLoop("))
		}
		buf = make([]byte, 2*len(buf))
	}
}

// polled counts the hub's streams and those of them in its poll set.
func (e *env) polled() (streams, polled int) {
	h := e.srv.hub
	h.mu.Lock()
	defer h.mu.Unlock()
	for st := range h.all {
		streams++
		if st.polled {
			polled++
		}
	}
	return streams, polled
}

// waitStreams waits until the hub holds n streams and the stream gauge
// says n.
func (e *env) waitStreams(n int) {
	e.t.Helper()
	kit.WaitFor(e.t, fmt.Sprintf("%d streams in the hub", n), func() bool {
		all, _ := e.polled()
		return all == n && testutil.ToFloat64(e.srv.metrics.streams) == float64(n)
	})
}

// TestHubPollIdleStreamsHoldNoGoroutine: plain-TCP streams are in the
// hub's poll set, with no goroutine of their own, and each one still ends
// when its peer leaves, whichever way: a close, a reset, a half-close.
func TestHubPollIdleStreamsHoldNoGoroutine(t *testing.T) {
	e := newEnv(t, nil)
	const n = 12
	conns := make([]net.Conn, n)
	for i := range conns {
		conns[i], _ = e.openPlain(fmt.Sprintf("n%d", i))
	}
	e.waitStreams(n)
	if all, p := e.polled(); p != all {
		t.Fatalf("%d of %d plain-TCP streams polled", p, all)
	}
	if r := readers(); r != 0 {
		t.Fatalf("%d goroutines reading idle plain-TCP streams, want none", r)
	}
	for i, c := range conns {
		switch i % 3 {
		case 0:
			c.Close()
		case 1:
			_ = c.(*net.TCPConn).SetLinger(0) // a reset
			c.Close()
		case 2:
			if err := c.(*net.TCPConn).CloseWrite(); err != nil {
				t.Fatal(err)
			}
			waitClosed(t, c, "a half-closed stream")
		}
		node := fmt.Sprintf("n%d", i)
		kit.WaitFor(t, node+"'s stream to end", func() bool { return e.sessionStreams(node) == 0 })
	}
	e.waitStreams(0)
}

// TestHubPollBytesFromPeerDropped: what a client sends after its request
// is read and dropped, as a reader goroutine dropped it, however much:
// the stream goes on, and ends when the client leaves.
func TestHubPollBytesFromPeerDropped(t *testing.T) {
	e := newEnv(t, nil)
	c, l := e.openPlain("a")
	junk := bytes.Repeat([]byte("x"), 256<<10) // many reads of the poller's buffer
	if _, err := c.Write(junk); err != nil {
		t.Fatal(err)
	}
	e.grant("a", "after-junk")
	l.waitData(t, "after-junk")
	if _, p := e.polled(); p != 1 {
		t.Fatal("the stream left the poll set")
	}
	c.Close()
	kit.WaitFor(t, "a's stream to end", func() bool { return e.sessionStreams("a") == 0 })
	e.waitStreams(0)
}

// TestHubPollOldReportLeavesStreamOpen: a report for a stream whose peer
// sent nothing (one read before another stream with the same descriptor
// ended) costs a read that finds nothing, and the stream stays.
func TestHubPollOldReportLeavesStreamOpen(t *testing.T) {
	e := newEnv(t, nil)
	_, l := e.openPlain("a")
	h := e.srv.hub
	h.mu.Lock()
	var st *hubStream
	for s := range h.all {
		st = s
	}
	h.mu.Unlock()
	if st.peerLeft(make([]byte, 64)) {
		t.Fatal("peerLeft on a stream whose peer sent nothing reported it gone")
	}
	e.grant("a", "still-open")
	l.waitData(t, "still-open")
}

// TestHubPollFailureGivesReaders: when the poll set cannot be waited on
// (epoll_wait fails), every stream in it gets a reader goroutine, and so
// do the streams opened after: their peers leaving still ends them, and
// Drain still waits for all of it (goleak checks the goroutines at the
// end of the package).
func TestHubPollFailureGivesReaders(t *testing.T) {
	var fail atomic.Bool
	epollWait = func(epfd int, events []unix.EpollEvent, msec int) (int, error) {
		if fail.Load() {
			return 0, unix.EBADF
		}
		return unix.EpollWait(epfd, events, msec)
	}
	t.Cleanup(func() { epollWait = unix.EpollWait }) // after the server's cleanup
	e := newEnv(t, nil)
	a, _ := e.openPlain("a")
	_, lb := e.openPlain("b")
	e.waitStreams(2)
	fail.Store(true)
	h := e.srv.hub
	h.mu.Lock()
	h.poll.wake()
	h.mu.Unlock()
	kit.WaitFor(t, "the poll set abandoned", func() bool {
		h.mu.Lock()
		defer h.mu.Unlock()
		return h.poll == nil
	})
	if _, p := e.polled(); p != 0 {
		t.Fatalf("%d streams still polled", p)
	}
	kit.WaitFor(t, "a reader for each stream", func() bool { return readers() == 2 })
	e.grant("b", "after-failure")
	lb.waitData(t, "after-failure")
	a.Close()
	kit.WaitFor(t, "a's stream to end", func() bool { return e.sessionStreams("a") == 0 })
	_, _ = e.openPlain("c")
	e.waitStreams(2)
	if _, p := e.polled(); p != 0 {
		t.Fatal("a stream opened after the failure was polled")
	}
	kit.WaitFor(t, "a reader for each stream", func() bool { return readers() == 2 })
}
