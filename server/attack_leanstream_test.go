package server

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/internal/auth"
	"github.com/dlock/dlock/internal/auth/authtest"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/lock"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"
)

// Attacks on the /subscribe streams the lean loop and the event loop open
// themselves (leanStream, poller.openStream, hub.startFD).

// leanOnly makes a test fail if net/http serves a GET of /subscribe: the
// requests of these tests are the lean loop's.
func leanOnly(t *testing.T) func(*Server) {
	return func(s *Server) {
		s.routes["/subscribe"].h = func(w http.ResponseWriter, r *http.Request) error {
			t.Errorf("net/http served %s", r.RequestURI)
			return s.handleSubscribe(w, r)
		}
	}
}

// tokenEnv is a server with the token file of auth_test.go, on one loop,
// whose /subscribe net/http must not serve; it returns the env and the
// path of the token file.
func tokenEnv(t *testing.T, goroutines bool) (*env, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "tokens")
	authtest.WriteFile(t, path, []byte(tokenFile))
	tk, err := auth.LoadTokens(path)
	if err != nil {
		t.Fatal(err)
	}
	return newEnvWith(t, envConfig{goroutines: goroutines, opts: Options{Tokens: tk}, prep: leanOnly(t)}), path
}

// rawAnswer is one answer read off a raw connection.
type rawAnswer struct {
	status int
	header http.Header
	body   string
	close  bool // Connection: close
}

func (a rawAnswer) code() string {
	var b struct{ Code string }
	_ = json.Unmarshal([]byte(a.body), &b)
	return b.Code
}

// streamExchange sends raw on a new connection and reads one answer; of a
// 200 (a stream) only the head is read. The connection is returned open.
func streamExchange(t *testing.T, e *env, raw string) (rawAnswer, net.Conn, *bufio.Reader) {
	t.Helper()
	c := e.dial()
	if _, err := io.WriteString(c, raw); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	r, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("%q: %v", raw, err)
	}
	a := rawAnswer{status: r.StatusCode, header: r.Header, close: r.Close}
	if r.StatusCode != 200 {
		a.body = bodyOf(r)
	}
	return a, c, br
}

// subscribeRaw is a GET of path as the lean loop takes it: no
// Content-Length; headers are extra lines.
func subscribeRaw(path string, headers ...string) string {
	var b strings.Builder
	b.WriteString("GET " + path + " HTTP/1.1\r\nHost: x\r\n")
	for _, h := range headers {
		b.WriteString(h + "\r\n")
	}
	b.WriteString("\r\n")
	return b.String()
}

// baseline waits until the server counts no connection and no stream.
func (e *env) baseline(what string) {
	e.t.Helper()
	kit.WaitFor(e.t, what+": no connection counted", func() bool { return e.srv.conns.Load() == 0 })
	kit.WaitFor(e.t, what+": no stream counted", func() bool {
		all, _ := e.polled()
		return all == 0 && testutil.ToFloat64(e.srv.metrics.streams) == 0
	})
}

// noObserverSlots fails the test if any credential holds an observer slot.
func (e *env) noObserverSlots() {
	e.t.Helper()
	e.srv.obsMu.Lock()
	defer e.srv.obsMu.Unlock()
	if len(e.srv.observers) != 0 {
		e.t.Fatalf("observer slots held: %v", e.srv.observers)
	}
}

