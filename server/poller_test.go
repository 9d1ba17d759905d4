package server

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"golang.org/x/sys/unix"
)

// pollerConns counts the connections the event loop holds, and the lean
// loop's goroutines.
func (e *env) pollerConns() (polled, goroutines int) {
	e.srv.mu.Lock()
	defer e.srv.mu.Unlock()
	for _, p := range e.srv.pollers {
		p.mu.Lock()
		polled += p.n
		p.mu.Unlock()
	}
	return polled, len(e.srv.leanConns)
}

// dialSmallReceive connects with a small receive buffer, set before it
// connects: a few dozen answers fill it. The connection is closed after
// the test.
func (e *env) dialSmallReceive() net.Conn {
	e.t.Helper()
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		return rc.Control(func(fd uintptr) { _ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, 4096) })
	}}
	c, err := d.Dial("tcp", e.addr())
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { c.Close() })
	return c
}

// shrinkPolledSendBuffers makes the send buffer of every connection the
// event loops hold small: a client that reads nothing fills it soon.
func (e *env) shrinkPolledSendBuffers() {
	e.eachPolled(func(pc *pollConn) {
		_ = unix.SetsockoptInt(pc.fd, unix.SOL_SOCKET, unix.SO_SNDBUF, 4096)
	})
}

// eachPolled calls f on every connection the event loops hold, under
// their locks.
func (e *env) eachPolled(f func(pc *pollConn)) {
	e.srv.mu.Lock()
	defer e.srv.mu.Unlock()
	for _, p := range e.srv.pollers {
		p.mu.Lock()
		for _, pc := range p.conns {
			if pc != nil {
				f(pc)
			}
		}
		p.mu.Unlock()
	}
}

// TestEventLoopHandsOver: the event loop holds a connection between
// requests, without a goroutine; a request that arrives in two parts
// moves the connection to a goroutine of its own, which answers it and
// the requests after it.
func TestEventLoopHandsOver(t *testing.T) {
	e := newEnv(t, nil)
	c := e.dial()
	br := bufio.NewReader(c)
	read := func(want string) {
		t.Helper()
		r, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		if body := bodyOf(r); r.StatusCode != 200 || !strings.Contains(body, want) {
			t.Fatalf("%d %s, want 200 %s", r.StatusCode, body, want)
		}
	}
	if _, err := io.WriteString(c, rawPost("/lock", smuggleLock)); err != nil {
		t.Fatal(err)
	}
	read(`"acquired":true`)
	if p, g := e.pollerConns(); p != 1 || g != 0 {
		t.Fatalf("after a whole request: %d connections in the event loop, %d goroutines; want 1, 0", p, g)
	}
	raw := rawPost("/unlock", smuggleLock)
	half := strings.Index(raw, "\r\n\r\n") + 6
	for _, part := range []string{raw[:half], raw[half:]} {
		if _, err := io.WriteString(c, part); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	read(`"released":true`)
	if _, err := io.WriteString(c, rawPost("/lock", smuggleLock)); err != nil {
		t.Fatal(err)
	}
	read(`"acquired":true`)
	if p, g := e.pollerConns(); p != 0 || g != 1 {
		t.Fatalf("after a request in two parts: %d connections in the event loop, %d goroutines; want 0, 1", p, g)
	}
}

// TestIdleTimeout: a connection that sends nothing for the idle timeout
// is closed, whether it waits in the event loop or in a goroutine; one
// that keeps sending is not.
func TestIdleTimeout(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) {
			// The lean loop's goroutine may close a connection silent
			// for half the idle timeout (stale): the busy one sends
			// far more often.
			const idle = 500 * time.Millisecond
			e := newEnvWith(t, envConfig{goroutines: l.goroutines, idle: idle})
			busy, quiet := e.dial(), e.dial()
			start := time.Now()
			for _, c := range []net.Conn{busy, quiet} {
				if r := exchange(t, c, rawPost("/cancel", smuggleLock)); r.StatusCode != 200 {
					t.Fatalf("%d", r.StatusCode)
				}
			}
			for time.Since(start) < 3*idle {
				time.Sleep(idle / 20)
				if r := exchange(t, busy, rawPost("/cancel", smuggleLock)); r.StatusCode != 200 {
					t.Fatalf("%d", r.StatusCode)
				}
			}
			waitClosed(t, quiet, "an idle connection")
			if d := time.Since(start); d < idle {
				t.Fatalf("closed after %v, before the idle timeout of %v", d, idle)
			}
			if r := exchange(t, busy, rawPost("/cancel", smuggleLock)); r.StatusCode != 200 {
				t.Fatalf("the busy connection: %d", r.StatusCode)
			}
		})
	}
}

