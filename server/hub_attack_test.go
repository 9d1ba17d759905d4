package server

// Attacks on the hub (hub.go, commit abeceae): the writers that take
// notified streams from a queue, the slow path of a full socket, the
// pinger, Drain, TLS. Each test says the property it checks. At this
// commit these fail, each showing a bug: StreamOutlivesItsSlowWrite,
// PanicInFillIsRecovered, TinyPingIntervalDoesNotPanic,
// ShutdownWithStalledTLSStream, ShutdownBoundedWithStalledTLSStreams,
// RevokedTLSStreamEnds, FirstBytesBeforeFeedEnd. The others pass and guard
// a property.

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/auth"
	"github.com/dlock/dlock/internal/auth/authtest"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/rawhttp"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/memory"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"
)

// --- helpers ---------------------------------------------------------------

// evLog collects the events a client reads from one stream, in a goroutine
// of its own, so that a test can wait for an event or for the stream's end.
type evLog struct {
	mu   sync.Mutex
	evs  []rawhttp.Event
	err  error // the read that ended the stream
	done chan struct{}
}

// readEvents reads r's events until it fails.
func readEvents(r io.Reader) *evLog {
	l := &evLog{done: make(chan struct{})}
	go func() {
		defer close(l.done)
		br := bufio.NewReaderSize(r, 64<<10)
		for {
			var ev rawhttp.Event
			err := rawhttp.ReadEvent(br, &ev)
			l.mu.Lock()
			if err != nil {
				l.err = err
				l.mu.Unlock()
				return
			}
			ev.Data = bytes.Clone(ev.Data)
			l.evs = append(l.evs, ev)
			l.mu.Unlock()
		}
	}()
	return l
}

// waitData waits for an event whose data holds s; the stream ending first
// fails the test.
func (l *evLog) waitData(t *testing.T, s string) {
	t.Helper()
	kit.Await(t, "an event with "+s, func() error {
		l.mu.Lock()
		defer l.mu.Unlock()
		for _, ev := range l.evs {
			if bytes.Contains(ev.Data, []byte(s)) {
				return nil
			}
		}
		if l.err != nil {
			t.Fatalf("the stream ended (%v) before an event with %s arrived", l.err, s)
		}
		if n := len(l.evs); n > 0 {
			return fmt.Errorf("%d events read, the last %s %s", n, l.evs[n-1].Name, l.evs[n-1].Data)
		}
		return errors.New("no event read")
	})
}

func (l *evLog) events() []rawhttp.Event {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.evs)
}

// grant gives node the pull lock on resource and releases it: one
// lock_assigned event on node's session stream.
func (e *env) grant(node, resource string) {
	e.t.Helper()
	ctx := context.Background()
	if _, err := e.m.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: resource, Node: node}); err != nil {
		e.t.Fatal(err)
	}
	if _, err := e.m.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: resource, Node: node, Success: true}); err != nil {
		e.t.Fatal(err)
	}
}

// tcpPair is a connected pair of loopback TCP connections, closed when the
// test ends: server is what a hub writes (a plain socket: the raw path).
func tcpPair(t *testing.T) (client, server net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	acc := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		acc <- c
	}()
	client, err = net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	server = <-acc
	if server == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { client.Close(); server.Close() })
	_ = client.SetDeadline(time.Now().Add(kit.Patience))
	return client, server
}

// fakeFeed is a source that a test drives: offer queues an item and wakes
// the stream as a lock.Feed does (Notify when items start waiting, and at
// the end). A gate makes the next fill stop, after it took the items,
// until the test lets it go: the writer has the stream meanwhile.
type fakeFeed struct {
	mu     sync.Mutex
	queue  []string
	notify func()
	ended  bool
	done   chan struct{}
	gate   *fillGate
	fills  atomic.Int32
	panics bool // fill panics
}

type fillGate struct{ in, out chan struct{} }

func newFakeFeed() *fakeFeed { return &fakeFeed{done: make(chan struct{})} }

func (f *fakeFeed) offer(s string) {
	f.mu.Lock()
	f.queue = append(f.queue, s)
	var n func()
	if len(f.queue) == 1 {
		n = f.notify
	}
	f.mu.Unlock()
	if n != nil {
		n()
	}
}

func (f *fakeFeed) end() {
	f.mu.Lock()
	f.ended = true
	n := f.notify
	f.mu.Unlock()
	close(f.done)
	if n != nil {
		n()
	}
}

// hold makes the next fill wait, once it took the waiting items, until
// the returned gate's out is closed; it signals gate.in when it waits.
func (f *fakeFeed) hold() *fillGate {
	g := &fillGate{in: make(chan struct{}), out: make(chan struct{})}
	f.mu.Lock()
	f.gate = g
	f.mu.Unlock()
	return g
}

func (f *fakeFeed) source() source { return fakeSource{f} }

