package server

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

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
		if st.fd >= 0 {
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

// fdStarver holds the process's descriptor limit at what was open when
// it began and 64 more, and takes every descriptor left when told to
// (fill), as a process out of them (EMFILE).
type fdStarver struct {
	lim     unix.Rlimit
	fillers []*os.File
}

// starveFDs lowers the limit; the test's end restores it.
func starveFDs(t *testing.T) *fdStarver {
	t.Helper()
	s := &fdStarver{}
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &s.lim); err != nil {
		t.Fatal(err)
	}
	low := s.lim
	low.Cur = uint64(openFDs(t) + 64)
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.restore)
	return s
}

// fill takes every descriptor left but spare.
func (s *fdStarver) fill(spare int) {
	for {
		f, err := os.Open("/dev/null")
		if err != nil {
			break
		}
		s.fillers = append(s.fillers, f)
	}
	for ; spare > 0 && len(s.fillers) > 0; spare-- {
		s.fillers[len(s.fillers)-1].Close()
		s.fillers = s.fillers[:len(s.fillers)-1]
	}
}

// restore frees the descriptors and the limit.
func (s *fdStarver) restore() {
	for _, f := range s.fillers {
		f.Close()
	}
	s.fillers = nil
	_ = unix.Setrlimit(unix.RLIMIT_NOFILE, &s.lim)
}

// openFDs is the number of this process's open descriptors.
func openFDs(t testing.TB) int {
	t.Helper()
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(fds)
}

// settledFDs opens and closes one stream (the hub's goroutines and epoll
// set start with the first), waits until no stream and no connection is
// counted, and returns how many descriptors are open then: the number every
// stream opened after it must give back.
func (e *env) settledFDs() int {
	e.t.Helper()
	warm, _ := e.openPlain("warm")
	warm.Close()
	e.waitStreams(0)
	kit.WaitFor(e.t, "no connection counted", func() bool { return e.srv.conns.Load() == 0 })
	return openFDs(e.t)
}

// awaitFDs waits until no stream and no connection is counted and the
// descriptors open are fds again: what settledFDs returned.
func (e *env) awaitFDs(fds int, what string) {
	e.t.Helper()
	e.waitStreams(0)
	kit.WaitFor(e.t, "no connection counted", func() bool { return e.srv.conns.Load() == 0 })
	kit.Await(e.t, what, func() error {
		if got := openFDs(e.t); got != fds {
			return fmt.Errorf("%d descriptors open, %d before", got, fds)
		}
		return nil
	})
}

// TestHubPollIdleStreamsHoldNoGoroutine: plain-TCP streams are in the
// hub's poll set, with no goroutine of their own, each still counted as
// an open connection (--max-conns), and each one still ends when its peer
// leaves, whichever way: a close, a reset, a half-close. Its socket closes
// then, and its count goes.
func TestHubPollIdleStreamsHoldNoGoroutine(t *testing.T) {
	for _, loop := range loops {
		t.Run(loop.name, func(t *testing.T) {
			testIdleStreamsPolled(t, newEnvWith(t, envConfig{goroutines: loop.goroutines}))
		})
	}
}

func testIdleStreamsPolled(t *testing.T, e *env) {
	const n = 12
	fds := e.settledFDs()
	conns := make([]net.Conn, n)
	for i := range conns {
		conns[i], _ = e.openPlain(fmt.Sprintf("n%d", i))
	}
	e.waitStreams(n)
	if all, p := e.polled(); p != all {
		t.Fatalf("%d of %d plain-TCP streams polled", p, all)
	}
	// Another test's readers may be on their way out.
	kit.WaitFor(t, "no goroutine reading idle plain-TCP streams", func() bool { return readers() == 0 })
	if c := e.srv.conns.Load(); c != n {
		t.Fatalf("%d connections counted open with %d streams", c, n)
	}
	// Each stream, and each of this test's clients, has one descriptor.
	if got := openFDs(t) - fds; got != 2*n {
		t.Fatalf("%d descriptors more with %d streams open, want %d", got, n, 2*n)
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
			c.Close()
		}
		node := fmt.Sprintf("n%d", i)
		kit.WaitFor(t, node+"'s stream to end", func() bool { return e.sessionStreams(node) == 0 })
	}
	e.awaitFDs(fds, "the streams' descriptors closed")
}

