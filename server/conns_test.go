package server

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/lock"
)

// addr is the server's host:port.
func (e *env) addr() string { return strings.TrimPrefix(e.ts.URL, "http://") }

// metric reads one sample, by its exact name and labels, from /metrics.
func (e *env) metric(name string) float64 {
	e.t.Helper()
	resp, err := http.Get(e.ts.URL + "/metrics")
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				e.t.Fatalf("metric %s: %v", name, err)
			}
			return f
		}
	}
	e.t.Fatalf("no metric %s", name)
	return 0
}

// dial connects to the server; the connection is closed after the test,
// and reads and writes fail after 10 s, which bounds a broken run only.
func (e *env) dial() net.Conn {
	e.t.Helper()
	c, err := net.Dial("tcp", e.addr())
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	return c
}

// waitClosed reads c until the server closes it; it fails the test if the
// read deadline comes first.
func waitClosed(t *testing.T, c net.Conn, what string) {
	t.Helper()
	_, err := io.Copy(io.Discard, c)
	if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
		t.Fatalf("%s: the server did not close the connection", what)
	}
}

// emfileListener fails its first fails accepts as a process out of file
// descriptors does.
type emfileListener struct {
	net.Listener
	fails atomic.Int32
}

func (l *emfileListener) Accept() (net.Conn, error) {
	if l.fails.Add(-1) >= 0 {
		return nil, &net.OpError{Op: "accept", Net: "tcp", Err: os.NewSyscallError("accept4", syscall.EMFILE)}
	}
	return l.Listener.Accept()
}

// TestAcceptErrorsRetried: EMFILE from accept is retried, not returned
// from Serve (which ended dlock serve and every lock with it).
func TestAcceptErrorsRetried(t *testing.T) {
	e := newEnvWith(t, envConfig{wrap: func(ln net.Listener) net.Listener {
		el := &emfileListener{Listener: ln}
		el.fails.Store(5)
		return el
	}})
	if status, got := e.call("POST", "/lock", smuggleLock); status != 200 || got["acquired"] != true {
		t.Fatalf("lock after accept errors: %d %v", status, got)
	}
	if n := e.metric("dlock_accept_errors_total"); n != 5 {
		t.Fatalf("dlock_accept_errors_total %v, want 5", n)
	}
}

// TestMaxConns: past MaxConns a new connection is answered 503 overloaded
// with Retry-After and closed; once one closes, connections are taken
// again. The same from Go's Accept and from the raw accept loop.
func TestMaxConns(t *testing.T) {
	for _, goAccept := range []bool{false, true} {
		t.Run(fmt.Sprintf("goAccept=%v", goAccept), func(t *testing.T) { testMaxConns(t, goAccept) })
	}
}

func testMaxConns(t *testing.T, goAccept bool) {
	e := newEnvWith(t, envConfig{opts: Options{MaxConns: 2}, goAccept: goAccept})
	if !goAccept {
		e.waitRawListening()
	}
	held := []net.Conn{e.dial(), e.dial()}
	for _, c := range held {
		if r := exchange(t, c, rawPost("/cancel", smuggleLock)); r.StatusCode != 200 {
			t.Fatalf("below the limit: %d", r.StatusCode)
		}
	}
	for i, send := range []bool{false, true} {
		c := e.dial()
		if send { // a client that sends its request at once still reads the answer
			if _, err := io.WriteString(c, rawPost("/lock", smuggleLock)); err != nil {
				t.Fatal(err)
			}
		}
		r, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatalf("over the limit %d: %v", i, err)
		}
		body := bodyOf(r)
		if r.StatusCode != 503 || !strings.Contains(body, `"code":"overloaded"`) || r.Header.Get("Retry-After") != "1" || r.Header.Get("Dlock-Epoch") != e.m.Info().Epoch {
			t.Fatalf("over the limit %d: %d %v %s", i, r.StatusCode, r.Header, body)
		}
		waitClosed(t, c, "refused connection")
	}
	if st := e.m.Stats(); st.Held != 0 {
		t.Fatalf("a refused connection's request was served: %+v", st)
	}
	held[0].Close()
	kit.WaitFor(t, "the closed connection to be counted out", func() bool { return e.srv.conns.Load() == 1 })
	if got := e.metric("dlock_connections_refused_total"); got != 2 {
		t.Fatalf("dlock_connections_refused_total %v, want 2", got)
	}
}