// fakeSource is a fakeFeed as the hub sees it.
type fakeSource struct{ f *fakeFeed }

func (s fakeSource) notify(fn func()) {
	f := s.f
	f.mu.Lock()
	f.notify = fn
	now := len(f.queue) > 0 || f.ended
	f.mu.Unlock()
	if now {
		fn()
	}
}

func (s fakeSource) ended() bool {
	f := s.f
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ended
}

func (s fakeSource) channels() (ready, done <-chan struct{}) { return make(chan struct{}), s.f.done }

func (s fakeSource) close() {}

func (s fakeSource) fill(b []byte) []byte {
	f := s.f
	f.fills.Add(1)
	if f.panics {
		panic("hub attack: fill panics")
	}
	f.mu.Lock()
	q := f.queue
	f.queue = nil
	g := f.gate
	f.gate = nil
	f.mu.Unlock()
	if g != nil {
		close(g.in)
		<-g.out
	}
	for _, s := range q {
		b = append(b, "data: "+s+"\n\n"...)
	}
	return b
}

// startRaw hands conn to e's hub as an event stream of src that writes out
// first, as eventStream does after the hijack; released counts the calls
// of the stream's release.
func (e *env) startRaw(conn net.Conn, src source, out string) (released *atomic.Int32) {
	e.t.Helper()
	released = new(atomic.Int32)
	if !e.srv.hub.admit() {
		e.t.Fatal("the hub refused a stream")
	}
	e.srv.metrics.streams.Inc()
	if e.srv.hub.start(conn, src, []byte(out), nil, func() { released.Add(1) }) == nil {
		e.t.Fatal("the hub refused a stream")
	}
	return released
}

// hubStreamOf is the hub's stream whose peer is the client address addr.
func (e *env) hubStreamOf(addr string) *hubStream {
	h := e.srv.hub
	h.mu.Lock()
	defer h.mu.Unlock()
	for st := range h.all {
		if st.remote() == addr {
			return st
		}
	}
	return nil
}

// stateOf is st's state, read under the hub's mutex.
func (e *env) stateOf(st *hubStream) uint8 {
	e.srv.hub.mu.Lock()
	defer e.srv.hub.mu.Unlock()
	return st.state
}

// readAllFrom reads c until it ends, bounded by c's deadline.
func readAllFrom(c net.Conn) ([]byte, error) {
	return io.ReadAll(c)
}

// runChild runs the test named name in a child process with
// DLOCK_HUB_ATTACK_CHILD=mode: a panic that kills the process fails the
// parent test instead of the whole run.
func runChild(t *testing.T, name, mode string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*kit.Patience)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^"+name+"$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), "DLOCK_HUB_ATTACK_CHILD="+mode)
	out, err := cmd.CombinedOutput()
	if err != nil {
		lines := strings.Split(string(out), "\n")
		for i, l := range lines {
			if strings.HasPrefix(l, "panic: ") {
				lines = lines[i:min(len(lines), i+12)]
				break
			}
		}
		if len(lines) > 40 {
			lines = lines[len(lines)-40:]
		}
		t.Fatalf("the server's process died (%v):\n%s", err, strings.Join(lines, "\n"))
	}
}

// stallSmall is stallStream with the server's send buffer of the stream cut
// to a few KiB, so that the socket fills after a few dozen events: it
// returns once a write has found the socket full and waits in writeSlow.
// A client that means to catch up calls catchUp first.
func (e *env) stallSmall(node string) net.Conn {
	e.t.Helper()
	c := e.dial()
	_ = c.SetDeadline(time.Now().Add(2 * kit.Patience))
	_ = c.(*net.TCPConn).SetReadBuffer(4096)
	if _, err := fmt.Fprintf(c, "GET /subscribe?node_id=%s HTTP/1.1\r\nHost: x\r\n\r\n", node); err != nil {
		e.t.Fatal(err)
	}
	var st *hubStream
	kit.WaitFor(e.t, node+"'s stream in the hub", func() bool {
		st = e.hubStreamOf(c.LocalAddr().String())
		return st != nil
	})
	e.onSocket(st, func(fd int) { _ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUF, 4096) })
	full := testutil.ToFloat64(e.srv.metrics.fullSockets)
	for i := 0; testutil.ToFloat64(e.srv.metrics.fullSockets) == full; i++ {
		if i == 100_000 {
			e.t.Fatalf("%d events written to a stream that is not read, and the socket never filled", i)
		}
		e.grant(node, fmt.Sprintf("stall-%s-%d", node, i))
	}
	return c
}

// catchUp makes a stalled client's receive buffer large, so that it
// catches up at once when it reads (a 4 KiB one crawls).
func catchUp(c net.Conn) { _ = c.(*net.TCPConn).SetReadBuffer(4 << 20) }

// --- attacks ---------------------------------------------------------------