// TestCloseEndsIdleConnections: Close closes the connections waiting for
// a request at once, in the event loop and in goroutines alike.
func TestCloseEndsIdleConnections(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) {
			e := newEnvWith(t, envConfig{goroutines: l.goroutines})
			c := e.dial()
			if r := exchange(t, c, rawPost("/cancel", smuggleLock)); r.StatusCode != 200 {
				t.Fatalf("%d", r.StatusCode)
			}
			done := make(chan error, 1)
			go func() { done <- e.srv.Close() }()
			waitClosed(t, c, "an idle connection at Close")
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("Close did not return")
			}
			if n := e.srv.conns.Load(); n != 0 {
				t.Fatalf("%d connections open after Close", n)
			}
		})
	}
}

// TestEventLoopHandOverWithoutDescriptor: when a connection must leave the
// event loop and no descriptor is left for its duplicate (EMFILE), every
// request that ran is still answered before the connection closes: a
// client must not hold a lock it never heard of.
func TestEventLoopHandOverWithoutDescriptor(t *testing.T) {
	failed := make(chan struct{}, 1)
	fileConn = func(*os.File) (net.Conn, error) {
		select {
		case failed <- struct{}{}:
		default:
		}
		return nil, syscall.EMFILE
	}
	t.Cleanup(func() { fileConn = net.FileConn })
	e := pollerEnv(t, envConfig{})
	// Small socket buffers at both ends, the client's set before it
	// connects: a few dozen answers fill them, and the event loop must
	// hand the connection over with answers it could not write.
	c := e.dialSmallReceive()
	_ = c.SetDeadline(time.Now().Add(kit.Patience))
	if r := exchange(t, c, rawPost("/cancel", smuggleLock)); r.StatusCode != 200 {
		t.Fatal(r.StatusCode)
	}
	kit.WaitFor(t, "the connection in the event loop", func() bool { p, _ := e.pollerConns(); return p == 1 })
	e.shrinkPolledSendBuffers()
	// Locks on distinct keys, each request 256 bytes and written 16 at a
	// time, so that the event loop's reads (4 KiB) end between requests.
	const n = 4000
	req := func(i int) string {
		r := ""
		for pad := 0; len(r) < 256; pad++ {
			r = rawPost("/lock", fmt.Sprintf(`{"type":"pull","resource_id":"k%06d%s","node_id":"a"}`, i, strings.Repeat("x", pad)))
		}
		return r
	}
	if len(req(0)) != 256 {
		t.Fatalf("a request is %d bytes", len(req(0)))
	}
	go func() {
		for i := 0; i < n; i += 16 {
			var sb strings.Builder
			for j := i; j < i+16; j++ {
				sb.WriteString(req(j))
			}
			if _, err := io.WriteString(c, sb.String()); err != nil {
				return
			}
		}
	}()
	select {
	case <-failed:
	case <-time.After(kit.Patience):
		t.Fatal("the event loop never handed the connection over")
	}
	br := bufio.NewReader(c)
	answered := 0
	for {
		r, err := http.ReadResponse(br, nil)
		if err != nil {
			break // the connection closed after what it owed
		}
		if body := bodyOf(r); r.StatusCode != 200 || !strings.Contains(body, `"acquired":true`) {
			t.Fatalf("answer %d: %d %s", answered, r.StatusCode, body)
		}
		answered++
	}
	held := e.m.Stats().Held
	if answered != held || held == 0 || held == n {
		t.Fatalf("%d locks taken, %d answered (of %d requests sent)", held, answered, n)
	}
	kit.WaitFor(t, "the connection to be counted closed", func() bool { return e.srv.conns.Load() == 0 })
}

