package server

// Attacks on the raw accept loop (accept.go) and the event loop without
// Options.EventLoop, as a hostile client and a server closed at the worst
// moment would make them.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"
)

// flood dials addr from workers goroutines as fast as it can and hands
// each connection made to each, with the worker's number; stop ends the
// flood and waits for it.
func flood(addr string, workers int, each func(worker int, c net.Conn)) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	for i := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-done:
					return
				default:
				}
				if c, err := net.Dial("tcp", addr); err == nil {
					each(i, c)
				}
			}
		}()
	}
	return func() { close(done); wg.Wait() }
}

// reset closes c with a RST (SO_LINGER 0).
func reset(t *testing.T, c net.Conn) {
	t.Helper()
	if err := c.(*net.TCPConn).SetLinger(0); err != nil {
		t.Fatal(err)
	}
	c.Close()
}

// TestRawAcceptAttackNoDescriptorForHandOver: without Options.EventLoop
// (etcd, --event-loop=false), a connection the raw accept loop put in an
// event loop needs a second descriptor (net.FileConn's duplicate) for its
// first request, which the loop has read. With none left, that request is
// answered 503 overloaded, with Retry-After, and never run: not dropped
// unanswered. With Go's Accept the lean goroutine holds the connection's
// only descriptor and answers it.
func TestRawAcceptAttackNoDescriptorForHandOver(t *testing.T) {
	for _, goAccept := range []bool{true, false} {
		t.Run(fmt.Sprint("goAccept=", goAccept), func(t *testing.T) {
			e := newEnvWith(t, envConfig{goroutines: true, goAccept: goAccept})
			c := e.dial()
			if goAccept {
				kit.WaitFor(t, "the connection in a lean goroutine", func() bool { _, g := e.pollerConns(); return g == 1 })
			} else {
				e.waitRawListening()
				e.polledFD()
			}
			starved := starveFDs(t)
			starved.fill(0)
			_, werr := io.WriteString(c, rawPost("/lock", smuggleLock))
			r, err := http.ReadResponse(bufio.NewReader(c), nil)
			starved.restore()
			if werr != nil || err != nil {
				t.Fatalf("a /lock on a connection accepted before the descriptors ran out: %v %v (no answer)", werr, err)
			}
			body := bodyOf(r)
			want, held := 200, 1
			if !goAccept {
				want, held = 503, 0
				if !strings.Contains(body, `"code":"overloaded"`) || r.Header.Get("Retry-After") == "" || !r.Close {
					t.Fatalf("refused: %v %s, want overloaded with Retry-After and Connection: close", r.Header, body)
				}
			}
			if r.StatusCode != want || e.m.Stats().Held != held {
				t.Fatalf("status %d, %d held; want %d, %d", r.StatusCode, e.m.Stats().Held, want, held)
			}
		})
	}
}

// TestRawAcceptAttackResetThenPanic: a connection handed from an event
// loop to the lean loop (every connection's first request on etcd) goes
// through net.FileConn, whose RemoteAddr is nil when the peer has reset
// the connection by then (getpeername fails). A panic in that request's
// handling is recovered, and logged with the address accepted: logging it
// with net.FileConn's nil address panicked again, in the recover, which
// killed the process. Run in a child process, since it would crash.
func TestRawAcceptAttackResetThenPanic(t *testing.T) {
	if os.Getenv("DLOCK_RESET_PANIC_CHILD") == "1" {
		resetThenPanicChild(t)
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestRawAcceptAttackResetThenPanic$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), "DLOCK_RESET_PANIC_CHILD=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		s := string(out)
		if i := strings.Index(s, "panic:"); i >= 0 {
			s = s[i:min(len(s), i+1500)]
		}
		t.Fatalf("the child crashed (%v):\n%s", err, s)
	}
}

func resetThenPanicChild(t *testing.T) {
	e := newEnvWith(t, envConfig{goroutines: true, prep: panicOnBoom})
	e.waitRawListening()
	// No seam: on loopback the client's RST nearly always reaches the
	// socket before the event loop hands it over (about 295 times in
	// 300 here); one crash is enough.
	const n = 20
	for range n {
		c := e.dial()
		fmt.Fprint(c, rawPost("/cancel", `{"type":"pull","resource_id":"boom","node_id":"a"}`))
		reset(t, c)
	}
	kit.WaitFor(t, "every panic recovered", func() bool { return testutil.ToFloat64(e.srv.metrics.panics) == n })
	kit.WaitFor(t, "no connection counted", func() bool { return e.srv.conns.Load() == 0 })
}