// TestAttackLeanStreamAuthMatchesNetHTTP: with tokens, a /subscribe the
// lean loop (or the event loop) opens itself is refused exactly as the
// same request net/http serves (/lock/subscribe): no token, an unknown
// one, Basic credentials, another node's session, and a node's observer
// past MaxObserversPerCredential, with the same status, code,
// WWW-Authenticate and Retry-After; and what it allows, it allows.
// Every connection and stream is given back once the clients leave.
func TestAttackLeanStreamAuthMatchesNetHTTP(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) {
			e, _ := tokenEnv(t, l.goroutines)
			cases := []struct {
				name    string
				query   string
				headers []string
				status  int
			}{
				{"no token", "?node_id=a", nil, 401},
				{"unknown token", "?node_id=a", []string{"Authorization: Bearer not-a-token-of-this-server"}, 401},
				{"empty bearer", "?node_id=a", []string{"Authorization: Bearer "}, 401},
				{"basic", "?node_id=a", []string{basicAuth("a", tokA)}, 401},
				{"another node", "?node_id=b", []string{"Authorization: Bearer " + tokA}, 403},
				{"another node, escaped", "?node_id=%62", []string{"Authorization: Bearer " + tokA}, 403},
				{"another node after own", "?node_id=a&node_id=b", []string{"Authorization: Bearer " + tokA}, 200},
				{"bad key", "?type=pull&resource_id=", []string{"Authorization: Bearer " + tokA}, 400},
				{"no node, no key", "?node_id=", []string{"Authorization: Bearer " + tokA}, 400},
				{"own node", "?node_id=a", []string{"Authorization: Bearer " + tokA}, 200},
				{"operator as b", "?node_id=b", []string{"Authorization: Bearer " + tokOp}, 200},
			}
			for _, c := range cases {
				lean, lc, _ := streamExchange(t, e, subscribeRaw("/subscribe"+c.query, c.headers...))
				nh, nc, _ := streamExchange(t, e, subscribeRaw("/lock/subscribe"+c.query, c.headers...))
				lc.Close()
				nc.Close()
				if lean.status != c.status || nh.status != c.status {
					t.Fatalf("%s: lean %d %s, net/http %d %s; want %d", c.name, lean.status, lean.body, nh.status, nh.body, c.status)
				}
				for _, h := range []string{"WWW-Authenticate", "Retry-After", "Content-Type", api.EpochHeader} {
					if fmt.Sprint(lean.header.Values(h)) != fmt.Sprint(nh.header.Values(h)) {
						t.Fatalf("%s: %s: lean %q, net/http %q", c.name, h, lean.header.Values(h), nh.header.Values(h))
					}
				}
				if lean.status == 401 && lean.header.Get("WWW-Authenticate") == "" {
					t.Fatalf("%s: a 401 without WWW-Authenticate", c.name)
				}
				if lean.body != nh.body {
					t.Fatalf("%s: lean body %s, net/http %s", c.name, lean.body, nh.body)
				}
			}
			e.baseline("after the refusals")

			// Observers: the lean loop's count against the limit as
			// net/http's do.
			var open []net.Conn
			for i := range MaxObserversPerCredential {
				path := "?type=pull&resource_id=r" + strconv.Itoa(i)
				route := "/subscribe"
				if i%2 == 1 {
					route = "/lock/subscribe"
				}
				a, c, _ := streamExchange(t, e, subscribeRaw(route+path, "Authorization: Bearer "+tokA))
				if a.status != 200 {
					t.Fatalf("observer %d: %d %s", i, a.status, a.body)
				}
				open = append(open, c)
			}
			for _, route := range []string{"/subscribe", "/lock/subscribe"} {
				a, c, _ := streamExchange(t, e, subscribeRaw(route+"?type=pull&resource_id=more", "Authorization: Bearer "+tokA))
				c.Close()
				if a.status != http.StatusTooManyRequests || a.header.Get("Retry-After") == "" {
					t.Fatalf("%s: observer %d of one node: %d %v %s, want 429 with Retry-After", route, MaxObserversPerCredential+1, a.status, a.header, a.body)
				}
			}
			// The lean loop's observer gives its place back when its
			// client leaves.
			open[0].Close()
			kit.WaitFor(t, "a's closed lean observer to free its place", func() bool {
				e.srv.obsMu.Lock()
				defer e.srv.obsMu.Unlock()
				return e.srv.observers["a"] == MaxObserversPerCredential-1
			})
			a, c, _ := streamExchange(t, e, subscribeRaw("/subscribe?type=pull&resource_id=again", "Authorization: Bearer "+tokA))
			if a.status != 200 {
				t.Fatalf("after one observer left: %d %s", a.status, a.body)
			}
			c.Close()
			for _, c := range open {
				c.Close()
			}
			e.baseline("after the observers left")
			e.srv.obsMu.Lock()
			left := len(e.srv.observers)
			e.srv.obsMu.Unlock()
			if left != 0 {
				t.Fatalf("observer slots still held: %v", e.srv.observers)
			}
		})
	}
}

// TestAttackLeanStreamRevokedTokenEnds: a reload that removes a token ends
// a stream the lean loop or the event loop opened with it (the latter a
// bare socket in the hub's poll set), the removed token opens no new one,
// and the connections are given back.
func TestAttackLeanStreamRevokedTokenEnds(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) {
			e, path := tokenEnv(t, l.goroutines)
			sa, ca, bra := streamExchange(t, e, subscribeRaw("/subscribe?node_id=a", "Authorization: Bearer "+tokA))
			so, co, bro := streamExchange(t, e, subscribeRaw("/subscribe?type=pull&resource_id=r", "Authorization: Bearer "+tokA))
			sb, cb, brb := streamExchange(t, e, subscribeRaw("/subscribe?node_id=b", "Authorization: Bearer "+tokB))
			if sa.status != 200 || so.status != 200 || sb.status != 200 {
				t.Fatalf("streams: %d %d %d", sa.status, so.status, sb.status)
			}
			e.waitStreams(3)
			authtest.WriteFile(t, path, []byte(tokB+" b\n"))
			if err := e.srv.Reload(); err != nil {
				t.Fatal(err)
			}
			for _, s := range []struct {
				c  net.Conn
				br *bufio.Reader
			}{{ca, bra}, {co, bro}} {
				if _, err := io.Copy(io.Discard, s.br); err != nil {
					t.Fatalf("a stream of a removed token: %v (it goes on)", err)
				}
				s.c.Close()
			}
			if n := testutil.ToFloat64(e.srv.am.revokedStreams); n != 2 {
				t.Fatalf("dlock_auth_revoked_streams_total %v, want 2", n)
			}
			if a, c, _ := streamExchange(t, e, subscribeRaw("/subscribe?node_id=a", "Authorization: Bearer "+tokA)); a.status != 401 || a.header.Get("WWW-Authenticate") == "" {
				t.Fatalf("a removed token: %d %v", a.status, a.header)
			} else {
				c.Close()
			}
			// b's stream goes on.
			e.grant("b", "after-reload")
			l := readEvents(brb)
			l.waitData(t, "after-reload")
			cb.Close()
			e.baseline("after the streams ended")
		})
	}
}

