package server

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/lock/memory"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"
)

// rawLoops counts the raw accept loops (accept.go) that accept on ln.
func rawLoops(ln net.Listener) int {
	l, ok := ln.(*listener)
	if !ok {
		return 0
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.dups)
}

// listenAndServe serves a fresh memory server with opts on a listener of
// Listen at addr, from serves goroutines, once their raw accept loops
// accept; served gets what each Serve returns.
func listenAndServe(t *testing.T, opts Options, addr string, serves int) (srv *Server, ln net.Listener, served chan error) {
	t.Helper()
	m, err := memory.New(context.Background(), memory.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	srv = New(m, opts)
	if ln, err = Listen(context.Background(), addr, time.Second, 3*time.Second); err != nil {
		t.Fatal(err)
	}
	served = make(chan error, serves)
	for range serves {
		go func() { served <- srv.Serve(ln, &http.Server{Handler: srv}) }()
	}
	kit.WaitFor(t, "the raw accept loops", func() bool { return rawLoops(ln) == serves })
	return srv, ln, served
}

// waitRawListening waits until Serve has taken the raw accept loop for
// its listener: without it, the tests below would test Go's Accept.
func (e *env) waitRawListening() {
	e.t.Helper()
	kit.WaitFor(e.t, "Serve in the raw accept loop", func() bool { return rawLoops(e.ts.Listener) == 1 })
}

// polledFD is the descriptor of the one connection an event loop holds,
// and its peer's address.
func (e *env) polledFD() (fd int, remote string) {
	e.t.Helper()
	kit.WaitFor(e.t, "one connection in an event loop", func() bool {
		n := 0
		e.eachPolled(func(pc *pollConn) {
			fd, remote = pc.fd, pc.remote.String()
			n++
		})
		return n == 1
	})
	return fd, remote
}

// TestRawAccept: on a listener of Listen, Serve accepts with accept4 into
// an event loop, with or without Options.EventLoop. Without it (the etcd
// backend's way), the event loop runs no request: the first that is not a
// stream's opening moves the connection to a lean goroutine, which answers
// it and the ones pipelined behind it; a stream's opening gives the socket
// to the hub. The peer address is Go's.
func TestRawAccept(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) {
			e := newEnvWith(t, envConfig{goroutines: l.goroutines})
			e.waitRawListening()
			c := e.dial()
			if _, got := e.polledFD(); got != c.LocalAddr().String() {
				t.Fatalf("remote address %q, want the client's %q", got, c.LocalAddr())
			}
			if _, err := fmt.Fprint(c, rawPost("/lock", smuggleLock)+rawPost("/unlock", smuggleLock)); err != nil {
				t.Fatal(err)
			}
			readAnswers(t, bufio.NewReader(c), 2, func(i, status int, body string) {
				if status != 200 || !strings.Contains(body, []string{`"acquired":true`, `"released":true`}[i]) {
					t.Fatalf("answer %d: %d %s", i, status, body)
				}
			})
			polled, goroutines := e.pollerConns()
			want := [2]int{1, 0} // the event loop answered them and holds c
			if l.goroutines {
				want = [2]int{0, 1} // a lean goroutine answered them and holds c
			}
			if [2]int{polled, goroutines} != want {
				t.Fatalf("after two requests: %d connections in the event loop, %d lean; want %v", polled, goroutines, want)
			}
			sc, _ := e.openPlain("raw-node")
			e.waitStreams(1)
			if _, p := e.polled(); p != 1 {
				t.Fatal("the stream's socket is not in the hub's poll set")
			}
			sc.Close()
			e.waitStreams(0)
		})
	}
}