// TestRawAcceptAttackHostileClientsCounted: connections that send nothing, reset at
// once, send half a request, or go to net/http, in both modes, leave
// Server.conns at 0 once they are gone, and a never-speaking one is swept
// by the idle timeout.
func TestRawAcceptAttackHostileClientsCounted(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) {
			e := newEnvWith(t, envConfig{goroutines: l.goroutines, idle: 300 * time.Millisecond, opts: Options{ReadTimeout: 300 * time.Millisecond}})
			e.waitRawListening()
			// Says nothing: the sweep closes it.
			silent := e.dial()
			kit.WaitFor(t, "the silent connection in the event loop", func() bool { p, _ := e.pollerConns(); return p == 1 })
			waitClosed(t, silent, "a connection that never spoke")
			kit.WaitFor(t, "no connection counted", func() bool { return e.srv.conns.Load() == 0 })
			// Resets at once, before and after the loop has it.
			for range 20 {
				reset(t, e.dial())
			}
			c := e.dial()
			kit.WaitFor(t, "one in the event loop", func() bool { p, _ := e.pollerConns(); return p >= 1 })
			reset(t, c)
			kit.WaitFor(t, "no connection counted after resets", func() bool { return e.srv.conns.Load() == 0 })
			// Half a request: the read timeout ends it.
			half := e.dial()
			io.WriteString(half, "POST /lock HTTP/1.1\r\nHost: x\r\nContent-Le")
			waitClosed(t, half, "half a request")
			// net/http's, then a half-sent second.
			nh := e.dial()
			if r := exchange(t, nh, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"); r.StatusCode != 200 {
				t.Fatalf("healthz: %d", r.StatusCode)
			}
			io.WriteString(nh, "GET /healthz HTTP/1.1\r\nHo")
			waitClosed(t, nh, "net/http's connection, half a request")
			kit.WaitFor(t, "no connection counted at the end", func() bool { return e.srv.conns.Load() == 0 })
		})
	}
}

// TestRawAcceptAttackSubscribeThenPipelined: a /subscribe followed at once by a
// /lock, in one write. The stream opens; the /lock behind it is dropped as
// the lean loop drops it (never executed), in both modes.
func TestRawAcceptAttackSubscribeThenPipelined(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) {
			e := newEnvWith(t, envConfig{goroutines: l.goroutines})
			e.waitRawListening()
			c := e.dial()
			e.polledFD()
			fmt.Fprint(c, "GET /subscribe?node_id=pipe HTTP/1.1\r\nHost: x\r\n\r\n"+rawPost("/lock", smuggleLock))
			r, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil || r.StatusCode != 200 {
				t.Fatalf("stream: %v %v", r, err)
			}
			e.waitStreams(1)
			if status, got := e.call("GET", "/status?type=pull&resource_id=smuggle", ""); status != 200 || got["state"] != "free" {
				t.Fatalf("the /lock behind a /subscribe took effect: %d %v", status, got)
			}
			c.Close()
			e.waitStreams(0)
			http.DefaultClient.CloseIdleConnections() // e.call's
			kit.WaitFor(t, "no connection counted", func() bool { return e.srv.conns.Load() == 0 })
		})
	}
}

// TestRawAcceptAttackFloodPastMaxConns: connections past MaxConns get 503 and are
// not counted; when all close the count is 0. In both modes.
func TestRawAcceptAttackFloodPastMaxConns(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) {
			e := newEnvWith(t, envConfig{goroutines: l.goroutines, opts: Options{MaxConns: 4}})
			e.waitRawListening()
			var held []net.Conn
			for range 4 {
				held = append(held, e.dial())
			}
			kit.WaitFor(t, "4 counted", func() bool { return e.srv.conns.Load() == 4 })
			for range 10 {
				c := e.dial()
				r, err := http.ReadResponse(bufio.NewReader(c), nil)
				if err != nil || r.StatusCode != 503 {
					t.Fatalf("over the limit: %v %v", r, err)
				}
				c.Close()
			}
			for _, c := range held {
				if r := exchange(t, c, rawPost("/cancel", smuggleLock)); r.StatusCode != 200 {
					t.Fatalf("a held connection: %d", r.StatusCode)
				}
				c.Close()
			}
			kit.WaitFor(t, "no connection counted", func() bool { return e.srv.conns.Load() == 0 })
		})
	}
}

