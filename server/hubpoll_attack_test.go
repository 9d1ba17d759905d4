package server

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/lock"
	"golang.org/x/sys/unix"
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

// churnStream opens node's session stream on a new plain TCP connection,
// waits for its subscribed event, and reads everything after into got
// until the connection ends. It reports instead of failing: it runs in
// the test's workers.
func (e *env) churnStream(node string) (c *net.TCPConn, got func() []byte, err error) {
	nc, err := net.Dial("tcp", e.addr())
	if err != nil {
		return nil, nil, err
	}
	c = nc.(*net.TCPConn)
	_ = c.SetDeadline(time.Now().Add(kit.Patience))
	if _, err := fmt.Fprintf(c, "GET /subscribe?node_id=%s HTTP/1.1\r\nHost: x\r\n\r\n", node); err != nil {
		c.Close()
		return nil, nil, err
	}
	var buf []byte
	b := make([]byte, 4096)
	for !bytes.Contains(buf, []byte(`"subscribed"`)) {
		n, err := c.Read(b)
		buf = append(buf, b[:n]...)
		if err != nil {
			c.Close()
			return nil, nil, fmt.Errorf("%s before its subscribed event: %w (%q)", node, err, buf)
		}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			n, err := c.Read(b)
			buf = append(buf, b[:n]...)
			if err != nil {
				return
			}
		}
	}()
	return c, func() []byte { <-done; return buf }, nil
}

// TestHubPollAttackChurnNoCrossedWrites: streams open and end in every way
// (close, reset, half-close, server-side end) while events are written to
// them and other sockets and files open and close around them, so that a
// descriptor number a stream had is soon another's, and stale poll
// reports name it. No byte meant for one stream may reach another (a
// write after close landing on a reused descriptor, or a report read for
// the wrong stream), and at the end every stream has ended, every
// descriptor is closed and no connection is counted.
func TestHubPollAttackChurnNoCrossedWrites(t *testing.T) {
	for _, loop := range loops {
		t.Run(loop.name, func(t *testing.T) {
			testChurnNoCrossedWrites(t, newEnvWith(t, envConfig{goroutines: loop.goroutines}))
		})
	}
}

func testChurnNoCrossedWrites(t *testing.T, e *env) {
	fds := e.settledFDs()
	const workers, rounds, events = 6, 25, 6
	stop := make(chan struct{})
	var churn sync.WaitGroup
	churn.Go(func() {
		// Descriptors opened and closed between the streams' ends and
		// starts: in this process (a file, a connection to the server
		// that idles and closes) and so in the server's, the same one.
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			f, err := os.Open("/dev/null")
			if err == nil {
				f.Close()
			}
			if c, err := net.Dial("tcp", e.addr()); err == nil {
				if i%2 == 0 {
					_, _ = c.Write([]byte("GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"))
				}
				c.Close()
			}
		}
	})
	errs := make(chan error, workers*rounds*events)
	var seen atomic.Int64
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			ctx := context.Background()
			for r := range rounds {
				node := fmt.Sprintf("w%d-r%d", w, r)
				c, got, err := e.churnStream(node)
				if err != nil {
					errs <- err
					return
				}
				var granting sync.WaitGroup
				granting.Go(func() {
					for k := range events {
						res := fmt.Sprintf("res-%s-%d", node, k)
						if _, err := e.m.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: res, Node: node}); err != nil {
							errs <- err
							return
						}
						if _, err := e.m.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: res, Node: node, Success: true}); err != nil {
							errs <- err
							return
						}
					}
				})
				if r%8 >= 4 {
					granting.Wait() // its events are being written as it ends
				}
				switch r % 4 {
				case 0:
					c.Close()
				case 1:
					_ = c.SetLinger(0)
					c.Close()
				case 2:
					_ = c.CloseWrite()
				case 3:
					// The server ends it, as a revoked credential or a
					// draining server does, while events are written.
					if st := e.hubStreamOf(c.LocalAddr().String()); st != nil {
						st.shut()
					} else {
						errs <- fmt.Errorf("%s's stream not in the hub", node)
					}
				}
				granting.Wait()
				buf := got()
				c.Close()
				for _, m := range regexp.MustCompile(`res-[a-z0-9-]+?-\d+"`).FindAll(buf, -1) {
					seen.Add(1)
					if !bytes.HasPrefix(m, []byte("res-"+node+"-")) {
						errs <- fmt.Errorf("%s's stream got %s, another stream's", node, m)
					}
				}
				for _, m := range regexp.MustCompile(`"node_id":"[^"]*"`).FindAll(buf, -1) {
					if string(m) != `"node_id":"`+node+`"` {
						errs <- fmt.Errorf("%s's stream got %s", node, m)
					}
				}
			}
		})
	}
	wg.Wait()
	close(stop)
	churn.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if seen.Load() == 0 {
		t.Error("no stream got any of its events: the test tests nothing")
	}
	t.Logf("%d events read", seen.Load())
	e.awaitFDs(fds, "every descriptor closed")
}