// TestHubAttackStreamOutlivesItsSlowWrite: a stream whose socket was full
// once (its peer fell behind for a moment, a fan-out larger than the
// socket's buffer) and then caught up keeps working. writeSlow sets a
// write deadline on the socket and never clears it; the writers' later
// non-blocking writes go through RawConn.Write, which fails with "i/o
// timeout" once that deadline has passed: the next ping or event after
// --write-timeout closes a healthy stream.
func TestHubAttackStreamOutlivesItsSlowWrite(t *testing.T) {
	const writeTimeout = 2 * time.Second
	e := newEnvWith(t, envConfig{mod: stallConfig, opts: Options{WriteTimeout: writeTimeout}}) // pings every 50 ms
	c := e.stallSmall("a")                                                                     // a write waits in writeSlow now
	catchUp(c)
	resp, err := http.ReadResponse(bufio.NewReaderSize(c, 64<<10), nil)
	if err != nil {
		t.Fatal(err)
	}
	l := readEvents(resp.Body) // the peer catches up: the slow write completes
	e.grant("a", "marker-0")
	l.waitData(t, "marker-0")
	// The stream is healthy and read; pings flow every 50 ms. Stay three
	// write timeouts: the deadline writeSlow set has passed by then.
	select {
	case <-l.done:
		t.Fatalf("the server ended a stream that its peer reads, %v after its one slow write had completed: %v "+
			"(hub.go writeSlow leaves its write deadline on the socket; the next raw write fails with it)", writeTimeout, l.err)
	case <-time.After(3 * writeTimeout):
	}
	e.grant("a", "marker-1")
	l.waitData(t, "marker-1")
}

// TestHubAttackPanicInFillIsRecovered: a panic while a writer encodes a
// stream's events (fill: appendDelivery, appendOpEvent) is recovered, as
// it was in the per-stream goroutine before: counted in
// dlock_handler_panics_total, that stream's connection closed and released
// once, and the process and the other streams live on. The writers have
// no recover: the process dies. Run in a child process.
func TestHubAttackPanicInFillIsRecovered(t *testing.T) {
	if os.Getenv("DLOCK_HUB_ATTACK_CHILD") != "panic" {
		runChild(t, t.Name(), "panic")
		return
	}
	e := newEnv(t, nil)
	client, server := tcpPair(t)
	f := newFakeFeed()
	f.panics = true
	released := e.startRaw(server, f.source(), "HTTP/1.1 200 OK\r\n\r\n")
	f.offer("x")
	kit.WaitFor(t, "the panic to be counted", func() bool { return testutil.ToFloat64(e.srv.metrics.panics) == 1 })
	if _, err := readAllFrom(client); err != nil {
		t.Fatalf("the stream whose fill panicked was not closed: %v", err)
	}
	kit.WaitFor(t, "the stream to be released", func() bool { return released.Load() == 1 })
	// Another stream is still written.
	s := e.subscribe("node_id=b", "")
	s.Next(t)
	e.grant("b", "r")
	if f := s.Next(t); f.Event != "lock_assigned" {
		t.Fatalf("got %v after a panic, want lock_assigned", f)
	}
}

// TestHubAttackTinyPingIntervalDoesNotPanic: a ping interval of 1 ns (an
// Option; or --lock-ttl under 8 ns, whose quarter it is) starts the pinger
// with time.NewTicker(0), which panics in a goroutine without recover: the
// first event stream kills the process. Before the hub, NewTicker(1ns)
// worked. Run in a child process. (Low severity: an absurd setting.)
func TestHubAttackTinyPingIntervalDoesNotPanic(t *testing.T) {
	if os.Getenv("DLOCK_HUB_ATTACK_CHILD") != "ping" {
		runChild(t, t.Name(), "ping")
		return
	}
	e := newEnvWith(t, envConfig{opts: Options{PingInterval: time.Nanosecond}})
	s := e.subscribe("node_id=a", "")
	s.Next(t)
	s.Close()
	e.srv.Drain()
}

