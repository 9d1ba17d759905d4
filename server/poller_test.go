package server

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
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