// TestHubPollAttackShutdownManyStreams: Shutdown with a thousand idle
// plain-TCP streams, a few writes blocked on clients that do not read and
// events being written to the rest: it returns within its deadline, every
// client sees its connection end, the poller stops and closes its set,
// no connection is counted, and every descriptor the server had is
// closed (goleak checks the goroutines at the end of the package).
func TestHubPollAttackShutdownManyStreams(t *testing.T) {
	e := newEnvWith(t, envConfig{mod: stallConfig, opts: Options{WriteTimeout: time.Hour}})
	fds := e.settledFDs()
	before := fdTable(t)
	const n, stalled = 1000, 3
	clients := make([]net.Conn, 0, n+stalled)
	for i := range stalled {
		c := e.stallSmall(fmt.Sprintf("stalled-%d", i))
		clients = append(clients, c)
	}
	var ends []func() []byte
	for i := range n {
		c, got, err := e.churnStream(fmt.Sprintf("n%d", i))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		clients = append(clients, c)
		ends = append(ends, got)
	}
	e.waitStreams(n + stalled)
	if _, p := e.polled(); p != n+stalled {
		t.Fatalf("%d of %d plain-TCP streams polled", p, n+stalled)
	}
	// A stream's socket and its client's, and a duplicate for each write
	// that waits.
	if got := openFDs(t) - fds; got < 2*len(clients) || got > 2*len(clients)+stalled {
		t.Fatalf("%d descriptors more with %d streams open, want %d and one a waiting write", got, len(clients), 2*len(clients))
	}
	stop := make(chan struct{})
	var granting sync.WaitGroup
	granting.Go(func() {
		ctx := context.Background()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			node := fmt.Sprintf("n%d", i%n)
			res := fmt.Sprintf("shut-%d", i)
			if _, err := e.m.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: res, Node: node}); err != nil {
				return
			}
			_, _ = e.m.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: res, Node: node, Success: true})
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), kit.Patience)
	defer cancel()
	if err := e.srv.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	close(stop)
	granting.Wait()
	for _, got := range ends {
		got() // each client sees its connection end
	}
	e.waitStreams(0)
	h := e.srv.hub
	h.mu.Lock()
	stopped := h.poll != nil && h.poll.closed
	h.mu.Unlock()
	if !stopped {
		t.Fatal("the poller's set is still open after Shutdown")
	}
	kit.WaitFor(t, "no connection counted", func() bool { return e.srv.conns.Load() == 0 })
	mine := make(map[int]bool)
	for _, c := range clients {
		e.onConn(c, func(fd int) { mine[fd] = true })
	}
	kit.Await(t, "the server's descriptors closed", func() error {
		var left []string
		for fd, what := range fdTable(t) {
			if !mine[fd] && before[fd] != what {
				left = append(left, fmt.Sprintf("%d: %s", fd, what))
			}
		}
		if len(left) > 0 {
			return fmt.Errorf("%d descriptors open that were not before and are not this test's clients': %v", len(left), left[:min(len(left), 10)])
		}
		return nil
	})
}

// fdTable is this process's open descriptors, each with what it is
// (a socket's inode, a file's path).
func fdTable(t *testing.T) map[int]string {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	m := make(map[int]string, len(ents))
	for _, ent := range ents {
		fd, err := strconv.Atoi(ent.Name())
		if err != nil {
			continue
		}
		if what, err := os.Readlink("/proc/self/fd/" + ent.Name()); err == nil {
			m[fd] = what
		}
	}
	return m
}