// stalledTLSStreams starts k streams in e's hub over TLS on in-memory
// connections, as HTTP/1.1-over-TLS streams are after the hijack: each
// client reads the stream's head, then nothing more. An in-memory
// connection takes no write its peer does not read: a full socket that
// stays full, deterministically.
func (e *env) stalledTLSStreams(t *testing.T, k int) (feeds []*fakeFeed) {
	t.Helper()
	ca := authtest.NewCA(t, "hub attack CA")
	srvCert := ca.Server(t).TLS(t)
	for i := range k {
		cp, sp := net.Pipe()
		t.Cleanup(func() { cp.Close(); sp.Close() })
		tc := tls.Client(cp, &tls.Config{RootCAs: ca.Pool(), ServerName: "localhost"})
		ts := tls.Server(sp, &tls.Config{Certificates: []tls.Certificate{srvCert}})
		_ = tc.SetDeadline(time.Now().Add(kit.Patience))
		_ = ts.SetDeadline(time.Now().Add(kit.Patience))
		hs := make(chan error, 1)
		go func() { hs <- ts.Handshake() }()
		if err := tc.Handshake(); err != nil {
			t.Fatal(err)
		}
		if err := <-hs; err != nil {
			t.Fatal(err)
		}
		_ = ts.SetDeadline(time.Time{})
		head := fmt.Sprintf("HEAD %d\n\n", i)
		f := newFakeFeed()
		feeds = append(feeds, f)
		e.startRaw(ts, f.source(), head)
		got := make([]byte, len(head))
		if _, err := io.ReadFull(tc, got); err != nil || string(got) != head {
			t.Fatalf("read %q (%v), want %q", got, err, head)
		}
		// The client reads no more. The stream is idle once the head's
		// write is done (the feed's fill has run).
		kit.WaitFor(t, "the stream's first write to be done", func() bool { return f.fills.Load() == 1 })
	}
	kit.WaitFor(t, "every stream idle", func() bool {
		h := e.srv.hub
		h.mu.Lock()
		defer h.mu.Unlock()
		for st := range h.all {
			if st.state == streamBusy {
				return false
			}
		}
		return len(h.all) == k
	})
	return feeds
}

// shutdownWithin runs Shutdown with a 1 s context and fails the test
// unless it returns within limit.
func (e *env) shutdownWithin(t *testing.T, limit time.Duration, why string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	start := time.Now()
	done := make(chan error, 1)
	go func() { done <- e.srv.Shutdown(ctx) }()
	select {
	case <-done:
	case <-time.After(kit.Patience):
		t.Fatalf("Shutdown with a 1 s context did not return within %v (%s)", kit.Patience, why)
	}
	if d := time.Since(start); d > limit {
		t.Fatalf("Shutdown with a 1 s context took %v (%s)", d.Round(time.Millisecond), why)
	}
}

// TestHubAttackShutdownWithStalledTLSStream: Shutdown "stops the server
// within ctx whatever clients do" (conns.go). One idle HTTP/1.1-over-TLS
// stream whose peer stopped reading, with a full socket, and events for it
// now and then. It never returned when hub.stop closed the stream's
// *tls.Conn: Close sent close_notify to the full socket, and each event's
// writeSlow moved that blocked write's deadline on. The hub now shuts a
// stream (nothing more is written) and closes the socket under its TLS.
func TestHubAttackShutdownWithStalledTLSStream(t *testing.T) {
	e := newEnvWith(t, envConfig{opts: Options{PingInterval: time.Hour}}) // write timeout 10 s
	f := e.stalledTLSStreams(t, 1)[0]
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- e.srv.Shutdown(ctx) }()
	// Events for the stream: one every 500 ms, for at most 20 s.
	start := time.Now()
	for i := 0; ; i++ {
		select {
		case <-done:
			return
		case <-time.After(500 * time.Millisecond): // the pace of the events, not an ordering
		}
		if time.Since(start) > 20*time.Second {
			t.Fatalf("Shutdown with a 1 s context has not returned %v after it began, with an event every 500 ms for "+
				"the idle TLS stream it closes (each event's writeSlow moves the deadline of the close_notify write that "+
				"hub.stop's tls.Conn.Close waits on)", time.Since(start).Round(time.Second))
		}
		f.offer(fmt.Sprint("e", i))
	}
}

// TestHubAttackShutdownBoundedWithStalledTLSStreams: the same with pings
// off, k streams: hub.stop closes the *tls.Conns one after the other in
// Shutdown's goroutine, each Close waiting 5 s for close_notify, so
// Shutdown takes k x 5 s whatever its ctx says. Before the hub each
// connection was closed in a goroutine of its own: 5 s at most in all.
func TestHubAttackShutdownBoundedWithStalledTLSStreams(t *testing.T) {
	const k = 3
	e := newEnvWith(t, envConfig{opts: Options{PingInterval: time.Hour}})
	e.stalledTLSStreams(t, k)
	// 1 s of ctx, 5 s of one close_notify (the old bound), and slack: not
	// k x 5 s.
	e.shutdownWithin(t, 8*time.Second, fmt.Sprintf("%d idle TLS streams whose peers do not read: "+
		"hub.stop closes each *tls.Conn in turn, each Close waiting up to 5 s to send close_notify", k))
}

// pipeTLSServer is a server with the token file of auth_test.go, over TLS,
// served by Serve (the lean loop, the hijack, eventStream) on an in-memory
// listener: a client that reads nothing leaves the server a full socket
// that stays full.
type pipeTLSServer struct {
	*env
	pl         *kit.PipeListener
	ca         *authtest.CA
	tokensPath string
}