// exchange writes raw on c and reads one answer.
func exchange(t *testing.T, c net.Conn, raw string) *http.Response {
	t.Helper()
	if _, err := io.WriteString(c, raw); err != nil {
		t.Fatal(err)
	}
	r, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	bodyOf(r)
	return r
}

// TestHalfSentRequestTimesOut: a request whose headers or body stop
// arriving is dropped after the read timeout, on the lean loop and on
// net/http (which, given the connection by the lean loop, had none).
func TestHalfSentRequestTimesOut(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) { testHalfSentRequestTimesOut(t, l.goroutines) })
	}
}

func testHalfSentRequestTimesOut(t *testing.T, goroutines bool) {
	e := newEnvWith(t, envConfig{goroutines: goroutines, opts: Options{ReadTimeout: 100 * time.Millisecond}})
	for _, c := range []struct{ name, raw string }{
		{"lean loop, body", "POST /lock HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"type\""},
		{"lean loop, headers", "POST /lock HTTP/1.1\r\nHost: x\r\nContent-Len"},
		{"net/http, chunked body", "POST /lock HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n40\r\n{\"type\""},
		{"net/http, body", "POST /refcount/add HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"type\""},
		{"net/http, headers", "GET /status HTTP/1.1\r\nHost: x\r\nX-Pad: 1\r\n\r\n" + "GET /status HTTP/1.1\r\nHo"},
	} {
		conn := e.dial()
		if _, err := io.WriteString(conn, c.raw); err != nil {
			// On a loaded machine the read timeout may have closed it
			// before the first byte: closed either way.
			conn.Close()
			continue
		}
		waitClosed(t, conn, c.name)
	}
}

// pipelineUntilBlocked writes pipelined /cancel requests on c and never
// reads the answers, until a write blocks for 200 ms (the server has
// stopped reading: it is stuck writing to us) or fails. It reports which.
func pipelineUntilBlocked(t *testing.T, c net.Conn) (blocked bool) {
	t.Helper()
	batch := strings.Repeat(rawPost("/cancel", smuggleLock), 100)
	end := time.Now().Add(10 * time.Second)
	for time.Now().Before(end) {
		_ = c.SetWriteDeadline(time.Now().Add(200 * time.Millisecond))
		if _, err := io.WriteString(c, batch); err != nil {
			if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
				return true
			}
			return false
		}
	}
	t.Fatal("the server read 10 s of pipelined requests without blocking")
	return false
}

// TestNonReadingClientTimesOut: a client that pipelines requests and never
// reads the answers is dropped after the write timeout.
func TestNonReadingClientTimesOut(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) { testNonReadingClientTimesOut(t, l.goroutines) })
	}
}

func testNonReadingClientTimesOut(t *testing.T, goroutines bool) {
	e := newEnvWith(t, envConfig{goroutines: goroutines, opts: Options{WriteTimeout: 100 * time.Millisecond}})
	c := e.dial()
	// Blocked, our writes go on failing by our deadline until the server
	// gives up and closes; then they fail for that.
	kit.WaitFor(t, "a write to fail on a closed connection", func() bool { return !pipelineUntilBlocked(t, c) })
	kit.WaitFor(t, "the connection to be closed", func() bool { return e.srv.conns.Load() == 0 })
}

// TestShutdownBounded: Shutdown ends within its context whatever clients
// do: one pipelines and never reads, one sends half a request to net/http,
// one holds an event stream and does not read it.
func TestShutdownBounded(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) { testShutdownBounded(t, l.goroutines) })
	}
}