// onConn calls f with the descriptor of c, a TCP connection.
func (e *env) onConn(c net.Conn, f func(fd int)) {
	e.t.Helper()
	rc, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		e.t.Fatal(err)
	}
	if err := rc.Control(func(fd uintptr) { f(int(fd)) }); err != nil {
		e.t.Fatal(err)
	}
}

// TestHubPollAttackWriteTimeoutFreesSocket: a client that never reads:
// the write timeout ends the blocked write, the stream ends, and its
// socket and the duplicate the write had are both closed.
func TestHubPollAttackWriteTimeoutFreesSocket(t *testing.T) {
	e := newEnvWith(t, envConfig{opts: Options{WriteTimeout: 200 * time.Millisecond}})
	fds := e.settledFDs()
	client, st, released := e.blockedStream(t)
	kit.WaitFor(t, "the stream to end at the write timeout", func() bool { return released.Load() == 1 })
	kit.WaitFor(t, "the stream's socket closed", func() bool { return e.fdClosedOf(st) })
	client.Close()
	kit.WaitFor(t, "the socket and its write's duplicate closed", func() bool { return openFDs(t) == fds })
}

// TestHubPollAttackMaxConnsExact: --max-conns counts polled streams
// exactly through every way they end (close, reset, half-close,
// half-close under a blocked write, the server's end): after each round
// the limit admits as many streams again, and refuses one more.
func TestHubPollAttackMaxConnsExact(t *testing.T) {
	const limit = 5
	e := newEnvWith(t, envConfig{mod: stallConfig, opts: Options{MaxConns: limit, WriteTimeout: time.Hour}})
	for round := range 3 {
		kit.WaitFor(t, "no connection counted", func() bool { return e.srv.conns.Load() == 0 })
		var cs []net.Conn
		for i := range limit - 1 {
			c, _ := e.openPlain(fmt.Sprintf("r%d-n%d", round, i))
			cs = append(cs, c)
		}
		stalled := e.stallSmall(fmt.Sprintf("r%d-stalled", round))
		st := e.hubStreamOf(stalled.LocalAddr().String())
		kit.WaitFor(t, "the stalled stream's write in flight", func() bool { return e.stateOf(st) == streamBusy })
		if got := e.srv.conns.Load(); got != limit {
			t.Fatalf("round %d: %d connections counted with %d streams open", round, got, limit)
		}
		over := e.dial()
		resp, err := http.ReadResponse(bufio.NewReader(over), nil)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable {
			t.Fatalf("round %d: a connection over the limit got %d", round, resp.StatusCode)
		}
		over.Close()
		cs[0].Close()
		_ = cs[1].(*net.TCPConn).SetLinger(0)
		cs[1].Close()
		_ = cs[2].(*net.TCPConn).CloseWrite()
		waitClosed(t, cs[2], "a half-closed stream")
		if s := e.hubStreamOf(cs[3].LocalAddr().String()); s != nil {
			s.shut()
		}
		waitClosed(t, cs[3], "a stream the server ended")
		_ = stalled.(*net.TCPConn).CloseWrite()
		e.waitStreams(0)
	}
	kit.WaitFor(t, "no connection counted", func() bool { return e.srv.conns.Load() == 0 })
}

// TestHubPollAttackFloodingClientShut: a client that sends bytes without
// end after its request, and a server that ends its stream (a revoked
// credential, a drain): the poller reads and drops what comes, but the
// stream must still end; a shut socket that kept reporting data would
// never read as closed.
func TestHubPollAttackFloodingClientShut(t *testing.T) {
	// The flood must outlast the shut, not end the stream itself.
	// Restored after the server's cleanup, which runs before this one.
	n := maxStreamInput
	t.Cleanup(func() { maxStreamInput = n })
	maxStreamInput = math.MaxInt32 - 1<<20
	e := newEnv(t, nil)
	client, server := tcpPair(t)
	f := newFakeFeed()
	released := e.startRaw(server, f.source(), "HEAD\n\n")
	var st *hubStream
	kit.WaitFor(t, "the stream in the hub", func() bool {
		e.srv.hub.mu.Lock()
		defer e.srv.hub.mu.Unlock()
		for s := range e.srv.hub.all {
			st = s
		}
		return st != nil
	})
	var flooding sync.WaitGroup
	flooding.Go(func() {
		junk := bytes.Repeat([]byte("j"), 64<<10)
		for {
			if _, err := client.Write(junk); err != nil {
				return
			}
		}
	})
	// Some of the flood has arrived: the poller is reading it.
	kit.WaitFor(t, "the flood to flow", func() bool {
		var n int
		e.onSocket(st, func(fd int) { n, _ = unix.IoctlGetInt(fd, unix.SIOCINQ) })
		return n > 0
	})
	st.shut()
	kit.WaitFor(t, "the flooded stream to end", func() bool { return released.Load() == 1 })
	kit.WaitFor(t, "its socket closed", func() bool { return e.fdClosedOf(st) })
	client.Close()
	flooding.Wait()
}