// TestAttackLeanStreamConnsBaseline: hostile clients of the streams the
// lean loop and the event loop open: one that closes right after its GET,
// or resets; a refused GET with Connection: close; a refused one the
// client never reads; requests pipelined after a GET that opens (dropped
// unserved, as net/http drops them) or is refused (served); half a GET
// head (the read timeout ends it); MaxConns with streams open; and
// subscribes while the server drains. After each, the server counts no
// connection and no stream.
func TestAttackLeanStreamConnsBaseline(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) {
			e := newEnvWith(t, envConfig{goroutines: l.goroutines, prep: leanOnly(t), opts: Options{ReadTimeout: 300 * time.Millisecond, MaxConns: 3}})
			lockX := `{"type":"pull","resource_id":"x","node_id":"p"}`

			// A GET, and the client gone at once.
			for _, reset := range []bool{false, true} {
				c := e.dial()
				io.WriteString(c, subscribeRaw("/subscribe?node_id=gone"))
				if reset {
					_ = c.(*net.TCPConn).SetLinger(0)
				}
				c.Close()
				e.baseline(fmt.Sprintf("a client gone right after its GET (reset %v)", reset))
			}

			// Refused with Connection: close: answered, then closed.
			a, c, br := streamExchange(t, e, subscribeRaw("/subscribe?node_id=", "Connection: close")+rawPost("/lock", lockX))
			if a.status != 400 || !a.close {
				t.Fatalf("refused with Connection: close: %d %v", a.status, a.header)
			}
			if n, err := io.Copy(io.Discard, br); err != nil || n != 0 {
				t.Fatalf("after Connection: close: %d bytes more, %v", n, err)
			}
			c.Close()
			if st := e.m.Stats(); st.Held != 0 {
				t.Fatalf("the request after a Connection: close was served: %+v", st)
			}
			e.baseline("a refused GET with Connection: close")

			// Refused, never read: the client leaves.
			c = e.dial()
			io.WriteString(c, subscribeRaw("/subscribe?type=pull&resource_id="))
			c.Close()
			e.baseline("a refused GET never read")

			// Pipelined after a GET that opens: not served.
			a, c, br = streamExchange(t, e, subscribeRaw("/subscribe?node_id=p")+rawPost("/lock", lockX)+rawPost("/lock", lockX))
			if a.status != 200 {
				t.Fatalf("the stream: %d %s", a.status, a.body)
			}
			evs := readEvents(br)
			evs.waitData(t, `"subscribed"`)
			if st := e.m.Stats(); st.Held != 0 {
				t.Fatalf("a request pipelined after a stream's GET was served: %+v", st)
			}
			c.Close()
			e.baseline("a stream with requests pipelined after its GET")

			// Pipelined after a GET refused: served, in order.
			c = e.dial()
			io.WriteString(c, subscribeRaw("/subscribe?node_id=")+rawPost("/lock", `{"type":"pull","resource_id":"y","node_id":"p"}`)+subscribeRaw("/subscribe?node_id=p"))
			br = bufio.NewReader(c)
			readAnswers(t, br, 2, func(i, status int, body string) {
				if want := []int{400, 200}[i]; status != want {
					t.Fatalf("answer %d: %d %s, want %d", i, status, body, want)
				}
			})
			if r, err := http.ReadResponse(br, nil); err != nil || r.StatusCode != 200 {
				t.Fatalf("the stream after a refused GET and a /lock: %v %v", r, err)
			}
			c.Close()
			e.baseline("a stream after a refused GET and a /lock")

			// Half a GET head: the read timeout closes it.
			c = e.dial()
			io.WriteString(c, "GET /subscribe?node_id=slow HTTP/1.1\r\nHost: x\r\n")
			waitClosed(t, c, "half a GET head")
			c.Close()
			e.baseline("half a GET head")

			// MaxConns counts streams; a stream's leaving frees its place.
			var streams []net.Conn
			for i := range 3 {
				a, c, _ := streamExchange(t, e, subscribeRaw("/subscribe?node_id=m"+strconv.Itoa(i)))
				if a.status != 200 {
					t.Fatalf("stream %d: %d %s", i, a.status, a.body)
				}
				streams = append(streams, c)
			}
			if a, c, _ := streamExchange(t, e, subscribeRaw("/subscribe?node_id=over")); a.status != http.StatusServiceUnavailable || a.code() != api.CodeOverloaded {
				t.Fatalf("a connection past MaxConns: %d %s", a.status, a.body)
			} else {
				c.Close()
			}
			streams[0].Close()
			kit.WaitFor(t, "the closed stream's place freed", func() bool { return e.srv.conns.Load() == 2 })
			a, c, _ = streamExchange(t, e, subscribeRaw("/subscribe?node_id=again"))
			if a.status != 200 {
				t.Fatalf("a stream after one left: %d %s", a.status, a.body)
			}
			streams = append(streams[1:], c)

			// Drain ends them; a GET while draining is answered 503, as
			// net/http answers it, and the connection goes on.
			e.srv.Drain()
			for _, c := range streams {
				waitClosed(t, c, "a stream at Drain")
				c.Close()
			}
			e.baseline("streams ended by Drain")
			for _, route := range []string{"/subscribe", "/lock/subscribe"} {
				c := e.dial()
				io.WriteString(c, subscribeRaw(route+"?node_id=late")+rawPost("/lock", `{"type":"pull","resource_id":"`+route+`","node_id":"p"}`))
				readAnswers(t, bufio.NewReader(c), 2, func(i, status int, body string) {
					if want := []int{503, 200}[i]; status != want {
						t.Fatalf("%s while draining, answer %d: %d %s, want %d", route, i, status, body, want)
					}
				})
				c.Close()
			}
			e.baseline("GETs while draining")
		})
	}
}