// TestRawAcceptAttackIPv6: a listener of Listen on [::1] takes the raw accept loop
// and serves, in both modes.
func TestRawAcceptAttackIPv6(t *testing.T) {
	if l, err := net.Listen("tcp", "[::1]:0"); err != nil {
		t.Skipf("SKIPPED LOUDLY: no IPv6 loopback here: %v", err)
	} else {
		l.Close()
	}
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) {
			srv, ln, served := listenAndServe(t, Options{EventLoop: !l.goroutines}, "[::1]:0", 1)
			defer func() { srv.Close(); <-served }()
			c, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(10 * time.Second))
			if r := exchange(t, c, rawPost("/lock", smuggleLock)); r.StatusCode != 200 {
				t.Fatalf("%d", r.StatusCode)
			}
		})
	}
}

// TestRawAcceptAttackCloseDuringFlood: Close while clients connect as fast as they
// can; Serve returns ErrServerClosed, the count returns to 0, and the port
// is free once Close and Serve have returned.
func TestRawAcceptAttackCloseDuringFlood(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) {
			srv, ln, served := listenAndServe(t, Options{EventLoop: !l.goroutines}, "127.0.0.1:0", 1)
			addr := ln.Addr().String()
			var accepted atomic.Int64
			stop := flood(addr, 8, func(_ int, c net.Conn) {
				accepted.Add(1)
				fmt.Fprint(c, rawPost("/cancel", smuggleLock))
				c.Close()
			})
			kit.WaitFor(t, "a flood", func() bool { return accepted.Load() > 200 })
			srv.Close()
			if err := <-served; !errors.Is(err, http.ErrServerClosed) {
				t.Errorf("Serve: %v", err)
			}
			stop()
			if l2, err := net.Listen("tcp", addr); err != nil {
				t.Errorf("port still bound after Close and Serve returned: %v", err)
			} else {
				l2.Close()
			}
			kit.WaitFor(t, "no connection counted", func() bool { return srv.conns.Load() == 0 })
			if err := srv.Serve(ln, &http.Server{Handler: srv}); !errors.Is(err, http.ErrServerClosed) {
				t.Errorf("Serve after Close: %v", err)
			}
		})
	}
}

// TestRawAcceptAttackShutdownBoundedWhenHandOverHasNoDescriptor: Shutdown
// "stops the server within ctx whatever clients do". A connection the
// event loop could not hand over (EMFILE) writes what it owes from a
// goroutine of its own (poller.handTo), in poll(2), for up to the write
// timeout; Shutdown waits for it. A client that pipelined and never reads
// held Shutdown for the whole write timeout, whatever its ctx: now
// Shutdown's forced close shuts that socket down, which wakes the poll.
func TestRawAcceptAttackShutdownBoundedWhenHandOverHasNoDescriptor(t *testing.T) {
	failed := make(chan struct{}, 1)
	fileConn = func(f *os.File) (net.Conn, error) {
		// The socket full for good, as a client that reads nothing
		// leaves it in the end (the client's kernel here still takes
		// a few KiB more, by collapsing its queue): the test fills it
		// the rest of the way, so the answers owed cannot be written.
		if rc, err := f.SyscallConn(); err == nil {
			_ = rc.Control(func(fd uintptr) {
				junk := make([]byte, 4096)
				for {
					if _, err := unix.Write(int(fd), junk); err != nil {
						if err == unix.EAGAIN {
							pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
							if n, _ := unix.Poll(pfd, 200); n > 0 {
								continue
							}
						}
						return
					}
				}
			})
		}
		select {
		case failed <- struct{}{}:
		default:
		}
		return nil, syscall.EMFILE
	}
	t.Cleanup(func() { fileConn = net.FileConn })
	const writeTimeout = time.Minute
	// The dead-peer timeout (TCP_USER_TIMEOUT) ended such a connection
	// after 3 s too, and with it the wait: longer here, so that only
	// Shutdown can.
	e := newEnvWith(t, envConfig{opts: Options{ReadTimeout: time.Hour, WriteTimeout: writeTimeout}, deadPeer: 2 * time.Minute})
	e.waitRawListening()
	c := e.dialSmallReceive()
	kit.WaitFor(t, "the connection in the event loop", func() bool { p, _ := e.pollerConns(); return p == 1 })
	e.shrinkPolledSendBuffers()
	// Pipelined /cancel requests, never read: the answers fill both
	// socket buffers and the loop must hand the connection over.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		// Each request 256 bytes, 16 a write: the loop's 4 KiB reads end
		// between requests, and it hands over only for a full socket.
		one := ""
		for pad := 0; len(one) < 256; pad++ {
			one = rawPost("/lock", fmt.Sprintf(`{"type":"pull","resource_id":"k%s","node_id":"a"}`, strings.Repeat("x", pad)))
		}
		if len(one) != 256 {
			panic(len(one))
		}
		req := strings.Repeat(one, 16)
		for {
			select {
			case <-stop:
				return
			default:
			}
			_ = c.SetWriteDeadline(time.Now().Add(50 * time.Millisecond))
			if _, err := io.WriteString(c, req); err != nil {
				var ne net.Error
				if errors.As(err, &ne) && ne.Timeout() {
					continue
				}
				return
			}
		}
	}()
	defer func() { close(stop); c.Close(); wg.Wait() }()
	select {
	case <-failed:
	case <-time.After(kit.Patience):
		t.Fatal("the event loop never handed the connection over")
	}
	e.shutdownWithin(t, 4*time.Second, "a hand-over with no descriptor, its answers owed to a client that reads nothing")
}