// TestHubPollPeerLeavesDuringSlowWrite: a peer that leaves while a write
// to its full socket waits ends its stream; the socket closes once that
// write has failed, not under it, and its count goes.
func TestHubPollPeerLeavesDuringSlowWrite(t *testing.T) {
	e := newEnvWith(t, envConfig{mod: stallConfig, opts: Options{WriteTimeout: time.Hour}})
	fds := e.settledFDs()
	c := e.stallSmall("a")
	st := e.hubStreamOf(c.LocalAddr().String())
	kit.WaitFor(t, "a's slow write in flight", func() bool { return e.stateOf(st) == streamBusy })
	_ = c.(*net.TCPConn).SetLinger(0)
	c.Close()
	kit.WaitFor(t, "a's stream to end", func() bool { return e.sessionStreams("a") == 0 })
	e.awaitFDs(fds, "a's descriptor closed")
	e.srv.hub.mu.Lock()
	closed := st.fdClosed
	e.srv.hub.mu.Unlock()
	if !closed {
		t.Fatal("the stream's socket was left open")
	}
}

// TestHubPollBytesFromPeerDropped: what a client sends after its request
// is read and dropped, as a reader goroutine drops it, up to
// maxStreamInput (TestHubAttackFloodingClientEnded: past it): the stream
// goes on, and ends when the client leaves.
func TestHubPollBytesFromPeerDropped(t *testing.T) {
	e := newEnv(t, nil)
	c, l := e.openPlain("a")
	junk := bytes.Repeat([]byte("x"), int(maxStreamInput)/2) // many reads of the poller's buffer
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

// failableEpollWait makes the hub's poller's epoll_wait fail with EBADF
// once the flag it returns is set, until the test's cleanup, which runs
// after the servers' cleanups that the test registers later.
func failableEpollWait(t *testing.T) *atomic.Bool {
	var fail atomic.Bool
	epollWait = func(epfd int, events []unix.EpollEvent, msec int) (int, error) {
		if fail.Load() {
			return 0, unix.EBADF
		}
		return unix.EpollWait(epfd, events, msec)
	}
	t.Cleanup(func() { epollWait = unix.EpollWait })
	return &fail
}

// TestHubPollFailureEndsItsStreams: when the poll set cannot be waited on
// (epoll_wait fails), every stream in it ends (its client opens a new one
// and replays what it missed), and the streams opened after get a reader
// goroutine each: their peers leaving still ends them, and Drain still
// waits for all of it (goleak checks the goroutines at the end of the
// package).
func TestHubPollFailureEndsItsStreams(t *testing.T) {
	fail := failableEpollWait(t)
	e := newEnv(t, nil)
	a, _ := e.openPlain("a")
	b, _ := e.openPlain("b")
	e.waitStreams(2)
	fail.Store(true)
	h := e.srv.hub
	h.mu.Lock()
	h.poll.wake()
	h.mu.Unlock()
	waitClosed(t, a, "a's stream, when the poll set failed")
	waitClosed(t, b, "b's stream, when the poll set failed")
	e.waitStreams(0)
	h.mu.Lock()
	gone := h.poll == nil
	h.mu.Unlock()
	if !gone {
		t.Fatal("the hub kept the poll set that failed")
	}
	c, lc := e.openPlain("c")
	e.openPlain("d")
	e.waitStreams(2)
	if _, p := e.polled(); p != 0 {
		t.Fatal("a stream opened after the failure was polled")
	}
	kit.WaitFor(t, "a reader for each stream", func() bool { return readers() == 2 })
	e.grant("c", "after-failure")
	lc.waitData(t, "after-failure")
	c.Close()
	kit.WaitFor(t, "c's stream to end", func() bool { return e.sessionStreams("c") == 0 })
	e.waitStreams(1)
}

// TestHubPollOnlyForTCP: streams on connections that are not plain TCP
// (in memory here, as the client's tests run servers inside
// testing/synctest) start no poller, whose goroutine waits in a system
// call that synctest cannot wait for, and get a reader each.
func TestHubPollOnlyForTCP(t *testing.T) {
	e := newEnv(t, nil)
	client, server := net.Pipe()
	t.Cleanup(func() { client.Close() })
	f := newFakeFeed()
	released := e.startRaw(server, f.source(), "HEAD\n\n")
	head := make([]byte, 6)
	if _, err := io.ReadFull(client, head); err != nil {
		t.Fatal(err)
	}
	h := e.srv.hub
	h.mu.Lock()
	tried := h.pollTried
	h.mu.Unlock()
	if tried {
		t.Fatal("a stream in memory started the poller")
	}
	kit.WaitFor(t, "one reader, for the stream in memory", func() bool { return readers() == 1 })
	client.Close()
	kit.WaitFor(t, "the stream released", func() bool { return released.Load() == 1 })
}
