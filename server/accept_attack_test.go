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
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/lock/memory"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

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
	e := newEnvWith(t, envConfig{goroutines: true, prep: func(s *Server) {
		rt := s.routes["/cancel"]
		core := rt.core
		rt.core = func(ctx context.Context, body, buf []byte) (int, []byte) {
			if strings.Contains(string(body), "boom") {
				panic("boom")
			}
			return core(ctx, body, buf)
		}
	}})
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
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) {
			m, err := memory.New(context.Background(), memory.DefaultConfig())
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			srv := New(m, Options{EventLoop: !l.goroutines})
			ln, err := Listen(context.Background(), "[::1]:0", time.Second, 3*time.Second)
			if err != nil {
				t.Skipf("SKIPPED LOUDLY: no IPv6 loopback here: %v", err)
			}
			served := make(chan error, 1)
			go func() { served <- srv.Serve(ln, &http.Server{Handler: srv}) }()
			defer func() { srv.Close(); <-served }()
			kit.WaitFor(t, "the raw accept loop", func() bool { return rawAccepting(ln) })
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
			m, err := memory.New(context.Background(), memory.DefaultConfig())
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			srv := New(m, Options{EventLoop: !l.goroutines})
			ln, err := Listen(context.Background(), "127.0.0.1:0", time.Second, 3*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			addr := ln.Addr().String()
			served := make(chan error, 1)
			go func() { served <- srv.Serve(ln, &http.Server{Handler: srv}) }()
			kit.WaitFor(t, "the raw accept loop", func() bool { return rawAccepting(ln) })
			stop := make(chan struct{})
			flooding := make(chan struct{})
			var accepted atomic.Int64
			for range 8 {
				go func() {
					defer func() { flooding <- struct{}{} }()
					for {
						select {
						case <-stop:
							return
						default:
						}
						c, err := net.Dial("tcp", addr)
						if err != nil {
							continue
						}
						accepted.Add(1)
						fmt.Fprint(c, rawPost("/cancel", smuggleLock))
						c.Close()
					}
				}()
			}
			kit.WaitFor(t, "a flood", func() bool { return accepted.Load() > 200 })
			srv.Close()
			if err := <-served; !errors.Is(err, http.ErrServerClosed) {
				t.Errorf("Serve: %v", err)
			}
			close(stop)
			for range 8 {
				<-flooding
			}
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
