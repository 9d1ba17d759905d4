package netfault

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
)

// target is a listener the test accepts on itself, so that it holds both
// ends of a proxied connection.
func target(t *testing.T) *net.TCPListener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln.(*net.TCPListener)
}

// dial connects a client to p.
func dial(t *testing.T, p *Proxy) *net.TCPConn {
	t.Helper()
	c, err := net.DialTimeout("tcp", p.Addr(), kit.Patience)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c.(*net.TCPConn)
}

// accept is the server's end of the next connection the proxy makes.
func accept(t *testing.T, ln *net.TCPListener) *net.TCPConn {
	t.Helper()
	if err := ln.SetDeadline(time.Now().Add(kit.Patience)); err != nil {
		t.Fatal(err)
	}
	c, err := ln.AcceptTCP()
	if err != nil {
		t.Fatalf("the target's accept: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// proxied is a connection through a new proxy: the client's end and the
// server's.
func proxied(t *testing.T) (p *Proxy, client, server *net.TCPConn) {
	t.Helper()
	ln := target(t)
	p = NewProxy(t, ln.Addr().String())
	client = dial(t, p)
	server = accept(t, ln)
	return p, client, server
}

func send(t *testing.T, c io.Writer, s string) {
	t.Helper()
	if _, err := io.WriteString(c, s); err != nil {
		t.Fatalf("write %q: %v", s, err)
	}
}

// expect reads exactly want from c.
func expect(t *testing.T, c deadlineReader, want string) {
	t.Helper()
	if err := c.SetReadDeadline(time.Now().Add(kit.Patience)); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(want))
	if _, err := io.ReadFull(c, got); err != nil || string(got) != want {
		t.Fatalf("read %q, %v; want %q", got, err, want)
	}
	if err := c.SetReadDeadline(time.Time{}); err != nil {
		t.Fatal(err)
	}
}

// expectEnd reads c's end: EOF, or a reset with reset.
func expectEnd(t *testing.T, c net.Conn, reset bool) {
	t.Helper()
	if err := c.SetReadDeadline(time.Now().Add(kit.Patience)); err != nil {
		t.Fatal(err)
	}
	n, err := c.Read(make([]byte, 1))
	switch {
	case n > 0:
		t.Fatalf("read a byte; want the end")
	case reset && !errors.Is(err, syscall.ECONNRESET):
		t.Fatalf("read %v; want a reset (ECONNRESET)", err)
	case !reset && err != io.EOF:
		t.Fatalf("read %v; want EOF", err)
	}
}

// TestProxyForwards: bytes both ways, each side's FIN to the other, and
// the connection gone from Conns when both have closed.
func TestProxyForwards(t *testing.T) {
	p, client, server := proxied(t)
	send(t, client, "hello")
	expect(t, server, "hello")
	send(t, server, "world")
	expect(t, client, "world")
	if n := p.Conns(); n != 1 {
		t.Fatalf("Conns %d, want 1", n)
	}
	if err := client.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	expectEnd(t, server, false)
	send(t, server, "after the client's FIN")
	expect(t, client, "after the client's FIN")
	if err := server.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	expectEnd(t, client, false)
	kit.WaitFor(t, "the connection to leave Conns", func() bool { return p.Conns() == 0 })
}

// TestProxyBlackholeHoldsAndHeals: black-holed, neither side reads a byte,
// a FIN or a reset; healed, each reads what the other sent, in order, and
// the FIN sent meanwhile after it.
func TestProxyBlackholeHoldsAndHeals(t *testing.T) {
	p, client, server := proxied(t)
	send(t, client, "up")
	expect(t, server, "up")

	p.Blackhole()
	if d := p.Cuts(); d != Both {
		t.Fatalf("Cuts %v, want both", d)
	}
	send(t, client, "held ")
	send(t, client, "client bytes")
	send(t, server, "held server bytes")
	expectQuiet(t, server, "the server, black-holed")
	expectQuiet(t, client, "the client, black-holed")
	if err := client.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	expectQuiet(t, server, "the server after the client's FIN, black-holed")
	// Nothing closed the client's end: it can still read, and it hears
	// neither the server nor a reset.
	expectQuiet(t, client, "the client after its FIN, black-holed")
	if n := p.Conns(); n != 1 {
		t.Fatalf("Conns %d, want 1", n)
	}

	p.Heal()
	expect(t, server, "held client bytes")
	expectEnd(t, server, false)
	expect(t, client, "held server bytes")
	send(t, server, "after")
	expect(t, client, "after")
}

// TestProxyBlackholeFillsWindows: a black-holed proxy reads nothing, so
// the sender's writes block once the kernel's buffers are full (a proxy
// that read and dropped would take every byte); healed, the receiver gets
// exactly the bytes the sender wrote, in order.
func TestProxyBlackholeFillsWindows(t *testing.T) {
	p, client, server := proxied(t)
	p.Blackhole()
	// Far more than the buffers hold (some MiB on loopback), in a
	// pattern whose period is prime, so that a lost or repeated block
	// shows.
	data := make([]byte, 251, 32<<20)
	for i := range data {
		data[i] = byte(i)
	}
	for len(data) < cap(data) {
		data = append(data, data[:min(len(data), cap(data)-len(data))]...)
	}
	if err := client.SetWriteDeadline(time.Now().Add(quiet)); err != nil {
		t.Fatal(err)
	}
	n, err := client.Write(data)
	if !errors.Is(err, os.ErrDeadlineExceeded) || n >= len(data) {
		t.Fatalf("a black-holed write of %d bytes wrote %d, %v; want it to block with the buffers full", len(data), n, err)
	}
	t.Logf("%d bytes went into the buffers before the writes blocked", n)
	expectQuiet(t, server, "the server, black-holed")
	if err := client.CloseWrite(); err != nil {
		t.Fatal(err)
	}

	p.Heal()
	if err := server.SetReadDeadline(time.Now().Add(kit.Patience)); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(server)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data[:n]) {
		i := 0
		for i < min(len(got), n) && got[i] == data[i] {
			i++
		}
		t.Fatalf("the server read %d bytes, differing from the %d written at byte %d", len(got), n, i)
	}
}

// TestProxyCutOneWay: one direction cut, the other flows; healed, the
// held bytes come.
func TestProxyCutOneWay(t *testing.T) {
	p, client, server := proxied(t)

	p.Cut(ClientToServer)
	send(t, client, "ping")
	expectQuiet(t, server, "the server, client→server cut")
	send(t, server, "pong")
	expect(t, client, "pong")
	p.Heal()
	expect(t, server, "ping")

	p.Cut(ServerToClient)
	if d := p.Cuts(); d != ServerToClient {
		t.Fatalf("Cuts %v, want server→client", d)
	}
	send(t, server, "pong2")
	expectQuiet(t, client, "the client, server→client cut")
	send(t, client, "ping2")
	expect(t, server, "ping2")
	// The server's FIN is held with its bytes.
	if err := server.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	expectQuiet(t, client, "the client after the server's FIN, server→client cut")
	p.Heal()
	expect(t, client, "pong2")
	expectEnd(t, client, false)
}

// TestProxyConnectWhileBlackholed: a client that connects to a black-holed
// proxy is accepted, but the server sees no connection until the heal.
func TestProxyConnectWhileBlackholed(t *testing.T) {
	ln := target(t)
	p := NewProxy(t, ln.Addr().String())
	p.Blackhole()
	client := dial(t, p)
	send(t, client, "first words")
	if err := ln.SetDeadline(time.Now().Add(quiet)); err != nil {
		t.Fatal(err)
	}
	if c, err := ln.Accept(); !errors.Is(err, os.ErrDeadlineExceeded) {
		if c != nil {
			c.Close()
		}
		t.Fatalf("the target accepted %v, %v through a black hole", c, err)
	}
	kit.WaitFor(t, "the proxy to count the connection", func() bool { return p.Conns() == 1 })
	p.Heal()
	server := accept(t, ln)
	expect(t, server, "first words")
}

// TestProxyResetHeld: a client's reset while black-holed does not cross;
// healed, the server is reset.
func TestProxyResetHeld(t *testing.T) {
	p, client, server := proxied(t)
	send(t, client, "up")
	expect(t, server, "up")
	p.Blackhole()
	reset(client)
	expectQuiet(t, server, "the server after the client's reset, black-holed")
	p.Heal()
	expectEnd(t, server, true)
	kit.WaitFor(t, "the connection to leave Conns", func() bool { return p.Conns() == 0 })
}

// TestProxyCloseAll: both sides are reset, cut or not; the proxy goes on
// accepting.
func TestProxyCloseAll(t *testing.T) {
	ln := target(t)
	p := NewProxy(t, ln.Addr().String())
	c1, s1 := dial(t, p), accept(t, ln)
	c2, s2 := dial(t, p), accept(t, ln)
	send(t, c2, "x")
	expect(t, s2, "x")
	kit.WaitFor(t, "two connections", func() bool { return p.Conns() == 2 })
	p.Blackhole()
	if n := p.CloseAll(); n != 2 {
		t.Fatalf("CloseAll reset %d connections, want 2", n)
	}
	for _, c := range []net.Conn{c1, s1, c2, s2} {
		expectEnd(t, c, true)
	}
	kit.WaitFor(t, "Conns to be 0", func() bool { return p.Conns() == 0 })
	p.Heal()
	c3, s3 := dial(t, p), accept(t, ln)
	send(t, c3, "again")
	expect(t, s3, "again")
}

// TestProxyCloseAllMidDial: a reset that comes as the proxy's dial to
// the target completes (the server has accepted, the proxy's dial has not
// returned) resets the server too, not a FIN.
func TestProxyCloseAllMidDial(t *testing.T) {
	ln := target(t)
	p := NewProxy(t, ln.Addr().String())
	for range 100 {
		c := dial(t, p)
		s := accept(t, ln)
		p.CloseAll()
		expectEnd(t, s, true)
		expectEnd(t, c, true)
		c.Close()
		s.Close()
	}
}

// TestProxyTargetGone: with nothing listening at the target, a client is
// reset.
func TestProxyTargetGone(t *testing.T) {
	ln := target(t)
	p := NewProxy(t, ln.Addr().String())
	ln.Close()
	// The reset may come before the dial has returned.
	c, err := net.DialTimeout("tcp", p.Addr(), kit.Patience)
	if err == nil {
		defer c.Close()
		expectEnd(t, c, true)
	} else if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("dial: %v; want success or a reset", err)
	}
	kit.WaitFor(t, "Conns to be 0", func() bool { return p.Conns() == 0 })
}

// TestProxyClose: Close ends connections that wait in a black hole, those
// whose dial waits for the heal, and the accept loop (goleak checks the
// goroutines at the end); it is idempotent.
func TestProxyClose(t *testing.T) {
	p, client, server := proxied(t)
	p.Blackhole()
	send(t, client, "held")
	early := dial(t, p)
	kit.WaitFor(t, "two connections", func() bool { return p.Conns() == 2 })
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if n := p.Conns(); n != 0 {
		t.Fatalf("Conns %d after Close", n)
	}
	expectEnd(t, client, true)
	expectEnd(t, server, true)
	expectEnd(t, early, true)
	if c, err := net.DialTimeout("tcp", p.Addr(), kit.Patience); err == nil {
		c.Close()
		t.Fatal("a dial to a closed proxy succeeded")
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
}
