package server

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"golang.org/x/sys/unix"
)

// Attacks on the event loop (poller.go). Each test states the property it
// holds the poller to.

// pollerEnv is a test server with the event loop on and hour-long
// timeouts unless opts says otherwise.
func pollerEnv(t *testing.T, ec envConfig) *env {
	t.Helper()
	if ec.opts.ReadTimeout == 0 {
		ec.opts.ReadTimeout = time.Hour
	}
	if ec.opts.WriteTimeout == 0 {
		ec.opts.WriteTimeout = time.Hour
	}
	return newEnvWith(t, ec)
}

// readAnswers reads n answers from br and checks each with check(i, status, body).
func readAnswers(t *testing.T, br *bufio.Reader, n int, check func(i, status int, body string)) {
	t.Helper()
	for i := range n {
		r, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("answer %d of %d: %v", i, n, err)
		}
		check(i, r.StatusCode, bodyOf(r))
	}
}

// TestPollerPipelinedAlternationExact: a client writes thousands of
// pipelined /lock, /unlock pairs in large writes and reads nothing until
// the server has had to hand the connection over (its answers no longer
// fit the socket); then it reads. Every request is answered exactly once,
// in order: the alternation of acquired / released never breaks, and
// nothing follows the final Connection: close answer.
func TestPollerPipelinedAlternationExact(t *testing.T) {
	e := pollerEnv(t, envConfig{})
	c := e.dial()
	_ = c.SetDeadline(time.Now().Add(kit.Patience))
	lock := rawPost("/lock", smuggleLock)
	unlock := rawPost("/unlock", `{"type":"pull","resource_id":"smuggle","node_id":"a","success":true}`)
	const pairs = 6000
	var sb strings.Builder
	for range pairs {
		sb.WriteString(lock)
		sb.WriteString(unlock)
	}
	sb.WriteString(rawPost("/cancel", smuggleLock, "Connection: close"))
	all := sb.String()
	werr := make(chan error, 1)
	go func() { _, err := io.WriteString(c, all); werr <- err }()
	// The answers of ~12000 requests (> 1 MB) do not fit the socket
	// buffers: the poller must hand the connection over rather than block.
	waitErr(t, "the connection to leave the event loop", func() error {
		if p, g := e.pollerConns(); p != 0 || g != 1 {
			return fmt.Errorf("%d in the event loop, %d goroutines", p, g)
		}
		return nil
	})
	br := bufio.NewReader(c)
	readAnswers(t, br, 2*pairs, func(i, status int, body string) {
		want := `"acquired":true`
		if i%2 == 1 {
			want = `"released":true`
		}
		if status != 200 || !strings.Contains(body, want) {
			t.Fatalf("answer %d: %d %s, want 200 %s", i, status, body, want)
		}
	})
	r, err := http.ReadResponse(br, nil)
	if err != nil || r.StatusCode != 200 || !r.Close {
		t.Fatalf("the closing answer: %v %v", r, err)
	}
	bodyOf(r)
	if rest, err := io.ReadAll(br); err != nil || len(rest) > 0 {
		t.Fatalf("after the last answer: %q %v", rest, err)
	}
	if err := <-werr; err != nil {
		t.Fatal(err)
	}
}

// TestPollerNonReaderDoesNotStallOthers: a client that pipelines and never
// reads must not hold up the other connections of its event loop (on 2
// CPUs there is one): a second client is answered while the first sits
// blocked, and the first is out of the event loop.
func TestPollerNonReaderDoesNotStallOthers(t *testing.T) {
	e := pollerEnv(t, envConfig{})
	hog := e.dial()
	if r := exchange(t, hog, rawPost("/cancel", smuggleLock)); r.StatusCode != 200 {
		t.Fatal(r.StatusCode)
	}
	if !pipelineUntilBlocked(t, hog) {
		t.Fatal("the hog's writes failed before they blocked")
	}
	other := e.dial()
	for range 50 {
		if r := exchange(t, other, rawPost("/cancel", smuggleLock)); r.StatusCode != 200 {
			t.Fatal(r.StatusCode)
		}
	}
	if p, g := e.pollerConns(); p != 1 || g != 1 {
		t.Fatalf("%d in the event loop, %d goroutines; want 1 (other), 1 (the hog)", p, g)
	}
}