func testShutdownBounded(t *testing.T, goroutines bool) {
	e := newEnvWith(t, envConfig{goroutines: goroutines, opts: Options{ReadTimeout: time.Hour, WriteTimeout: time.Hour}})
	stream := e.dial()
	if _, err := io.WriteString(stream, "GET /subscribe?node_id=a HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	half := e.dial()
	if _, err := io.WriteString(half, "POST /lock HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n40\r\n{"); err != nil {
		t.Fatal(err)
	}
	pipe := e.dial()
	if !pipelineUntilBlocked(t, pipe) {
		t.Fatal("the server closed the pipelining connection before shutdown")
	}
	kit.WaitFor(t, "three connections", func() bool { return e.srv.conns.Load() == 3 })
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- e.srv.Shutdown(ctx) }()
	select {
	case err := <-done:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Shutdown: %v, want the deadline exceeded (clients held connections)", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Shutdown did not return after its context ended")
	}
	for _, c := range []net.Conn{stream, half, pipe} {
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		waitClosed(t, c, "after shutdown")
	}
	if n := e.srv.conns.Load(); n != 0 {
		t.Fatalf("%d connections open after Shutdown", n)
	}
}

// TestFramingRefused: requests the lean loop once answered although
// net/http frames them differently go to net/http, which refuses them (or
// reads them as it would without the lean loop); none is executed as the
// lean loop read it.
func TestFramingRefused(t *testing.T) {
	want := map[string]int{
		"Transfer-Encoding identity": 501, // net/http: unsupported transfer encoding
		"folded header line":         200, // net/http unfolds it: a valid request
	}
	for _, c := range framingCases {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t, nil)
			if c.raw == smuggledUnlock {
				e.call("POST", "/lock", smuggleLock)
			}
			r := rawExchange(t, e.addr(), c.raw, 1)[0]
			status := cmpOr(want[c.name], 400)
			if body := bodyOf(r); r.StatusCode != status {
				t.Fatalf("%d %s, want %d", r.StatusCode, body, status)
			}
			_, st := e.call("GET", "/status?type=pull&resource_id=smuggle", "")
			switch {
			case c.raw == smuggledUnlock && st["holder"] != "a":
				t.Fatalf("the smuggled /unlock was executed: %v", st)
			case c.raw != smuggledUnlock && status != 200 && st["state"] != "free":
				t.Fatalf("the refused /lock was executed: %v", st)
			}
		})
	}
}

func cmpOr(a, b int) int {
	if a != 0 {
		return a
	}
	return b
}

// TestPanicRecovered: a panic while serving a request is answered 500 with
// Connection: close, the connection then closes, the panic is counted, and
// the server goes on, on both loops and on net/http (docs/DESIGN.md, "When
// a server closes a connection").
func TestPanicRecovered(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) { testPanicRecovered(t, l.goroutines) })
	}
}

// panicOnBoom makes s's /cancel panic for a resource named boom.
func panicOnBoom(s *Server) {
	rt := s.routes["/cancel"]
	core := rt.core
	rt.core = func(ctx context.Context, body, buf []byte) (int, []byte) {
		if strings.Contains(string(body), "boom") {
			panic("boom")
		}
		return core(ctx, body, buf)
	}
}

func testPanicRecovered(t *testing.T, goroutines bool) {
	e := newEnvWith(t, envConfig{goroutines: goroutines, prep: panicOnBoom})
	boom := `{"type":"pull","resource_id":"boom","node_id":"a"}`
	for _, raw := range []string{
		rawPost("/cancel", boom), // the lean loop
		"POST /cancel HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + strconv.FormatInt(int64(len(boom)), 16) + "\r\n" + boom + "\r\n0\r\n\r\n", // net/http
	} {
		c := e.dial()
		// Another request after it, already sent: the answer must not be
		// lost to the reset that closing with it unread would send.
		r := exchange(t, c, raw+rawPost("/cancel", boom))
		if r.StatusCode != http.StatusInternalServerError || !r.Close {
			t.Fatalf("a panicking request: %d, close %v, want 500 and Connection: close", r.StatusCode, r.Close)
		}
		waitClosed(t, c, "a panicking request")
	}
	if status, got := e.call("POST", "/lock", smuggleLock); status != 200 || got["acquired"] != true {
		t.Fatalf("after the panics: %d %v", status, got)
	}
	if n := e.metric("dlock_handler_panics_total"); n != 2 {
		t.Fatalf("dlock_handler_panics_total %v, want 2", n)
	}
}