// TestRawAcceptSocketOptions: an accepted socket has what Go's Accept
// gave it, inherited from the listening socket: TCP_NODELAY, and the
// keepalive Listen set (seen by the kernel, not just asked for).
func TestRawAcceptSocketOptions(t *testing.T) {
	e := newEnv(t, nil)
	e.waitRawListening()
	e.dial()
	fd, _ := e.polledFD()
	for _, o := range []struct {
		name       string
		level, opt int
		want       int
	}{
		{"TCP_NODELAY", unix.IPPROTO_TCP, unix.TCP_NODELAY, 1},
		{"SO_KEEPALIVE", unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1},
		{"TCP_KEEPIDLE", unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, int(DefaultPingInterval / time.Second)},
		{"TCP_USER_TIMEOUT", unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(DefaultDeadPeer / time.Millisecond)},
	} {
		v, err := unix.GetsockoptInt(fd, o.level, o.opt)
		if err != nil || v != o.want {
			t.Errorf("%s: %d (%v), want %d", o.name, v, err, o.want)
		}
	}
}

// TestRawAcceptAddresses: accept's peer address, IPv4 and IPv6, is the
// one the client dialed from, as Go's Accept gives it.
func TestRawAcceptAddresses(t *testing.T) {
	for _, addr := range []string{"127.0.0.1:0", "[::1]:0"} {
		t.Run(addr, func(t *testing.T) {
			ln, err := net.Listen("tcp", addr)
			if err != nil {
				if strings.HasPrefix(addr, "[") {
					t.Skipf("SKIPPED LOUDLY: no IPv6 loopback here: %v", err)
				}
				t.Fatal(err)
			}
			defer ln.Close()
			c, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			rc, _ := ln.(*net.TCPListener).SyscallConn()
			var got net.Addr
			var aerr error
			kit.WaitFor(t, "a connection to accept", func() bool {
				_ = rc.Control(func(fd uintptr) {
					var nfd int
					if nfd, got, aerr = accept(int(fd)); aerr == nil {
						unix.Close(nfd)
					}
				})
				return aerr != unix.EAGAIN
			})
			if aerr != nil || got.String() != c.LocalAddr().String() {
				t.Errorf("accepted from %v (%v), want %v", got, aerr, c.LocalAddr())
			}
		})
	}
}

// TestRawAcceptListenerClosedUnder: a listener closed directly, not
// through the Server, takes nothing more once Close returns, frees its
// port, and ends Serve with net.ErrClosed.
func TestRawAcceptListenerClosedUnder(t *testing.T) {
	srv, ln, served := listenAndServe(t, Options{EventLoop: true}, "127.0.0.1:0", 1)
	defer srv.Close()
	ln.Close()
	if c, err := net.Dial("tcp", ln.Addr().String()); err == nil {
		c.Close()
		t.Fatal("the listening socket still takes connections after Close")
	}
	again, err := net.Listen("tcp", ln.Addr().String())
	if err != nil {
		t.Fatalf("the port is still bound after Close: %v", err)
	}
	again.Close()
	select {
	case err := <-served:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Serve returned %v, want net.ErrClosed", err)
		}
	case <-time.After(kit.Patience):
		t.Fatal("Serve did not return after its listener closed")
	}
	if rawLoops(ln) != 0 {
		t.Fatal("the closed listener keeps a duplicate")
	}
}

// TestRawAcceptOutOfDescriptors: accept4 failing with EMFILE is counted
// and retried, as with Go's Accept (TestAcceptErrorsRetried), and the
// connection waiting is served once descriptors are free.
func TestRawAcceptOutOfDescriptors(t *testing.T) {
	e := newEnv(t, nil)
	e.waitRawListening()
	starved := starveFDs(t)
	starved.fill(1) // the client's socket
	c, err := net.Dial("tcp", e.addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(kit.Patience))
	kit.WaitFor(t, "accept to fail for want of a descriptor", func() bool {
		return testutil.ToFloat64(e.srv.metrics.acceptErrors) >= 1
	})
	starved.restore()
	if r := exchange(t, c, rawPost("/lock", smuggleLock)); r.StatusCode != 200 {
		t.Fatalf("the connection accepted after the failures: %d", r.StatusCode)
	}
}