func newPipeTLSServer(t *testing.T, opts Options) *pipeTLSServer {
	t.Helper()
	dir := t.TempDir()
	ps := &pipeTLSServer{pl: kit.NewPipeListener(), ca: authtest.NewCA(t, "hub attack CA"), tokensPath: dir + "/tokens"}
	authtest.WriteFile(t, ps.tokensPath, []byte(tokenFile))
	tk, err := auth.LoadTokens(ps.tokensPath)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile := ps.ca.Server(t).Write(t, dir, "server")
	certs, err := auth.LoadCerts(certFile, keyFile, "")
	if err != nil {
		t.Fatal(err)
	}
	opts.Tokens, opts.TLS = tk, certs
	m, err := memory.New(context.Background(), memory.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	srv := New(m, opts)
	hs := &http.Server{Handler: srv}
	done := make(chan struct{})
	go func() { defer close(done); srv.Serve(ps.pl, hs) }()
	t.Cleanup(func() {
		srv.Drain()
		srv.Close()
		hs.Close()
		ps.pl.Close()
		<-done
		m.Close()
	})
	ps.env = &env{t: t, m: m, srv: srv}
	return ps
}

// stalledStream opens node's session stream over TLS and HTTP/1.1 with
// token, reads its head and subscribed event, and then reads nothing more.
// It returns once the stream is idle in the hub.
func (ps *pipeTLSServer) stalledStream(t *testing.T, node, token string) {
	t.Helper()
	c, err := ps.pl.Dial(context.Background(), "", "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	tc := tls.Client(c, &tls.Config{RootCAs: ps.ca.Pool(), ServerName: "localhost", NextProtos: []string{"http/1.1"}})
	_ = tc.SetDeadline(time.Now().Add(kit.Patience))
	if _, err := fmt.Fprintf(tc, "GET /subscribe?node_id=%s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n\r\n", node, token); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(tc)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("subscribe over TLS: %v %v", resp, err)
	}
	var ev rawhttp.Event
	if err := rawhttp.ReadEvent(bufio.NewReader(resp.Body), &ev); err != nil || ev.Name != "subscribed" {
		t.Fatalf("first event %q: %v", ev.Name, err)
	}
	kit.WaitFor(t, node+"'s stream idle in the hub", func() bool {
		h := ps.srv.hub
		h.mu.Lock()
		defer h.mu.Unlock()
		for st := range h.all {
			if st.state != streamIdle || len(st.out) > 0 {
				return false
			}
		}
		return len(h.all) == 1
	})
}

// TestHubAttackRevokedTLSStreamEnds: a stream whose token is removed ends
// (docs/SECURITY.md): its session loses it, and with it what the session
// holds after the grace. Over TLS (HTTP/1.1, hijacked), with the peer not
// reading and the stream idle, and events for the node going on: when the
// revocation closed the *tls.Conn, Close waited to send close_notify to
// the full socket while every event's writeSlow moved that write's
// deadline on, and a revoked client that stopped reading kept its session
// and its locks.
func TestHubAttackRevokedTLSStreamEnds(t *testing.T) {
	ps := newPipeTLSServer(t, Options{PingInterval: time.Hour})
	ps.stalledStream(t, "a", tokA)
	if n := ps.sessionStreams("a"); n != 1 {
		t.Fatalf("a has %d streams", n)
	}
	authtest.WriteFile(t, ps.tokensPath, []byte(tokB+" b\n"))
	if err := ps.srv.Reload(); err != nil {
		t.Fatal(err)
	}
	// a's events go on (another node's hand-offs, an observer's key): one
	// every 500 ms, for at most 20 s. 5 s (close_notify's own deadline)
	// should end the stream.
	start := time.Now()
	for i := 0; ps.sessionStreams("a") != 0; i++ {
		if time.Since(start) > 20*time.Second {
			t.Fatalf("a's revoked stream is still open %v after its token was removed, with an event every 500 ms "+
				"(each event's writeSlow moves the deadline of the close_notify write that tls.Conn.Close waits on)", time.Since(start).Round(time.Second))
		}
		ps.grant("a", fmt.Sprintf("r%d", i))
		time.Sleep(500 * time.Millisecond) // the pace of a's events, not an ordering
	}
}

// TestHubAttackTLSStreamHasNoRawSocket: an HTTP/1.1 stream over TLS (the
// lean loop's passedTLSConn) is never written through the raw socket
// under it: the hub's rawConn finds none, and every write takes the slow
// path through tls.Conn. Writing raw bytes under TLS would corrupt the
// stream.
func TestHubAttackTLSStreamHasNoRawSocket(t *testing.T) {
	ae := newAuthEnv(t, authSetup{tls: true})
	s, status := ae.stream(who{}, "/subscribe?node_id=a")
	if status != 200 {
		t.Fatalf("subscribe over TLS: %d", status)
	}
	s.Next(t)
	e := ae.env
	e.srv.hub.mu.Lock()
	var raws, n int
	for st := range e.srv.hub.all {
		n++
		if st.raw != nil {
			raws++
		}
	}
	e.srv.hub.mu.Unlock()
	if n != 1 || raws != 0 {
		t.Fatalf("%d streams in the hub, %d of them with a raw socket; want 1 and 0", n, raws)
	}
	// And it is written: an event, then a ping (every 50 ms).
	ae.do(who{}, "POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"a"}`)
	if f := s.Next(t); f.Event != "lock_assigned" {
		t.Fatalf("got %v, want lock_assigned", f)
	}
	if line := s.Line(t); line != ": ping\n" {
		t.Fatalf("got %q, want a ping", line)
	}
}

// onSocket calls f with the descriptor of the server side's TCP socket
// under st: the one the poller took, or the one under st's connection.
func (e *env) onSocket(st *hubStream, f func(fd int)) {
	e.t.Helper()
	h := e.srv.hub
	h.mu.Lock()
	defer h.mu.Unlock()
	if st.fd >= 0 {
		if st.fdClosed {
			e.t.Fatal("the stream's socket is closed")
		}
		f(int(st.fd))
		return
	}
	if err := socketOf(e.t, st.conn).Control(func(fd uintptr) { f(int(fd)) }); err != nil {
		e.t.Fatal(err)
	}
}

// socketOf is the server side's TCP socket under a stream's connection.
func socketOf(t testing.TB, c net.Conn) syscall.RawConn {
	t.Helper()
	for {
		switch v := c.(type) {
		case passedTLSConn:
			c = v.tc.NetConn()
		case *tls.Conn:
			c = v.NetConn()
		case *passedConn:
			c = v.Conn
		case *trackedConn:
			c = v.Conn
		case *net.TCPConn:
			rc, err := v.SyscallConn()
			if err != nil {
				t.Fatal(err)
			}
			return rc
		default:
			t.Fatalf("a stream's connection is a %T", c)
		}
	}
}

// TestHubAttackFirstBytesBeforeFeedEnd: a stream whose feed has ended by
// the time a writer first takes it still gets its response head and first
// bytes (the subscribed event and the replay) before the connection
// closes, as streamLoop wrote first before looking at Done. hub.write
// looks at src.done first and closes the connection with nothing written:
// the client sees a connection closed without an HTTP response. (Low
// severity: the client reconnects either way; it can happen when the
// backend closes, or the feed overflows, between Subscribe and the first
// write.)
func TestHubAttackFirstBytesBeforeFeedEnd(t *testing.T) {
	e := newEnv(t, nil)
	client, server := tcpPair(t)
	f := newFakeFeed()
	f.end()
	const head = "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nid: 7\nevent: subscribed\ndata: {}\n\n"
	released := e.startRaw(server, f.source(), head)
	got, err := readAllFrom(client)
	if err != nil {
		t.Fatalf("the stream of an ended feed was not closed: %v", err)
	}
	if string(got) != head {
		t.Fatalf("the stream of a feed that ended before the first write sent %q before closing, want its head and first bytes %q", got, head)
	}
	kit.WaitFor(t, "the stream to be released", func() bool { return released.Load() == 1 })
}

// TestHubAttackEventWhileWriterHasStream: an event offered while a writer
// encodes the stream (state busy, after Take) is written after the ones
// taken, exactly once, on the raw path. Guards wakeUp's "again".
func TestHubAttackEventWhileWriterHasStream(t *testing.T) {
	e := newEnv(t, nil)
	client, server := tcpPair(t)
	f := newFakeFeed()
	g := f.hold()
	released := e.startRaw(server, f.source(), "HEAD\n\n")
	f.offer("e1")
	<-g.in // a writer took the head and e1 and is in fill
	f.offer("e2")
	f.offer("e3")
	close(g.out)
	want := "HEAD\n\ndata: e1\n\ndata: e2\n\ndata: e3\n\n"
	got := make([]byte, len(want))
	if _, err := io.ReadFull(client, got); err != nil || string(got) != want {
		t.Fatalf("read %q (%v), want %q", got, err, want)
	}
	client.Close()
	kit.WaitFor(t, "the stream to be released", func() bool { return released.Load() == 1 })
	if n := released.Load(); n != 1 {
		t.Fatalf("release called %d times", n)
	}
}

// TestHubAttackEventAndEndWhileSlowWrite: on the slow path (an in-memory
// connection, whose writes wait for the reader, as TLS's do), events
// offered while the stream's own goroutine waits are written next, in
// order; a feed that ends meanwhile closes the connection once that write
// is done, and the stream is released once.
func TestHubAttackEventAndEndWhileSlowWrite(t *testing.T) {
	e := newEnv(t, nil)
	client, server := net.Pipe()
	t.Cleanup(func() { client.Close(); server.Close() })
	_ = client.SetDeadline(time.Now().Add(kit.Patience))
	f := newFakeFeed()
	released := e.startRaw(server, f.source(), "HEAD\n\n")
	f.offer("e1")
	// The pipe takes nothing until the client reads: the stream is busy
	// in writeSlow.
	kit.WaitFor(t, "a slow write in flight", func() bool {
		st := e.hubStreamOf(server.RemoteAddr().String())
		return st != nil && e.stateOf(st) == streamBusy && f.fills.Load() >= 1
	})
	f.offer("e2")
	f.offer("e3")
	f.end()
	got, err := readAllFrom(client)
	if err != nil {
		t.Fatalf("reading: %v", err)
	}
	// e1 may have gone with the head or after it; nothing is lost,
	// repeated or reordered either way.
	if want := "HEAD\n\ndata: e1\n\ndata: e2\n\ndata: e3\n\n"; string(got) != want &&
		// The end may win the race with e2 and e3's write: they are not
		// written, which is allowed (the client reconnects and replays).
		!strings.HasPrefix(want, string(got)) {
		t.Fatalf("read %q, want a prefix of %q", got, want)
	}
	if !strings.HasPrefix(string(got), "HEAD\n\n") {
		t.Fatalf("read %q: the head is missing", got)
	}
	kit.WaitFor(t, "the stream to be released", func() bool { return released.Load() == 1 })
}

// TestHubAttackOrderExactlyOnceThroughFullSocket: a node's events offered
// from several goroutines while its stream's socket is full (the write
// waiting in writeSlow, the server's send buffer cut small so that it
// fills again and again) and while the peer catches up arrive each exactly
// once and in id order. (Not in each producer's order: the backend numbers
// a grant's event when its outbox is flushed, which may be after the
// producer's next grant on another key has been numbered; that is the
// backend's, and ids stay in order on the stream.) The write timeout is
// long, to keep this clear of the deadline bug above.
func TestHubAttackOrderExactlyOnceThroughFullSocket(t *testing.T) {
	e := newEnvWith(t, envConfig{mod: stallConfig, opts: Options{WriteTimeout: time.Hour}})
	c := e.stallSmall("a")
	catchUp(c)
	const producers, each = 3, 300
	var wg sync.WaitGroup
	started := make(chan struct{})
	for p := range producers {
		wg.Go(func() {
			<-started
			for j := range each {
				e.grant("a", fmt.Sprintf("p%d-%04d", p, j))
			}
		})
	}
	close(started)
	// The peer starts reading while the producers go on.
	resp, err := http.ReadResponse(bufio.NewReaderSize(c, 64<<10), nil)
	if err != nil {
		t.Fatal(err)
	}
	l := readEvents(resp.Body)
	wg.Wait()
	e.grant("a", "the-end")
	l.waitData(t, "the-end")
	evs := l.events()
	var last uint64
	seen := map[string]int{}
	next := make([]int, producers)
	stalls := 0
	for i, ev := range evs {
		if ev.Name == "subscribed" {
			if i != 0 {
				t.Fatalf("subscribed at %d", i)
			}
			continue
		}
		var id uint64
		if _, err := fmt.Sscan(ev.ID, &id); err != nil {
			t.Fatalf("event %d id %q", i, ev.ID)
		}
		if id <= last {
			t.Fatalf("event %d has id %d after %d: out of order or repeated", i, id, last)
		}
		last = id
		if ev.Name != "lock_assigned" {
			continue
		}
		var res string
		for _, part := range strings.Split(string(ev.Data), `"`) {
			if strings.HasPrefix(part, "stall-") || strings.HasPrefix(part, "p") && strings.Contains(part, "-") || part == "the-end" {
				res = part
				break
			}
		}
		seen[res]++
		if seen[res] > 1 {
			t.Fatalf("%s delivered twice", res)
		}
		var p, j int
		if n, _ := fmt.Sscanf(res, "p%d-%d", &p, &j); n == 2 {
			next[p]++
		} else if strings.HasPrefix(res, "stall-a-") {
			stalls++
		}
	}
	for p, n := range next {
		if n != each {
			t.Fatalf("producer %d: %d of %d events arrived", p, n, each)
		}
	}
	for i := range stalls {
		if seen[fmt.Sprintf("stall-a-%d", i)] != 1 {
			t.Fatalf("stall-a-%d missing among %d stall events", i, stalls)
		}
	}
}

// TestHubAttackHalfCloseEndsStream: a client that shuts down its sending
// side (shutdown(SHUT_WR)) ends its stream: the reader sees EOF, the
// session loses the stream and the connection closes. The same as before
// the hub (its reader goroutine closed gone on EOF).
func TestHubAttackHalfCloseEndsStream(t *testing.T) {
	e := newEnv(t, nil)
	c := e.dial()
	if _, err := fmt.Fprintf(c, "GET /subscribe?node_id=a HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, "a's session stream", func() bool { return e.sessionStreams("a") == 1 })
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	waitClosed(t, c, "a half-closed stream")
	kit.WaitFor(t, "a's stream to end", func() bool { return e.sessionStreams("a") == 0 })
	kit.WaitFor(t, "the stream gauge at 0", func() bool { return testutil.ToFloat64(e.srv.metrics.streams) == 0 })
}

// TestHubAttackBackendCloseEndsStreams: when the backend closes every
// feed, idle streams' connections close (the writers see Done), rather
// than stay open without events.
func TestHubAttackBackendCloseEndsStreams(t *testing.T) {
	e := newEnv(t, nil)
	var ss []*kit.Stream
	for i := range 5 {
		s := e.subscribe(fmt.Sprintf("node_id=n%d", i), "")
		s.Next(t)
		ss = append(ss, s)
	}
	e.m.Close()
	for i, s := range ss {
		done := make(chan error, 1)
		go func() {
			_, err := io.ReadAll(s.R)
			done <- err
		}()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("stream %d ended with %v", i, err)
			}
		case <-time.After(kit.Patience):
			t.Fatalf("stream %d stayed open after the backend closed its feed", i)
		}
	}
	kit.WaitFor(t, "no stream left in the hub", func() bool {
		e.srv.hub.mu.Lock()
		defer e.srv.hub.mu.Unlock()
		return len(e.srv.hub.all) == 0
	})
}

// TestHubAttackDrainWithSlowWriteInFlight: Drain returns promptly while a
// stream's own goroutine waits on a full socket with an hour's write
// timeout, and only after that goroutine has finished (goleak checks the
// package at the end).
func TestHubAttackDrainWithSlowWriteInFlight(t *testing.T) {
	e := newEnvWith(t, envConfig{mod: stallConfig, opts: Options{WriteTimeout: time.Hour}})
	for _, n := range []string{"a", "b"} {
		c := e.stallSmall(n)
		kit.WaitFor(t, n+"'s slow write in flight", func() bool {
			st := e.hubStreamOf(c.LocalAddr().String())
			return st != nil && e.stateOf(st) == streamBusy
		})
	}
	done := make(chan struct{})
	go func() { e.srv.Drain(); close(done) }()
	select {
	case <-done:
	case <-time.After(kit.Patience):
		t.Fatal("Drain did not return while slow writes were in flight")
	}
	e.srv.hub.mu.Lock()
	n := len(e.srv.hub.all)
	e.srv.hub.mu.Unlock()
	if n != 0 {
		t.Fatalf("%d streams left in the hub after Drain", n)
	}
}

// TestHubAttackFloodWhileFanOut: streams of one observed key open and
// close (closed at once, half-closed, read a little) while grants on that
// key fan out to them, and Drain comes in the middle: Drain returns, no
// stream is left in the hub, the stream gauge is back at 0, every stream
// was ended, and a stream refused while draining gets 503 or a closed
// connection, never a hang. Run with
// -race; goleak checks the goroutines at the end of the package.
func TestHubAttackFloodWhileFanOut(t *testing.T) {
	e := newEnv(t, nil)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { // fan-out: every grant of hot is an event to each observer
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			e.grant(fmt.Sprintf("g%d", i%4), "hot")
		}
	})
	var opened atomic.Int32
	for w := range 3 {
		wg.Go(func() {
			for i := range 40 {
				c, err := net.Dial("tcp", e.addr())
				if err != nil {
					return
				}
				_ = c.SetDeadline(time.Now().Add(kit.Patience))
				fmt.Fprintf(c, "GET /subscribe?type=pull&resource_id=hot HTTP/1.1\r\nHost: x\r\n\r\n")
				switch (w + i) % 3 {
				case 0:
				case 1:
					_ = c.(*net.TCPConn).CloseWrite()
					_, _ = io.Copy(io.Discard, c) // the server ends it
				case 2:
					b := make([]byte, 512)
					if _, err := io.ReadAtLeast(c, b, 1); err == nil {
						opened.Add(1)
					}
				}
				c.Close()
			}
		})
	}
	kit.WaitFor(t, "some streams opened", func() bool { return opened.Load() >= 5 })
	drained := make(chan struct{})
	go func() { e.srv.Drain(); close(drained) }()
	select {
	case <-drained:
	case <-time.After(kit.Patience):
		t.Fatal("Drain did not return during a flood of streams")
	}
	close(stop)
	wg.Wait()
	e.srv.hub.mu.Lock()
	n, q := len(e.srv.hub.all), len(e.srv.hub.queue)
	e.srv.hub.mu.Unlock()
	if n != 0 {
		t.Fatalf("%d streams left in the hub after Drain (queue %d)", n, q)
	}
	kit.WaitFor(t, "the stream gauge at 0", func() bool { return testutil.ToFloat64(e.srv.metrics.streams) == 0 })
}