// TestStreamOutlivesReadTimeout: an event stream is a long GET; the read
// timeout of its request must not end it.
func TestStreamOutlivesReadTimeout(t *testing.T) {
	e := newEnvWith(t, envConfig{opts: Options{ReadTimeout: 50 * time.Millisecond, WriteTimeout: 50 * time.Millisecond}})
	s := e.subscribe("node_id=a", "")
	s.Next(t)
	// The operator feed is served by the same plumbing (eventStream).
	ops := kit.OpenStream(t, e.ts.URL+"/ui/events", "")
	// Pings come every 50 ms: read them for several read timeouts.
	for _, st := range []*kit.Stream{s, ops} {
		for start := time.Now(); time.Since(start) < 300*time.Millisecond; {
			if line := st.Line(t); line != ": ping\n" && line != "\n" && !strings.HasPrefix(line, "retry:") &&
				!strings.HasPrefix(line, "event: subscribed") && !strings.HasPrefix(line, `data: {"event":"subscribed"`) {
				t.Fatalf("unexpected line %q", line)
			}
		}
	}
	// Straight to the backend: a new connection's request must arrive
	// within the 50 ms read timeout, which a loaded machine may miss.
	if _, err := e.m.TryLock(t.Context(), lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "a", Lease: lock.LeaseSession}); err != nil {
		t.Fatal(err)
	}
	if f := s.Next(t); f.Event != "lock_assigned" {
		t.Fatalf("got %+v", f)
	}
}

// TestRequestView: the entry point sees the same request whichever loop
// read it, the Authorization header included.
func TestRequestView(t *testing.T) {
	raw := "POST /lock HTTP/1.1\r\nHost: x\r\nauthorization:  Bearer t0k \r\nContent-Length: 2\r\n\r\n{}"
	req, st := peekRequest(bufio.NewReader(strings.NewReader(raw)), nil)
	if st != leanServe {
		t.Fatalf("the lean loop does not take %q", raw)
	}
	server, client := net.Pipe()
	defer server.Close()
	defer client.Close()
	lean := request{method: http.MethodPost, path: req.path, head: req.head, body: req.body, conn: server}
	hr := httptest.NewRequest("POST", "/lock", strings.NewReader("{}"))
	hr.Header.Set("Authorization", "Bearer t0k")
	hr.RemoteAddr = "pipe"
	hr.TLS = &tls.ConnectionState{}
	nh := request{method: hr.Method, path: hr.URL.Path, r: hr}
	if lean.header("Authorization") != "Bearer t0k" || nh.header("Authorization") != "Bearer t0k" || lean.header("X-None") != "" {
		t.Fatalf("Authorization: lean %q, net/http %q", lean.header("Authorization"), nh.header("Authorization"))
	}
	if lean.remoteAddr() != "pipe" || nh.remoteAddr() != "pipe" || lean.tlsState() != nil || nh.tlsState() == nil {
		t.Fatalf("remote %q %q, TLS %v %v", lean.remoteAddr(), nh.remoteAddr(), lean.tlsState(), nh.tlsState())
	}
	if _, st := peekRequest(bufio.NewReader(strings.NewReader(strings.Replace(raw, "Host", "Authorization: b\r\nHost", 1))), nil); st != leanPass {
		t.Fatal("two Authorization headers: the lean loop must leave the request to net/http")
	}
}

// TestPipelinedFloodNeverReadTimesOut: a client sends a flood of pipelined
// requests as its very first bytes and never reads. The answers fill the
// lean loop's buffer, which flushes by itself before the loop's explicit
// flush: that write too must be bounded by the write timeout (it blocked
// for ever when the deadline was set only before explicit flushes).
func TestPipelinedFloodNeverReadTimesOut(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) { testPipelinedFloodNeverReadTimesOut(t, l.goroutines) })
	}
}