// TestAttackHandOverKeepsAcceptedKeepalive: a connection the event loop
// hands to the lean loop keeps the keepalive it was accepted with, on a
// listener Serve is given that is not Listen's (net.Listen, as httptest
// and dlocktest use): Go's accept turned keepalive on for the socket, the
// listening socket itself has none, and the hand-over must not copy
// "none" onto the connection.
func TestAttackHandOverKeepsAcceptedKeepalive(t *testing.T) {
	e := pollerEnv(t, envConfig{})
	c := e.dial()
	if _, err := io.WriteString(c, rawPost("/lock", smuggleLock)); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	readAnswers(t, br, 1, func(_, status int, body string) {
		if status != 200 {
			t.Fatalf("%d %s", status, body)
		}
	})
	var before [4]int
	found := false
	e.srv.mu.Lock()
	for _, p := range e.srv.pollers {
		p.mu.Lock()
		for _, pc := range p.conns {
			if pc != nil {
				before, found = keepalive(t, pc.fd), true
			}
		}
		p.mu.Unlock()
	}
	e.srv.mu.Unlock()
	if !found {
		t.Fatal("the connection is not in the event loop")
	}
	if before[0] == 0 {
		t.Fatalf("accepted without keepalive: %v (the test assumes Go's accept sets it)", before)
	}
	if after := handedOverKeepalive(t, e, c); after != before {
		t.Fatalf("keepalive (on, idle s, interval s, count) %v after the hand-over, %v before", after, before)
	}
}

// goroutineWaitingIn reports whether a goroutine waits for a
// sync.Mutex with fn in its stack.
func goroutineWaitingIn(fn string) bool {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	for _, g := range strings.Split(string(buf), "\n\n") {
		head, _, _ := strings.Cut(g, "\n")
		if strings.Contains(head, "[sync.Mutex.Lock") && strings.Contains(g, fn) {
			return true
		}
	}
	return false
}

// goroutineIn reports whether a goroutine has fn in its stack.
func goroutineIn(fn string) bool {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return strings.Contains(string(buf[:n]), fn)
		}
		buf = make([]byte, 2*len(buf))
	}
}

// TestAttackHubStartFDRefusedThenRevoked: startFD that returns nil gives
// the socket back to its caller, which closes it (takeStream) and whose
// number a new connection may get at once. A revocation of the stream's
// credential that fired while startFD ran must not reach that socket
// after: here the hub is drained (startFD refuses), the credential is
// revoked while startFD waits for the hub's lock, and the revocation's
// shut runs after startFD has returned nil. It shut the socket down,
// both ways: had the caller closed it and a new connection got its
// number, that connection would have been cut.
func TestAttackHubStartFDRefusedThenRevoked(t *testing.T) {
	e := newEnv(t, nil)
	h := e.srv.hub
	client, server := tcpPair(t)
	fd, ok := dupFD(server.(*net.TCPConn))
	if !ok {
		t.Fatal("no duplicate")
	}
	server.Close()
	defer unix.Close(fd)
	h.stop() // drained: startFD refuses
	revoked, revoke := context.WithCancel(context.Background())
	defer revoke()
	ret := make(chan *hubStream, 1)
	h.mu.Lock()
	go func() { ret <- h.startFD(fd, newFakeFeed().source(), nil, revoked, nil) }()
	kit.WaitFor(t, "startFD waiting for the hub's lock", func() bool { return goroutineWaitingIn("server.(*hub).startOn(") })
	revoke()
	kit.WaitFor(t, "the revocation's shut waiting for the hub's lock", func() bool { return goroutineWaitingIn("server.(*hubStream).shut(") })
	h.mu.Unlock() // startFD has it first: it waited first
	if st := <-ret; st != nil {
		t.Fatal("a drained hub took a stream")
	}
	kit.WaitFor(t, "the revocation's shut to return", func() bool { return !goroutineIn("server.(*hubStream).shut(") })
	// The socket is the caller's again, as startFD gave it back.
	var b [1]byte
	if n, _, err := unix.Recvfrom(fd, b[:], unix.MSG_DONTWAIT); err != unix.EAGAIN {
		t.Fatalf("the socket startFD gave back was shut down after it returned (read: %d, %v): a revocation reached a descriptor the hub no longer owned", n, err)
	}
	// Nor its peer's view of it: what the peer sends arrives.
	if _, err := io.WriteString(client, "x"); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, "the peer's byte", func() bool {
		n, _, err := unix.Recvfrom(fd, b[:], unix.MSG_DONTWAIT)
		return n == 1 && err == nil
	})
}