// TestEventLoopOpensStreams: a connection whose first request is a
// /subscribe goes from the event loop to the hub as a bare socket, never
// through a connection of Go's netpoller (fileConn); its stream carries the
// session's events, and its count in the server's connections ends when
// the client leaves. A /subscribe refused is answered, and the connection
// serves what follows.
func TestEventLoopOpensStreams(t *testing.T) {
	var converted atomic.Int32
	fileConn = func(f *os.File) (net.Conn, error) {
		converted.Add(1)
		return net.FileConn(f)
	}
	t.Cleanup(func() { fileConn = net.FileConn })
	e := pollerEnv(t, envConfig{})
	c, err := net.Dial("tcp", e.addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(kit.Patience))
	if _, err := io.WriteString(c, "GET /subscribe?node_id=a HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	r, err := http.ReadResponse(br, nil)
	if err != nil || r.StatusCode != 200 || r.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("the stream's answer: %v %v", r, err)
	}
	e.call("POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"a"}`)
	readUntil(t, br, "event: lock_assigned")
	if n := converted.Load(); n != 0 {
		t.Fatalf("the stream's socket went through %d connections of Go's netpoller", n)
	}
	open := e.srv.conns.Load() // the stream's and e.call's, kept alive
	c.Close()
	kit.WaitFor(t, "the stream's connection uncounted", func() bool { return e.srv.conns.Load() == open-1 })

	// Refused: answered, then the connection goes on in the lean loop.
	c2, err := net.Dial("tcp", e.addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	_ = c2.SetDeadline(time.Now().Add(kit.Patience))
	io.WriteString(c2, "GET /subscribe?node_id= HTTP/1.1\r\nHost: x\r\n\r\n"+rawPost("/cancel", `{"type":"pull","resource_id":"r","node_id":"b"}`))
	readAnswers(t, bufio.NewReader(c2), 2, func(i, status int, body string) {
		if want := []int{400, 200}[i]; status != want {
			t.Fatalf("answer %d: %d %s, want %d", i+1, status, body, want)
		}
	})
}

// TestEventLoopHandOverKeepsKeepalive: a connection the event loop hands
// to the lean loop keeps the keepalive its listener gave it (Listen), which
// net.FileConn, on the way, sets to Go's default (15 s, nine probes).
func TestEventLoopHandOverKeepsKeepalive(t *testing.T) {
	var addr string
	e := pollerEnv(t, envConfig{wrap: func(ln net.Listener) net.Listener {
		ln.Close()
		l, err := Listen(context.Background(), "127.0.0.1:0", time.Second, 3*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		addr = l.Addr().String()
		return l
	}})
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if ka := handedOverKeepalive(t, e, c); ka != [4]int{1, 1, 1, 3} {
		t.Fatalf("keepalive (on, idle s, interval s, count) %v after the hand-over: want the listener's, [1 1 1 3]", ka)
	}
}

// handedOverKeepalive sends half a request on c, the one connection of e,
// in its event loop, so that the loop hands it over, and returns the
// keepalive of its socket in the lean loop.
func handedOverKeepalive(t *testing.T, e *env, c net.Conn) [4]int {
	t.Helper()
	io.WriteString(c, "POST /lock HTTP/1.1\r\nHost: x\r\n")
	var lc *leanConn
	kit.WaitFor(t, "the connection in the lean loop", func() bool {
		e.srv.mu.Lock()
		defer e.srv.mu.Unlock()
		for l := range e.srv.leanConns {
			lc = l
		}
		return len(e.srv.leanConns) == 1
	})
	var ka [4]int
	if err := rawConn(lc.Conn).Control(func(fd uintptr) { ka = keepalive(t, int(fd)) }); err != nil {
		t.Fatal(err)
	}
	return ka
}

// keepalive reads a socket's keepalive: on, idle, interval, count.
func keepalive(t *testing.T, fd int) [4]int {
	t.Helper()
	var ka [4]int
	for i, o := range []struct{ level, opt int }{
		{unix.SOL_SOCKET, unix.SO_KEEPALIVE},
		{unix.IPPROTO_TCP, unix.TCP_KEEPIDLE},
		{unix.IPPROTO_TCP, unix.TCP_KEEPINTVL},
		{unix.IPPROTO_TCP, unix.TCP_KEEPCNT},
	} {
		v, err := unix.GetsockoptInt(fd, o.level, o.opt)
		if err != nil {
			t.Fatal(err)
		}
		ka[i] = v
	}
	return ka
}