// TestRawAcceptAttackShutdownAnswersArrivedFirstRequest: without
// Options.EventLoop, every new connection of the raw accept loop waits in
// an event loop with its first request unread. A request that has arrived
// whole (it is in the server's socket) before Shutdown is called is not
// "between requests" (docs/DESIGN.md, "When a server closes a
// connection"): it is answered, with Connection: close. The event loop,
// woken by stopLean, closed every connection it held without reading
// them, and the client saw its connection reset with no answer.
//
// Deterministic: one poller (GOMAXPROCS 2), held inside a hand-over
// (fileConn) while the second connection's request arrives and Shutdown
// begins.
func TestRawAcceptAttackShutdownAnswersArrivedFirstRequest(t *testing.T) {
	prev := runtime.GOMAXPROCS(2) // one event loop
	defer runtime.GOMAXPROCS(prev)
	entered := make(chan struct{})
	release := make(chan struct{})
	var first atomic.Bool
	fileConn = func(f *os.File) (net.Conn, error) {
		if first.CompareAndSwap(false, true) {
			close(entered)
			<-release
		}
		return net.FileConn(f)
	}
	t.Cleanup(func() { fileConn = net.FileConn })
	e := newEnvWith(t, envConfig{goroutines: true})
	e.waitRawListening()
	runtime.GOMAXPROCS(prev)
	e.srv.mu.Lock()
	np := len(e.srv.pollers)
	e.srv.mu.Unlock()
	if np != 1 {
		t.Fatalf("%d event loops, want 1", np)
	}

	c1 := e.dial()
	if _, err := io.WriteString(c1, rawPost("/cancel", smuggleLock)); err != nil {
		t.Fatal(err)
	}
	<-entered // the loop is in c1's hand-over

	c2 := e.dial()
	req := rawPost("/lock", smuggleLock)
	if _, err := io.WriteString(c2, req); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, "c2's whole request in its socket, in the event loop", func() bool {
		arrived := false
		e.eachPolled(func(pc *pollConn) {
			n, err := unix.IoctlGetInt(pc.fd, unix.SIOCINQ)
			arrived = arrived || (err == nil && n == len(req))
		})
		return arrived
	})

	done := make(chan error, 1)
	go func() { done <- e.srv.Shutdown(context.Background()) }()
	kit.WaitFor(t, "Shutdown to begin", func() bool { return e.srv.closing.Load() })
	close(release)

	// c1's request was read: answered (trackLean lets a handed-over
	// connection in while closing).
	if r, err := http.ReadResponse(bufio.NewReader(c1), nil); err != nil {
		t.Errorf("c1 (read before Shutdown, then handed over): %v", err)
	} else {
		bodyOf(r)
	}
	r, err := http.ReadResponse(bufio.NewReader(c2), nil)
	if err := <-done; err != nil {
		t.Errorf("Shutdown: %v", err)
	}
	if err != nil {
		t.Fatalf("c2's request had arrived before Shutdown was called, and got no answer: %v (held: %d)", err, e.m.Stats().Held)
	}
	body := bodyOf(r)
	if r.StatusCode != 200 || !r.Close {
		t.Fatalf("c2: %d close=%v %s", r.StatusCode, r.Close, body)
	}
}