// TestHubPollAttackNoDescriptorForSlowWrite: out of descriptors (EMFILE)
// when a write has to wait: the write gets no duplicate to wait on, and
// the stream ends as on a failed write, its socket closed, rather than
// wait without a deadline or leave the write half done and the stream
// open.
func TestHubPollAttackNoDescriptorForSlowWrite(t *testing.T) {
	e := newEnvWith(t, envConfig{opts: Options{WriteTimeout: time.Hour}})
	client, server := tcpPair(t)
	_ = client.(*net.TCPConn).SetReadBuffer(4096)
	_ = server.(*net.TCPConn).SetWriteBuffer(4096)
	// The stream's own descriptor (the poller's duplicate) and a few
	// for the runtime; none for the write's duplicate once the fillers
	// below took the rest.
	starved := starveFDs(t)
	f := newFakeFeed()
	f.offer(strings.Repeat("x", 1<<20))
	gate := f.hold() // the writer waits in fill, after the poller took the socket
	released := e.startRaw(server, f.source(), "HEAD\n\n")
	<-gate.in
	starved.fill(0)
	close(gate.out)
	kit.WaitFor(t, "the stream to end", func() bool { return released.Load() == 1 })
	starved.restore()
	waitClosed(t, client, "a stream whose write found no descriptor")
}

// TestHubAttackFloodingClientEnded: a client that sends bytes without end
// after its request (the protocol has it send nothing) has its stream
// ended once it passed maxStreamInput, on the poller's path (plain TCP)
// and on a reader goroutine's (here an in-memory connection, as TLS), so
// that no reader drops bytes for it forever; a client that sends a little
// keeps its stream.
func TestHubAttackFloodingClientEnded(t *testing.T) {
	for _, c := range []struct {
		name string
		pair func(t *testing.T) (client, server net.Conn)
	}{
		{"polled", tcpPair},
		{"reader", func(*testing.T) (net.Conn, net.Conn) { return net.Pipe() }},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t, nil)
			client, server := c.pair(t)
			defer client.Close()
			f := newFakeFeed()
			released := e.startRaw(server, f.source(), "HEAD\n\n")
			head := make([]byte, len("HEAD\n\n"))
			if _, err := io.ReadFull(client, head); err != nil {
				t.Fatal(err)
			}
			// A little is read and dropped; the stream stays.
			if _, err := client.Write(bytes.Repeat([]byte("x"), 1024)); err != nil {
				t.Fatal(err)
			}
			f.offer("after-a-little")
			buf := make([]byte, len("data: after-a-little\n\n"))
			if _, err := io.ReadFull(client, buf); err != nil || string(buf) != "data: after-a-little\n\n" {
				t.Fatalf("the stream after 1 KiB from its client: %q %v", buf, err)
			}
			if released.Load() != 0 {
				t.Fatal("a stream ended for 1 KiB from its client")
			}
			// 16 times the bound, then no more: a stream that is not ended
			// for it stays open, and the wait below fails.
			var flooding sync.WaitGroup
			flooding.Go(func() {
				junk := bytes.Repeat([]byte("j"), 16<<10)
				for range 16 * int(maxStreamInput) / len(junk) {
					if _, err := client.Write(junk); err != nil {
						return
					}
				}
			})
			kit.WaitFor(t, "the flooded stream to end", func() bool { return released.Load() == 1 })
			client.Close()
			flooding.Wait()
		})
	}
}