// TestAttackLeanStreamFallbackAccounting: once the hub's poll set has
// failed, the streams the lean loop and the event loop open get a
// connection and a reader each (the event loop's bare socket through
// dupConn); a revocation and a client's leaving still end them, and their
// connections, counts and descriptors are all given back.
func TestAttackLeanStreamFallbackAccounting(t *testing.T) {
	fail := failableEpollWait(t)
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) {
			fail.Store(false)
			e, path := tokenEnv(t, l.goroutines)
			a, c, _ := streamExchange(t, e, subscribeRaw("/subscribe?node_id=a", "Authorization: Bearer "+tokA))
			if a.status != 200 {
				t.Fatalf("%d %s", a.status, a.body)
			}
			if _, p := e.polled(); p != 1 {
				t.Fatal("the first stream is not in the poll set")
			}
			fail.Store(true)
			h := e.srv.hub
			h.mu.Lock()
			h.poll.wake()
			h.mu.Unlock()
			waitClosed(t, c, "a stream when the poll set failed")
			c.Close()
			e.baseline("the poll set failed")
			fds := openFDs(t)

			sa, ca, _ := streamExchange(t, e, subscribeRaw("/subscribe?node_id=a", "Authorization: Bearer "+tokA))
			sb, cb, brb := streamExchange(t, e, subscribeRaw("/subscribe?node_id=b", "Authorization: Bearer "+tokB))
			if sa.status != 200 || sb.status != 200 {
				t.Fatalf("streams after the failure: %d %d", sa.status, sb.status)
			}
			e.waitStreams(2)
			if _, p := e.polled(); p != 0 {
				t.Fatal("a stream opened after the failure was polled")
			}
			kit.WaitFor(t, "a reader for each stream", func() bool { return readers() == 2 })
			if n := e.srv.conns.Load(); n != 2 {
				t.Fatalf("%d connections counted for two streams", n)
			}
			authtest.WriteFile(t, path, []byte(tokB+" b\n"))
			if err := e.srv.Reload(); err != nil {
				t.Fatal(err)
			}
			waitClosed(t, ca, "a's stream, its token removed")
			ca.Close()
			e.waitStreams(1)
			e.grant("b", "still")
			readEvents(brb).waitData(t, "still")
			cb.Close()
			e.baseline("the streams after the failure ended")
			kit.Await(t, "the descriptors given back", func() error {
				if got := openFDs(t); got != fds {
					return fmt.Errorf("%d descriptors open, %d before", got, fds)
				}
				return nil
			})
		})
	}
}