// TestRawAcceptAttackListenerAbuse: one listener of Listen, Served twice at once by
// a server without the event loop, clients connecting throughout, then
// Close called twice concurrently by its owner and Shutdown by the server:
// both Serves return, nothing stays counted, the port is free, and every
// descriptor comes back.
func TestRawAcceptAttackListenerAbuse(t *testing.T) {
	before := openFDs(t)
	srv, ln, served := listenAndServe(t, Options{}, "127.0.0.1:0", 2)
	addr := ln.Addr().String()
	var ok, conns atomic.Int64
	stop := flood(addr, 8, func(i int, c net.Conn) {
		conns.Add(1)
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		switch i % 3 {
		case 0: // a whole request, the answer read
			fmt.Fprint(c, rawPost("/cancel", smuggleLock))
			if r, err := http.ReadResponse(bufio.NewReader(c), nil); err == nil {
				bodyOf(r)
				ok.Add(1)
			}
		case 1: // half a request
			fmt.Fprint(c, "POST /lock HTTP/1.1\r\nHost: x\r\n")
		case 2: // a stream
			fmt.Fprint(c, "GET /subscribe?node_id=n HTTP/1.1\r\nHost: x\r\n\r\n")
		}
		c.Close()
	})
	kit.WaitFor(t, "a flood", func() bool { return ok.Load() > 100 && conns.Load() > 300 })
	var cw sync.WaitGroup
	for range 2 {
		cw.Add(1)
		go func() { defer cw.Done(); ln.Close() }()
	}
	cw.Wait()
	if l2, err := net.Listen("tcp", addr); err != nil {
		t.Errorf("port still bound after Close returned: %v", err)
	} else {
		l2.Close()
	}
	for range 2 {
		if err := <-served; !errors.Is(err, net.ErrClosed) {
			t.Errorf("Serve: %v", err)
		}
	}
	stop()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := srv.Shutdown(ctx); err != nil {
		t.Logf("Shutdown: %v", err)
	}
	kit.WaitFor(t, "no connection counted", func() bool { return srv.conns.Load() == 0 })
	kit.Await(t, "every descriptor back", func() error {
		if got := openFDs(t); got > before {
			return fmt.Errorf("%d descriptors open, %d before", got, before)
		}
		return nil
	})
}

// TestRawAcceptAttackShutdownDuringFloodNoEventLoop: Shutdown with a short context
// while clients flood a server without the event loop, many of them
// sending half a request and holding it: Shutdown returns within about its
// context, and nothing stays counted.
func TestRawAcceptAttackShutdownDuringFloodNoEventLoop(t *testing.T) {
	e := newEnvWith(t, envConfig{goroutines: true, opts: Options{ReadTimeout: time.Hour, WriteTimeout: time.Hour}})
	e.waitRawListening()
	var n atomic.Int64
	var mu sync.Mutex
	var held []net.Conn
	stop := flood(e.addr(), 8, func(i int, c net.Conn) {
		n.Add(1)
		if i%2 == 0 {
			fmt.Fprint(c, "POST /lock HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
		}
		mu.Lock()
		held = append(held, c)
		mu.Unlock()
	})
	defer func() {
		mu.Lock()
		for _, c := range held {
			c.Close()
		}
		mu.Unlock()
	}()
	kit.WaitFor(t, "a flood", func() bool { return n.Load() > 300 })
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := e.srv.Shutdown(ctx)
	took := time.Since(start)
	stop()
	t.Logf("Shutdown: %v after %v, %d connections", err, took.Round(time.Millisecond), n.Load())
	if took > 3*time.Second {
		t.Fatalf("Shutdown with a 300 ms context took %v", took)
	}
	kit.WaitFor(t, "no connection counted", func() bool { return e.srv.conns.Load() == 0 })
}