func testPipelinedFloodNeverReadTimesOut(t *testing.T, goroutines bool) {
	e := newEnvWith(t, envConfig{goroutines: goroutines, opts: Options{WriteTimeout: 100 * time.Millisecond}})
	c := e.dial()
	_ = c.(*net.TCPConn).SetReadBuffer(4096)
	body := `{"type":"pull","resource_id":"x","node_id":"nope"}`
	req := fmt.Sprintf("POST /cancel HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	flood := []byte(strings.Repeat(req, 100000))
	wrote := make(chan struct{})
	go func() {
		defer close(wrote)
		_ = c.SetWriteDeadline(time.Now().Add(20 * time.Second))
		_, _ = c.Write(flood)
	}()
	kit.WaitFor(t, "the connection to be closed", func() bool { return e.srv.conns.Load() == 0 })
	c.Close()
	<-wrote
}

// TestSlowAnswerStillSent: an answer that took longer than the write
// timeout to compute (a backend waiting on etcd) is still written whole:
// the write deadline runs from when the answer is ready, on both loops and
// on net/http (docs/DESIGN.md, "When a server closes a connection").
func TestSlowAnswerStillSent(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) { testSlowAnswerStillSent(t, l.goroutines) })
	}
}

func testSlowAnswerStillSent(t *testing.T, goroutines bool) {
	const wt = 50 * time.Millisecond
	// slow lets the write timeout pass three times over: the state of the
	// clock this test needs, not an ordering of events.
	slow := func() { time.Sleep(3 * wt) }
	e := newEnvWith(t, envConfig{goroutines: goroutines, opts: Options{WriteTimeout: wt}, prep: func(s *Server) {
		lock := s.routes["/lock"]
		core := lock.core
		lock.core = func(ctx context.Context, body, buf []byte) (int, []byte) {
			slow()
			return core(ctx, body, buf)
		}
		status := s.routes["/status"]
		h := status.h
		status.h = func(w http.ResponseWriter, r *http.Request) error {
			slow()
			return h(w, r)
		}
	}})
	body := `{"type":"pull","resource_id":"slow","node_id":"a"}`
	for _, c := range []struct{ name, raw string }{
		{"lean loop", rawPost("/lock", body)},
		{"net/http, POST", "POST /lock HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + strconv.FormatInt(int64(len(body)), 16) + "\r\n" + body + "\r\n0\r\n\r\n"},
		{"net/http, GET", "GET /status?type=pull&resource_id=slow HTTP/1.1\r\nHost: x\r\n\r\n"},
	} {
		conn := e.dial()
		if _, err := io.WriteString(conn, c.raw); err != nil {
			t.Fatal(err)
		}
		r, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatalf("%s: no answer after the write timeout: %v", c.name, err)
		}
		if got := bodyOf(r); r.StatusCode != http.StatusOK || !strings.Contains(got, "slow") && !strings.Contains(got, "acquired") {
			t.Fatalf("%s: %d %s", c.name, r.StatusCode, got)
		}
	}
}

// TestClosingAnnounced: while the server closes, an answer it gives on a
// keep-alive connection says Connection: close, so that the client sends
// nothing more on a connection about to close (docs/DESIGN.md, "When a
// server closes a connection"); both loops.
func TestClosingAnnounced(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) { testClosingAnnounced(t, l.goroutines) })
	}
}

func testClosingAnnounced(t *testing.T, goroutines bool) {
	var srv *Server
	e := newEnvWith(t, envConfig{goroutines: goroutines, prep: func(s *Server) {
		srv = s
		rt := s.routes["/cancel"]
		core := rt.core
		rt.core = func(ctx context.Context, body, buf []byte) (int, []byte) {
			if strings.Contains(string(body), "last") {
				// The server starts closing while this request is served.
				s.closing.Store(true)
			}
			return core(ctx, body, buf)
		}
	}})
	c := e.dial()
	if r := exchange(t, c, rawPost("/cancel", `{"type":"pull","resource_id":"first","node_id":"a"}`)); r.StatusCode != http.StatusOK || r.Close {
		t.Fatalf("before closing: %d, close %v", r.StatusCode, r.Close)
	}
	r := exchange(t, c, rawPost("/cancel", `{"type":"pull","resource_id":"last","node_id":"a"}`))
	if r.StatusCode != http.StatusOK || !r.Close {
		t.Fatalf("while closing: %d, close %v, want Connection: close", r.StatusCode, r.Close)
	}
	waitClosed(t, c, "an answer that announced the close")
	srv.closing.Store(false)
}