// TestAttackLeanStreamOpenRacesDrain: Drain while a stream the lean loop or
// the event loop opens waits for its observer slot, before the hub admits
// it: answered 503, and the connection serves what follows; its slot and
// count are given back.
func TestAttackLeanStreamOpenRacesDrain(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name+"/before admit", func(t *testing.T) {
			e, _ := tokenEnv(t, l.goroutines)
			c := e.dial()
			e.srv.obsMu.Lock()
			io.WriteString(c, subscribeRaw("/subscribe?type=pull&resource_id=r", "Authorization: Bearer "+tokA)+
				rawPost("/lock", `{"type":"pull","resource_id":"r","node_id":"a"}`, "Authorization: Bearer "+tokA))
			kit.WaitFor(t, "the stream waiting for its observer slot", func() bool { return goroutineWaitingIn("server.(*Server).observerSlot(") })
			e.srv.Drain()
			e.srv.obsMu.Unlock()
			readAnswers(t, bufio.NewReader(c), 2, func(i, status int, body string) {
				if want := []int{503, 200}[i]; status != want {
					t.Fatalf("answer %d: %d %s, want %d", i, status, body, want)
				}
			})
			c.Close()
			e.baseline("a stream refused by Drain")
			e.noObserverSlots()
		})
		t.Run(l.name+"/shutdown", func(t *testing.T) {
			e, _ := tokenEnv(t, l.goroutines)
			c := e.dial()
			e.srv.obsMu.Lock()
			io.WriteString(c, subscribeRaw("/subscribe?type=pull&resource_id=r", "Authorization: Bearer "+tokA))
			kit.WaitFor(t, "the stream waiting for its observer slot", func() bool { return goroutineWaitingIn("server.(*Server).observerSlot(") })
			ctx, cancel := context.WithTimeout(context.Background(), kit.Patience)
			defer cancel()
			shut := make(chan error, 1)
			go func() { shut <- e.srv.Shutdown(ctx) }()
			h := e.srv.hub
			kit.WaitFor(t, "Shutdown to drain and close", func() bool {
				h.mu.Lock()
				defer h.mu.Unlock()
				return h.stopped && e.srv.closing.Load()
			})
			e.srv.obsMu.Unlock()
			br := bufio.NewReader(c)
			r, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("a stream opening at Shutdown is not answered: %v", err)
			}
			if body := bodyOf(r); r.StatusCode != 503 || !r.Close {
				t.Fatalf("a stream opening at Shutdown: %d close=%v %s, want 503 and Connection: close", r.StatusCode, r.Close, body)
			}
			c.Close()
			if err := <-shut; err != nil {
				t.Fatalf("Shutdown: %v", err)
			}
			e.baseline("a stream refused at Shutdown")
		})
	}
}

// closeCounted is a source whose close is counted.
type closeCounted struct {
	source
	closed *atomic.Int32
}

func (c closeCounted) close() { c.closed.Add(1); c.source.close() }

// TestAttackTakeStreamRefusedGivesBack: an event loop's bare socket whose
// stream the hub refuses (drained after the stream was admitted) is
// closed unanswered, as net/http's hijacked connection is, and gives back
// its count in Server.conns, the stream's gauge, its source and Drain's
// wait.
func TestAttackTakeStreamRefusedGivesBack(t *testing.T) {
	e := newEnv(t, nil)
	client, server := tcpPair(t)
	fd, ok := dupFD(server.(*net.TCPConn))
	if !ok {
		t.Fatal("no duplicate")
	}
	server.Close()
	e.srv.conns.Add(1) // the socket's count, which an event loop's carries
	if !e.srv.hub.admit() {
		t.Fatal("not admitted")
	}
	e.srv.metrics.streams.Inc()
	e.srv.hub.stop()
	var closed atomic.Int32
	e.srv.takeStream(context.Background(), streamConn{fd: fd}, []byte("HTTP/1.1 200 OK\r\n\r\n"), closeCounted{newFakeFeed().source(), &closed})
	if n := e.srv.conns.Load(); n != 0 {
		t.Fatalf("%d connections counted after the refusal", n)
	}
	if n := testutil.ToFloat64(e.srv.metrics.streams); n != 0 {
		t.Fatalf("stream gauge %v after the refusal", n)
	}
	if n := closed.Load(); n != 1 {
		t.Fatalf("the source closed %d times", n)
	}
	if b, err := io.ReadAll(client); len(b) != 0 || err != nil {
		t.Fatalf("the client read %q, %v: want the close alone", b, err)
	}
	done := make(chan struct{})
	go func() { e.srv.Drain(); close(done) }()
	select {
	case <-done:
	case <-time.After(kit.Patience):
		t.Fatal("Drain waits for a stream the hub refused")
	}
}

// leanMTLSEnv is newAuthEnv's mTLS server (client certificates of a, b, c
// and the operator) whose /subscribe net/http must not serve.
func leanMTLSEnv(t *testing.T) *authEnv {
	t.Helper()
	ae := &authEnv{t: t, dir: t.TempDir(), tls: true}
	ae.ca = authtest.NewCA(t, "dlock test CA")
	ae.certFile, ae.keyFile = ae.ca.Server(t).Write(t, ae.dir, "server")
	ae.caFile = filepath.Join(ae.dir, "ca.crt")
	authtest.WriteFile(t, ae.caFile, ae.ca.PEM)
	c, err := auth.LoadCerts(ae.certFile, ae.keyFile, ae.caFile)
	if err != nil {
		t.Fatal(err)
	}
	ae.certs = map[string]tls.Certificate{}
	for _, n := range []string{"a", "b", "c", "*"} {
		ae.certs[n] = ae.ca.Node(t, n, n).TLS(t)
	}
	ae.env = newEnvWith(t, envConfig{opts: Options{TLS: c}, prep: leanOnly(t)})
	ae.addr = ae.env.addr()
	return ae
}

