package server

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
)

// Attacks on docs/DESIGN.md, "When a server closes a connection": a live
// server never closes a connection with a request it read and did not
// answer, unless the answer before said Connection: close.

// shutdownBehind starts e's Shutdown in the background, waits until the
// server is closing and its pass listeners are closed, and returns
// Shutdown's result to come.
func shutdownBehind(t *testing.T, e *env) <-chan error {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), kit.Patience)
		defer cancel()
		done <- e.srv.Shutdown(ctx)
	}()
	kit.WaitFor(t, "the server to be closing, its pass listeners closed", func() bool {
		if !e.srv.closing.Load() {
			return false
		}
		e.srv.mu.Lock()
		defer e.srv.mu.Unlock()
		for _, p := range e.srv.passes {
			select {
			case <-p.done:
			default:
				return false
			}
		}
		return true
	})
	return done
}

// answersUntilClose reads answers from br until one says Connection: close or
// reading fails; it returns them and the error that ended them, if any.
func answersUntilClose(br *bufio.Reader) (rs []*http.Response, bodies []string, err error) {
	for {
		r, err := http.ReadResponse(br, nil)
		if err != nil {
			return rs, bodies, err
		}
		b, err := io.ReadAll(r.Body)
		if err != nil {
			return rs, bodies, err
		}
		rs, bodies = append(rs, r), append(bodies, string(b))
		if r.Close {
			return rs, bodies, nil
		}
	}
}

// leanStates reports the idle flags of the lean connections.
func (e *env) leanStates() (idle, busy int) {
	e.srv.mu.Lock()
	defer e.srv.mu.Unlock()
	for lc := range e.srv.leanConns {
		if lc.idle.Load() {
			idle++
		} else {
			busy++
		}
	}
	return idle, busy
}

// gateListener's connections block their first write until release is
// closed, after closing blocked: a client that does not read, made exact.
type gateListener struct {
	net.Listener
	blocked, release chan struct{}
}

func (l *gateListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &gateConn{TCPConn: c.(*net.TCPConn), l: l}, nil
}

type gateConn struct {
	*net.TCPConn // CloseWrite too
	l            *gateListener
	fired        atomic.Bool
}

func (c *gateConn) Write(p []byte) (int, error) {
	if !c.fired.Swap(true) {
		close(c.l.blocked)
		<-c.l.release
	}
	return c.TCPConn.Write(p)
}

// TestAttackPipelinedAnswersSurviveClosing: the lean loop holds the
// answers to pipelined requests in its buffer until the last one read; if
// the server starts closing while a write of that buffer is blocked (a
// client slow to read), the requests already read and answered must still
// get their answers, the last with Connection: close. The loop returned at
// its next turn instead, dropping the answers it held (requests that had
// taken effect) and cutting one in half.
func TestAttackPipelinedAnswersSurviveClosing(t *testing.T) {
	gl := &gateListener{blocked: make(chan struct{}), release: make(chan struct{})}
	e := newEnvWith(t, envConfig{goroutines: true, wrap: func(ln net.Listener) net.Listener {
		gl.Listener = ln
		return gl
	}})
	c := e.dial()
	// Fewer than leanBufSize bytes of requests, all read at once, whose
	// answers are more than leanBufSize: the buffer flushes by itself
	// while requests are still buffered.
	one := rawPost("/cancel", `{"type":"pull","resource_id":"x","node_id":"a"}`)
	n := (leanBufSize - 1) / len(one)
	if _, err := io.WriteString(c, strings.Repeat(one, n)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-gl.blocked:
	case <-time.After(kit.Patience):
		t.Fatal("the answers never filled the write buffer")
	}
	done := shutdownBehind(t, e)
	close(gl.release)
	rs, _, err := answersUntilClose(bufio.NewReader(c))
	if err != nil {
		t.Fatalf("after %d of %d answers: %v (answers lost to the close)", len(rs), n, err)
	}
	for i, r := range rs {
		if r.StatusCode != http.StatusOK {
			t.Fatalf("answer %d: %d", i+1, r.StatusCode)
		}
	}
	waitClosed(t, c, "an answer that announced the close")
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestAttackPanicWhileClosing: a pipelined request panics while the server
// closes. Its 500 and the answers before it must still go out: the event
// loop handed them to a lean goroutine, which a closing server refused, and
// the connection closed with requests that had taken effect unanswered.
func TestAttackPanicWhileClosing(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) { testAttackPanicWhileClosing(t, l.goroutines) })
	}
}