// TestPollerByteAtATime: a request sent one byte per write, then pipelined
// requests split across every boundary, are all answered, once, in order.
func TestPollerByteAtATime(t *testing.T) {
	e := pollerEnv(t, envConfig{})
	c := e.dial()
	_ = c.SetDeadline(time.Now().Add(kit.Patience))
	raw := rawPost("/lock", smuggleLock) + rawPost("/unlock", `{"type":"pull","resource_id":"smuggle","node_id":"a","success":true}`)
	raw += raw
	for i := range len(raw) {
		if _, err := c.Write([]byte{raw[i]}); err != nil {
			t.Fatal(err)
		}
	}
	readAnswers(t, bufio.NewReader(c), 4, func(i, status int, body string) {
		want := []string{`"acquired":true`, `"released":true`}[i%2]
		if status != 200 || !strings.Contains(body, want) {
			t.Fatalf("answer %d: %d %s", i, status, body)
		}
	})
}

// TestPollerConnCountExact: dlock_connections_open (Server.conns) counts
// each connection once from accept to close, whichever way it ends: the
// client closes it in the event loop, after a hand-over to the lean loop,
// after a hand-over to net/http, mid-request; the server closes it for
// Connection: close, or for a panic. It ends at 0, never below.
func TestPollerConnCountExact(t *testing.T) {
	e := pollerEnv(t, envConfig{prep: panicOnBoom})
	base := e.srv.conns.Load()
	var cs []net.Conn
	// In the event loop, between requests.
	c := e.dial()
	exchange(t, c, rawPost("/cancel", smuggleLock))
	cs = append(cs, c)
	// Handed to the lean loop: half a request.
	c = e.dial()
	io.WriteString(c, "POST /lock HTTP/1.1\r\nHost: x\r\n")
	cs = append(cs, c)
	// Handed to net/http: a GET.
	c = e.dial()
	exchange(t, c, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
	cs = append(cs, c)
	waitErr(t, "3 connections counted", func() error {
		if n := e.srv.conns.Load() - base; n != 3 {
			return fmt.Errorf("%d", n)
		}
		return nil
	})
	// Closed by the server: Connection: close, and a panic.
	c = e.dial()
	io.WriteString(c, rawPost("/cancel", smuggleLock, "Connection: close"))
	waitClosed(t, c, "Connection: close")
	c = e.dial()
	io.WriteString(c, rawPost("/cancel", `{"type":"pull","resource_id":"boom","node_id":"a"}`))
	waitClosed(t, c, "a panic")
	for _, c := range cs {
		c.Close()
	}
	waitErr(t, "every connection uncounted", func() error {
		if n := e.srv.conns.Load() - base; n != 0 {
			return fmt.Errorf("%d connections counted", n)
		}
		return nil
	})
}

// TestPollerMaxConns: with MaxConns 2, two connections held by the event
// loop fill the server; a third is refused; once one closes, a new one is
// served.
func TestPollerMaxConns(t *testing.T) {
	e := pollerEnv(t, envConfig{opts: Options{MaxConns: 2}})
	a, b := e.dial(), e.dial()
	for _, c := range []net.Conn{a, b} {
		if r := exchange(t, c, rawPost("/cancel", smuggleLock)); r.StatusCode != 200 {
			t.Fatal(r.StatusCode)
		}
	}
	refused := e.dial()
	if r, err := http.ReadResponse(bufio.NewReader(refused), nil); err != nil || r.StatusCode != 503 {
		t.Fatalf("the third connection: %v %v, want 503", r, err)
	}
	a.Close()
	waitErr(t, "the closed connection uncounted", func() error {
		if n := e.srv.conns.Load(); n != 1 {
			return fmt.Errorf("%d", n)
		}
		return nil
	})
	c := e.dial()
	if r := exchange(t, c, rawPost("/cancel", smuggleLock)); r.StatusCode != 200 {
		t.Fatal(r.StatusCode)
	}
}

// TestPollerChurnNoCrossTalk: many clients connect, send a request of
// their own (some whole, some in two writes, so connections keep moving
// out of the event loop while descriptors are reused), read the answer
// and close. Each answer must be its own (the resource it locked) and
// nothing else may arrive.
func TestPollerChurnNoCrossTalk(t *testing.T) {
	e := pollerEnv(t, envConfig{})
	const workers, rounds = 8, 60
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			for i := range rounds {
				res := fmt.Sprintf("r-%d-%d", w, i)
				raw := rawPost("/lock", `{"type":"pull","resource_id":"`+res+`","node_id":"n"}`, "Connection: close")
				c, err := net.Dial("tcp", e.addr())
				if err != nil {
					errs <- err
					return
				}
				_ = c.SetDeadline(time.Now().Add(kit.Patience))
				if i%2 == 0 {
					_, err = io.WriteString(c, raw)
				} else {
					_, err = io.WriteString(c, raw[:len(raw)-5])
					if err == nil {
						_, err = io.WriteString(c, raw[len(raw)-5:])
					}
				}
				if err == nil {
					var all []byte
					all, err = io.ReadAll(c)
					if err == nil && (strings.Count(string(all), "HTTP/1.1 ") != 1 || !strings.Contains(string(all), `"acquired":true`)) {
						err = fmt.Errorf("%s: %q", res, all)
					}
				}
				c.Close()
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	// Each resource is held once, by n: no request ran twice or for
	// another client.
	for w := range workers {
		for i := range rounds {
			res := fmt.Sprintf("r-%d-%d", w, i)
			status, got := e.call("POST", "/lock", `{"type":"pull","resource_id":"`+res+`","node_id":"other"}`)
			if status != 200 || got["acquired"] == true {
				t.Fatalf("%s: %d %v, want held by n", res, status, got)
			}
		}
	}
}

// TestPollerPipelinedAuth: with a token file, every request of a pipelined
// batch the event loop answers in one read is checked on its own.
func TestPollerPipelinedAuth(t *testing.T) {
	ae := newAuthEnv(t, authSetup{tokens: true})
	c := ae.env.dial()
	_ = c.SetDeadline(time.Now().Add(kit.Patience))
	lockA := `{"type":"pull","resource_id":"auth","node_id":"a"}`
	batch := rawPost("/lock", lockA, "Authorization: Bearer "+tokA) +
		rawPost("/lock", lockA) + // no token
		rawPost("/lock", lockA, "Authorization: Bearer "+tokB) + // b acting as a
		rawPost("/unlock", `{"type":"pull","resource_id":"auth","node_id":"a","success":true}`, "Authorization: Bearer "+tokB) +
		rawPost("/unlock", `{"type":"pull","resource_id":"auth","node_id":"a","success":true}`, "Authorization: Bearer "+tokA)
	if _, err := io.WriteString(c, batch); err != nil {
		t.Fatal(err)
	}
	want := []int{200, 401, 403, 403, 200}
	readAnswers(t, bufio.NewReader(c), len(want), func(i, status int, body string) {
		if status != want[i] {
			t.Fatalf("request %d: %d %s, want %d", i, status, body, want[i])
		}
	})
}

// TestPollerNeverTakesTLS: over TLS no connection enters the event loop,
// even with EventLoop set.
func TestPollerNeverTakesTLS(t *testing.T) {
	ae := newAuthEnv(t, authSetup{tokens: true, tls: true})
	if !ae.srv.eventLoop {
		t.Fatal("the test server should have the event loop on")
	}
	cfg := &tls.Config{RootCAs: ae.ca.Pool(), ServerName: "localhost"}
	c, err := tls.Dial("tcp", ae.addr, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(kit.Patience))
	if r := exchange(t, c, rawPost("/lock", `{"type":"pull","resource_id":"t","node_id":"a"}`, "Authorization: Bearer "+tokA)); r.StatusCode != 200 {
		t.Fatal(r.StatusCode)
	}
	ae.srv.mu.Lock()
	n := len(ae.srv.pollers)
	ae.srv.mu.Unlock()
	if p, g := ae.pollerConns(); p != 0 || g != 1 || n != 0 {
		t.Fatalf("%d pollers, %d connections in them, %d goroutines; want 0, 0, 1", n, p, g)
	}
}

// TestPollerShutdownClosesHeld: Shutdown closes the connections the event
// loop holds at once, returns nil well within its context, and leaves none
// counted; the poller goroutine ends (goleak at TestMain).
func TestPollerShutdownClosesHeld(t *testing.T) {
	e := pollerEnv(t, envConfig{})
	var cs []net.Conn
	for range 20 {
		c := e.dial()
		if r := exchange(t, c, rawPost("/cancel", smuggleLock)); r.StatusCode != 200 {
			t.Fatal(r.StatusCode)
		}
		cs = append(cs, c)
	}
	if p, _ := e.pollerConns(); p != 20 {
		t.Fatalf("%d in the event loop, want 20", p)
	}
	ctx, cancel := context.WithTimeout(context.Background(), kit.Patience)
	defer cancel()
	if err := e.srv.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	for _, c := range cs {
		waitClosed(t, c, "a held connection at Shutdown")
	}
	if n := e.srv.conns.Load(); n != 0 {
		t.Fatalf("%d connections counted after Shutdown", n)
	}
}

// TestPollerEpollFailure: when epoll_wait fails (here: its descriptor
// closed under it, EBADF), the event loop closes its connections and the
// server goes on serving new ones with goroutines; the count stays right
// and Close returns.
func TestPollerEpollFailure(t *testing.T) {
	e := pollerEnv(t, envConfig{})
	held := e.dial()
	if r := exchange(t, held, rawPost("/cancel", smuggleLock)); r.StatusCode != 200 {
		t.Fatal(r.StatusCode)
	}
	e.srv.mu.Lock()
	p := e.srv.pollers[0]
	e.srv.mu.Unlock()
	// Replace the epoll descriptor by one epoll_wait refuses (EINVAL: not
	// an epoll descriptor), as dup2 onto it would; closing it outright
	// would let the number be reused by the next socket.
	r, w, err := osPipe()
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(w)
	if err := unix.Dup2(r, p.epfd); err != nil {
		t.Fatal(err)
	}
	unix.Close(r)
	p.wake()
	waitClosed(t, held, "a connection of a failed event loop")
	waitErr(t, "the failed loop's connection uncounted", func() error {
		if n := e.srv.conns.Load(); n != 0 {
			return fmt.Errorf("%d", n)
		}
		return nil
	})
	c := e.dial()
	for range 3 {
		if r := exchange(t, c, rawPost("/cancel", smuggleLock)); r.StatusCode != 200 {
			t.Fatal(r.StatusCode)
		}
	}
	if p, g := e.pollerConns(); p != 0 || g != 1 {
		t.Fatalf("%d in the failed event loop, %d goroutines; want 0, 1", p, g)
	}
}

func osPipe() (r, w int, err error) {
	var fds [2]int
	err = unix.Pipe2(fds[:], unix.O_CLOEXEC)
	return fds[0], fds[1], err
}

// TestPollerHalfRequestReadTimeout: a connection that began a request
// in the event loop must be bounded by the read timeout, not the (long)
// idle timeout.
func TestPollerHalfRequestReadTimeout(t *testing.T) {
	e := pollerEnv(t, envConfig{opts: Options{ReadTimeout: 100 * time.Millisecond}, idle: time.Hour})
	c := e.dial()
	if r := exchange(t, c, rawPost("/cancel", smuggleLock)); r.StatusCode != 200 {
		t.Fatal(r.StatusCode)
	}
	// Half a request, on a connection the event loop holds.
	if _, err := io.WriteString(c, "POST /cancel HTTP/1.1\r\nHost: x\r\nContent-Length: 90\r\n\r\n{"); err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(kit.Patience))
	start := time.Now()
	waitClosed(t, c, "half a request")
	if d := time.Since(start); d > 20*time.Second {
		t.Fatalf("closed after %v", d)
	}
}

// TestPollerPipelinedHandOverToNetHTTP: lean requests then a request for
// net/http then lean requests again, all in one write: net/http gets its
// request with every byte after it, the answers come in order.
func TestPollerPipelinedHandOverToNetHTTP(t *testing.T) {
	e := pollerEnv(t, envConfig{})
	c := e.dial()
	_ = c.SetDeadline(time.Now().Add(kit.Patience))
	raw := rawPost("/lock", smuggleLock) +
		"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" +
		rawPost("/unlock", `{"type":"pull","resource_id":"smuggle","node_id":"a","success":true}`) +
		rawPost("/lock", smuggleLock, "Connection: close")
	if _, err := io.WriteString(c, raw); err != nil {
		t.Fatal(err)
	}
	want := []string{`"acquired":true`, ``, `"released":true`, `"acquired":true`}
	br := bufio.NewReader(c)
	readAnswers(t, br, len(want), func(i, status int, body string) {
		if status != 200 || !strings.Contains(body, want[i]) {
			t.Fatalf("answer %d: %d %s, want %s", i, status, body, want[i])
		}
	})
	if rest, _ := io.ReadAll(br); len(rest) > 0 {
		t.Fatalf("after the last answer: %q", rest)
	}
}

// waitErr is kit.WaitFor with the reason a condition does not hold yet.
func waitErr(t *testing.T, what string, cond func() error) {
	t.Helper()
	var last error
	kit.WaitFor(t, what, func() bool { last = cond(); return last == nil })
	_ = last
}