// TestAttackLeanStreamMTLS: over TLS with client certificates the lean
// loop opens /subscribe itself: no certificate is refused 401 with its
// challenge, another node's session 403, its own opens; and rotating the
// client CA away from the certificate ends the stream it opened, as it
// ends net/http's (TestAuthDroppedCAEndsStreams).
func TestAttackLeanStreamMTLS(t *testing.T) {
	ae := leanMTLSEnv(t)
	ask := func(w who, path string) (int, http.Header, *conn) {
		t.Helper()
		c := ae.dial(w)
		if _, err := io.WriteString(c.c, subscribeRaw(path)); err != nil {
			t.Fatal(err)
		}
		r, err := http.ReadResponse(c.br, nil)
		if err != nil {
			t.Fatal(err)
		}
		return r.StatusCode, r.Header, c
	}
	if st, h, c := ask(who{}, "/subscribe?node_id=a"); st != 401 || h.Get("WWW-Authenticate") == "" {
		t.Fatalf("no certificate: %d %v", st, h)
	} else {
		c.c.Close()
	}
	if st, _, c := ask(who{cert: "a"}, "/subscribe?node_id=b"); st != 403 {
		t.Fatalf("a as b: %d", st)
	} else {
		c.c.Close()
	}
	st, _, c := ask(who{cert: "a"}, "/subscribe?node_id=a")
	if st != 200 {
		t.Fatalf("a as a: %d", st)
	}
	evs := readEvents(c.br)
	evs.waitData(t, `"subscribed"`)
	ca2 := authtest.NewCA(t, "second CA")
	authtest.WriteFile(t, ae.caFile, ca2.PEM)
	if err := ae.srv.Reload(); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, "the stream of a dropped CA's certificate to end", func() bool {
		select {
		case <-evs.done:
			return true
		default:
			return false
		}
	})
	if te, ok := evs.err.(interface{ Timeout() bool }); ok && te.Timeout() {
		t.Fatal("the stream did not end: its read timed out")
	}
	c.c.Close()
	ae.baseline("the TLS stream ended")
}

// boomBackend panics subscribing node "boom", or observing resource "boom".
type boomBackend struct{ lock.Backend }

func (b boomBackend) Subscribe(ctx context.Context, req lock.SubscribeRequest) (lock.Stream, lock.Subscription, error) {
	if req.Node == "boom" || (req.Observe != nil && req.Observe.Resource == "boom") {
		panic("attack: Subscribe panics")
	}
	return b.Backend.Subscribe(ctx, req)
}

// TestAttackLeanStreamPanicAnswered: a panic opening a stream the lean
// loop or the event loop (openStream's goroutine) opens is answered 500
// with Connection: close, the connection then closes, nothing stays
// counted, and the next stream opens.
func TestAttackLeanStreamPanicAnswered(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) {
			e := newEnvWith(t, envConfig{goroutines: l.goroutines, prep: func(s *Server) {
				leanOnly(t)(s)
				s.b = boomBackend{s.b}
			}})
			a, c, br := streamExchange(t, e, subscribeRaw("/subscribe?node_id=boom")+rawPost("/lock", `{"type":"pull","resource_id":"boom","node_id":"p"}`))
			if a.status != 500 || !a.close {
				t.Fatalf("a panic opening a stream: %d close=%v %s", a.status, a.close, a.body)
			}
			if n, err := io.Copy(io.Discard, br); n != 0 || err != nil {
				t.Fatalf("after the 500: %d bytes, %v", n, err)
			}
			c.Close()
			if st := e.m.Stats(); st.Held != 0 {
				t.Fatalf("the request after the panic was served: %+v", st)
			}
			if n := testutil.ToFloat64(e.srv.metrics.panics); n != 1 {
				t.Fatalf("panics counted: %v", n)
			}
			e.baseline("after the panic")
			a, c, _ = streamExchange(t, e, subscribeRaw("/subscribe?node_id=ok"))
			if a.status != 200 {
				t.Fatalf("the next stream: %d %s", a.status, a.body)
			}
			c.Close()
			e.baseline("after the next stream")
		})
	}
}

// TestAttackLeanStreamRevokedWhileOpening: a token removed after the
// request was identified and before its stream is in the hub (here while
// the observer waits for its slot) does not keep a stream: it ends at
// once, counted as revoked, and gives its slot and connection back.
func TestAttackLeanStreamRevokedWhileOpening(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) {
			e, path := tokenEnv(t, l.goroutines)
			c := e.dial()
			e.srv.obsMu.Lock()
			io.WriteString(c, subscribeRaw("/subscribe?type=pull&resource_id=r", "Authorization: Bearer "+tokA))
			kit.WaitFor(t, "the stream waiting for its observer slot", func() bool { return goroutineWaitingIn("server.(*Server).observerSlot(") })
			authtest.WriteFile(t, path, []byte(tokB+" b\n"))
			err := e.srv.Reload()
			e.srv.obsMu.Unlock()
			if err != nil {
				t.Fatal(err)
			}
			// Refused (401), or opened and ended at once; an end before
			// the answer's head is a close without an answer.
			r, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err == nil && r.StatusCode != 200 && r.StatusCode != 401 {
				t.Fatalf("%d %s", r.StatusCode, bodyOf(r))
			}
			if err == nil && r.StatusCode == 200 {
				_, err = io.Copy(io.Discard, r.Body)
			}
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				t.Fatal("the stream of a token removed while it opened goes on")
			}
			if refused := err == nil && r.StatusCode == 401; !refused {
				if n := testutil.ToFloat64(e.srv.am.revokedStreams); n != 1 {
					t.Fatalf("dlock_auth_revoked_streams_total %v, want 1", n)
				}
			}
			c.Close()
			e.baseline("a stream whose token was removed while it opened")
			e.noObserverSlots()
		})
	}
}