func testAttackPanicWhileClosing(t *testing.T, goroutines bool) {
	entered, release := make(chan struct{}), make(chan struct{})
	e := newEnvWith(t, envConfig{goroutines: goroutines, prep: func(s *Server) {
		rt := s.routes["/cancel"]
		core := rt.core
		rt.core = func(ctx context.Context, body, buf []byte) (int, []byte) {
			if strings.Contains(string(body), "boom") {
				close(entered)
				<-release
				panic("boom")
			}
			return core(ctx, body, buf)
		}
	}})
	c := e.dial()
	raw := rawPost("/cancel", `{"type":"pull","resource_id":"first","node_id":"a"}`) +
		rawPost("/cancel", `{"type":"pull","resource_id":"boom","node_id":"a"}`)
	if _, err := io.WriteString(c, raw); err != nil {
		t.Fatal(err)
	}
	<-entered
	done := shutdownBehind(t, e)
	close(release)
	rs, _, err := answersUntilClose(bufio.NewReader(c))
	if err != nil || len(rs) != 2 || rs[0].StatusCode != 200 || rs[1].StatusCode != 500 {
		t.Fatalf("got %d answers (%v), want a 200 and a 500 with Connection: close", len(rs), err)
	}
	waitClosed(t, c, "a panicking request")
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestAttackPassWhileClosing: a request the lean loop leaves to net/http
// arrives whole while the server closes, after the pass listener closed.
// It must be answered (503, Connection: close), not dropped with the
// connection.
func TestAttackPassWhileClosing(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) { testAttackPassWhileClosing(t, l.goroutines) })
	}
}

func testAttackPassWhileClosing(t *testing.T, goroutines bool) {
	e := newEnvWith(t, envConfig{goroutines: goroutines})
	c := e.dial()
	br := bufio.NewReader(c)
	if goroutines {
		// The loop is running: waiting for this connection's next request.
		if r := exchange(t, c, rawPost("/cancel", smuggleLock)); r.StatusCode != 200 {
			t.Fatal(r.StatusCode)
		}
		kit.WaitFor(t, "the connection to wait, idle", func() bool { idle, _ := e.leanStates(); return idle == 1 })
	}
	// Half a request: the lean loop reads it (the event loop hands it to
	// the lean loop) and waits for the rest.
	if _, err := io.WriteString(c, "GET /status?type=pull&resource_id=r HTTP/1.1\r\nHost: x\r\n"); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, "the lean loop to read the request", func() bool { _, busy := e.leanStates(); return busy == 1 })
	done := shutdownBehind(t, e)
	if _, err := io.WriteString(c, "\r\n"); err != nil {
		t.Fatal(err)
	}
	rs, bodies, err := answersUntilClose(br)
	if err != nil || len(rs) != 1 {
		t.Fatalf("a whole request while closing: %d answers, %v", len(rs), err)
	}
	if rs[0].StatusCode != http.StatusServiceUnavailable || !strings.Contains(bodies[0], `"code":"unavailable"`) || rs[0].Header.Get("Retry-After") == "" {
		t.Fatalf("a request net/http would serve, while closing: %d %v %s", rs[0].StatusCode, rs[0].Header, bodies[0])
	}
	waitClosed(t, c, "the answer that announced the close")
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestAttackAnswerNotHeldForNextRequest: a request whole and the start of
// the next one arrive together; the answer to the first must go out while
// the lean loop waits for the rest of the second. It waited in the loop's
// buffer, and when the rest never came within the read timeout, the
// connection closed with the first request (which had taken effect)
// unanswered.
func TestAttackAnswerNotHeldForNextRequest(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) { testAttackAnswerNotHeldForNextRequest(t, l.goroutines) })
	}
}