// notifyBoom is a stream whose Notify panics: after the hub has taken
// the stream's connection (startOn calls it last).
type notifyBoom struct{ lock.Stream }

func (notifyBoom) Notify(func()) { panic("attack: Notify panics") }

// notifyBoomBackend's stream of node "notify-boom" is a notifyBoom.
type notifyBoomBackend struct{ lock.Backend }

func (b notifyBoomBackend) Subscribe(ctx context.Context, req lock.SubscribeRequest) (lock.Stream, lock.Subscription, error) {
	st, sub, err := b.Backend.Subscribe(ctx, req)
	if err == nil && req.Node == "notify-boom" {
		st = notifyBoom{st}
	}
	return st, sub, err
}

// TestAttackLeanStreamPanicAfterHubTook: a panic opening a stream after
// the hub took its connection (here in the feed's Notify, which startOn
// calls once the stream is in the hub). The connection is the hub's
// then: the panic's recovery must not answer on it, close it or hand it
// over. On the event loop openStream's recovery hands pc.fd, which the
// hub's poll set and writers hold, to the lean loop, which closes it (a
// number the hub then writes its pings to, reads and closes again, as
// another connection's once reused); on the lean loop serveLean's
// recovery closes the connection whose count the hub carries. Either
// way the count of open connections ends below zero once the client and
// the stream are gone.
func TestAttackLeanStreamPanicAfterHubTook(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) {
			e := newEnvWith(t, envConfig{goroutines: l.goroutines, prep: func(s *Server) {
				leanOnly(t)(s)
				s.b = notifyBoomBackend{s.b}
			}})
			t.Cleanup(func() {
				// A stream the failure left in the hub ends without
				// touching its descriptor, which is not its own, so that
				// Drain returns.
				h := e.srv.hub
				h.mu.Lock()
				var left []*hubStream
				for st := range h.all {
					st.fdClosed = true
					left = append(left, st)
				}
				h.mu.Unlock()
				for _, st := range left {
					st.end()
				}
			})
			c := e.dial()
			io.WriteString(c, subscribeRaw("/subscribe?node_id=notify-boom"))
			kit.WaitFor(t, "the panic", func() bool { return testutil.ToFloat64(e.srv.metrics.panics) == 1 })
			// What the client reads is garbled either way; it leaves.
			_ = c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
			_, _ = io.Copy(io.Discard, c)
			c.Close()
			kit.Await(t, "the stream and the lean loop's connection gone", func() error {
				all, _ := e.polled()
				e.srv.mu.Lock()
				lean := len(e.srv.leanConns)
				e.srv.mu.Unlock()
				if g := testutil.ToFloat64(e.srv.metrics.streams); all != 0 || lean != 0 || g != 0 {
					return fmt.Errorf("%d streams in the hub (gauge %v), %d lean connections, %d connections counted", all, g, lean, e.srv.conns.Load())
				}
				return nil
			})
			if n := e.srv.conns.Load(); n != 0 {
				t.Fatalf("%d connections counted once the client and its stream are gone: the connection was closed by the panic's recovery and by the hub", n)
			}
		})
	}
}

// TestAttackLeanStreamPanicGivesSlotBack: a panic in the backend's
// Subscribe, after the observer's slot was taken, gives the slot back, on
// the lean loop and on net/http: recovered and answered, it must not cost
// the credential one of its MaxObserversPerCredential for the server's
// life.
func TestAttackLeanStreamPanicGivesSlotBack(t *testing.T) {
	path := filepath.Join(t.TempDir(), "tokens")
	authtest.WriteFile(t, path, []byte(tokenFile))
	tk, err := auth.LoadTokens(path)
	if err != nil {
		t.Fatal(err)
	}
	e := newEnvWith(t, envConfig{opts: Options{Tokens: tk}, prep: func(s *Server) { s.b = boomBackend{s.b} }})
	for _, route := range []string{"/subscribe", "/lock/subscribe"} {
		a, c, _ := streamExchange(t, e, subscribeRaw(route+"?type=pull&resource_id=boom", "Authorization: Bearer "+tokA))
		c.Close()
		if a.status != 500 {
			t.Fatalf("%s: a panic observing: %d %s", route, a.status, a.body)
		}
		e.srv.obsMu.Lock()
		held := e.srv.observers["a"]
		e.srv.obsMu.Unlock()
		if held != 0 {
			t.Fatalf("%s: a's credential holds %d observer slots after the panic, want 0", route, held)
		}
	}
}