func testAttackAnswerNotHeldForNextRequest(t *testing.T, goroutines bool) {
	e := newEnvWith(t, envConfig{goroutines: goroutines, opts: Options{ReadTimeout: 2 * time.Second}})
	c := e.dial()
	br := bufio.NewReader(c)
	req := func(r string) string { return rawPost("/lock", `{"type":"pull","resource_id":"`+r+`","node_id":"a"}`) }
	b, d := req("b"), req("d")
	// On the event loop, the first step hands the connection over with
	// the half request; the second is the lean loop's alone.
	for i, step := range []struct {
		send string
		want []string
	}{
		{req("a") + b[:20], []string{"a"}},
		{b[20:] + req("c") + d[:len(d)-5], []string{"b", "c"}},
		{d[len(d)-5:], []string{"d"}},
	} {
		if _, err := io.WriteString(c, step.send); err != nil {
			t.Fatal(err)
		}
		for _, w := range step.want {
			r, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("step %d: no answer for %s while the next request is incomplete: %v", i+1, w, err)
			}
			if body := bodyOf(r); r.StatusCode != 200 || !strings.Contains(body, `"acquired":true`) {
				t.Fatalf("step %d, %s: %d %s", i+1, w, r.StatusCode, body)
			}
		}
	}
}

// TestAttackNetHTTPClosingAnnounced: while the lean loops finish, before
// http.Server.Shutdown starts, net/http still serves the connections the
// lean loop passed it; their answers too must say Connection: close, or
// the client sends its next request on a connection Shutdown then closes.
func TestAttackNetHTTPClosingAnnounced(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) { testAttackNetHTTPClosingAnnounced(t, l.goroutines) })
	}
}

func testAttackNetHTTPClosingAnnounced(t *testing.T, goroutines bool) {
	entered, release := make(chan struct{}), make(chan struct{})
	e := newEnvWith(t, envConfig{goroutines: goroutines, prep: func(s *Server) {
		rt := s.routes["/lock"]
		core := rt.core
		rt.core = func(ctx context.Context, body, buf []byte) (int, []byte) {
			if strings.Contains(string(body), "slow") {
				close(entered)
				<-release
			}
			return core(ctx, body, buf)
		}
	}})
	get := "GET /status?type=pull&resource_id=r HTTP/1.1\r\nHost: x\r\n\r\n"
	x := e.dial()
	if r := exchange(t, x, get); r.StatusCode != 200 || r.Close {
		t.Fatalf("net/http before closing: %d, close %v", r.StatusCode, r.Close)
	}
	// A lean request in progress holds Shutdown before net/http's.
	y := e.dial()
	if _, err := io.WriteString(y, rawPost("/lock", `{"type":"pull","resource_id":"slow","node_id":"a"}`)); err != nil {
		t.Fatal(err)
	}
	<-entered
	done := shutdownBehind(t, e)
	r := exchange(t, x, get)
	close(release)
	if r.StatusCode != 200 || !r.Close {
		t.Fatalf("net/http while closing: %d, close %v, want Connection: close", r.StatusCode, r.Close)
	}
	if r := exchange(t, y, ""); r.StatusCode != 200 || !r.Close {
		t.Fatalf("the slow lean request: %d, close %v", r.StatusCode, r.Close)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestAttackCloseDrainBounded: after Connection: close, the server
// half-closes and reads what the client still sends, for a bounded time: a
// client that sends for ever gets its answer, and neither the connection
// nor Shutdown waits on it for ever.
func TestAttackCloseDrainBounded(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) { testAttackCloseDrainBounded(t, l.goroutines) })
	}
}

func testAttackCloseDrainBounded(t *testing.T, goroutines bool) {
	e := newEnvWith(t, envConfig{goroutines: goroutines})
	c := e.dial()
	_ = c.SetDeadline(time.Now().Add(kit.Patience))
	r := exchange(t, c, rawPost("/cancel", smuggleLock, "Connection: close"))
	if r.StatusCode != 200 || !r.Close {
		t.Fatalf("%d, close %v", r.StatusCode, r.Close)
	}
	wrote := make(chan error, 1)
	go func() {
		junk := []byte(strings.Repeat(rawPost("/lock", smuggleLock), 8))
		for {
			if _, err := c.Write(junk); err != nil {
				wrote <- err
				return
			}
		}
	}()
	done := shutdownBehind(t, e)
	if err := <-done; err != nil {
		t.Fatalf("Shutdown with a client that sends for ever: %v", err)
	}
	kit.WaitFor(t, "the connection to be closed", func() bool { return e.srv.conns.Load() == 0 })
	if err := <-wrote; errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatal("the server never closed the connection")
	}
	if st := e.m.Stats(); st.Held != 0 {
		t.Fatalf("a request sent after Connection: close was served: %+v", st)
	}
}
