package netfault

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Dir is a set of the directions of a proxied connection.
type Dir int

const (
	// ClientToServer is what the client that dialed the proxy sends.
	ClientToServer Dir = 1 << iota
	// ServerToClient is what the target sends back.
	ServerToClient
	// Both directions.
	Both = ClientToServer | ServerToClient
)

func (d Dir) String() string {
	switch d {
	case 0:
		return "none"
	case ClientToServer:
		return "client→server"
	case ServerToClient:
		return "server→client"
	case Both:
		return "both"
	}
	return fmt.Sprintf("Dir(%d)", int(d))
}

// Proxy forwards the TCP connections it accepts on 127.0.0.1 to a target
// address, and cuts or resets them when a test says so. Its faults apply
// to every connection, open or opened later, at once.
//
// A cut direction is neither read nor written: the proxy stops reading
// the sender's socket and stops writing the receiver's. Reading and
// dropping the bytes would be wrong: the sender's kernel would see every
// byte acknowledged and its window stay open, which no partition gives.
// Not reading lets the proxy's receive buffer and then the sender's send
// buffer fill, so that the sender's writes block, as on a path whose
// cable was pulled; nothing is closed, so no FIN and no RST crosses, and
// a FIN or a reset that comes while the direction is cut is held like a
// byte. A read or a write the proxy has under way when the cut comes is
// interrupted (by a deadline in the past), so that no byte crosses once
// Cut returns. The bytes held (the kernel's buffers, and at most one
// read's worth in the proxy) are delivered in order when the direction
// heals: after a partition ends, TCP delivers what was sent.
//
// A client that connects while ClientToServer is cut is accepted (the
// kernel completes the handshake, which a pulled cable would not), and the
// proxy dials the target only once that direction heals: the server sees
// no connection before.
type Proxy struct {
	target string
	ln     net.Listener

	mu      sync.Mutex
	cut     Dir
	changed chan struct{} // closed and replaced when cut shrinks
	conns   map[*pconn]struct{}
	closed  bool

	wg        sync.WaitGroup // the accept loop and every connection's goroutines
	closeOnce sync.Once
}

// pconn is one proxied connection.
type pconn struct {
	client *net.TCPConn
	done   chan struct{} // closed by abort

	// Guarded by Proxy.mu.
	server  *net.TCPConn // nil until dialed
	aborted bool
	cancel  context.CancelFunc // cancels the dial
}

// NewProxy starts a proxy on a free port of 127.0.0.1 that forwards to
// target; it is closed at t's cleanup.
func NewProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	return NewProxyAt(t, "127.0.0.1:0", target)
}

// NewProxyAt is NewProxy listening on listen, for a proxy that must keep
// an address (an etcd member's advertised URL, a server's restart).
func NewProxyAt(t testing.TB, listen, target string) *Proxy {
	t.Helper()
	p, err := ListenProxy(listen, target)
	if err != nil {
		t.Fatalf("netfault: %v", err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// ListenProxy is NewProxyAt for a program that is not a test (dlock
// bench): the caller closes the proxy.
func ListenProxy(listen, target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return nil, fmt.Errorf("proxy to %s: %w", target, err)
	}
	p := &Proxy{target: target, ln: ln, changed: make(chan struct{}), conns: make(map[*pconn]struct{})}
	p.wg.Add(1)
	go p.serve()
	return p, nil
}

// Addr is the address the proxy listens on, host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Target is the address the proxy forwards to.
func (p *Proxy) Target() string { return p.target }

// Blackhole cuts both directions: Cut(Both).
func (p *Proxy) Blackhole() { p.Cut(Both) }

// Cut stops forwarding in the directions of d, on every connection, until
// Heal. When it returns, no byte, FIN or reset crosses in d any more.
func (p *Proxy) Cut(d Dir) {
	if d&^Both != 0 {
		panic(fmt.Sprintf("netfault: Cut(%v)", d))
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut |= d
	past := time.Unix(1, 0)
	for c := range p.conns {
		// Interrupt what is under way; a pump that sees the cut
		// afterwards waits before its next read or write.
		if d&ClientToServer != 0 {
			_ = c.client.SetReadDeadline(past)
			if c.server != nil {
				_ = c.server.SetWriteDeadline(past)
			}
		}
		if d&ServerToClient != 0 {
			_ = c.client.SetWriteDeadline(past)
			if c.server != nil {
				_ = c.server.SetReadDeadline(past)
			}
		}
	}
}

// Heal forwards both directions again, the bytes held back first.
func (p *Proxy) Heal() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cut == 0 {
		return
	}
	p.cut = 0
	close(p.changed)
	p.changed = make(chan struct{})
}

// Cuts is the set of directions cut now.
func (p *Proxy) Cuts() Dir {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cut
}

// CloseAll resets every connection the proxy has: both the client and the
// server see a reset (RST), as when a middlebox on the path drops its
// state. It returns how many there were. The proxy goes on accepting.
func (p *Proxy) CloseAll() int {
	p.mu.Lock()
	doomed := make([]*pconn, 0, len(p.conns))
	for c := range p.conns {
		doomed = append(doomed, c)
	}
	p.mu.Unlock()
	for _, c := range doomed {
		p.abort(c)
	}
	return len(doomed)
}

// Conns counts the connections open through the proxy: accepted, and not
// yet closed on both sides or reset.
func (p *Proxy) Conns() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns)
}

// Close stops accepting, resets every connection and returns once every
// goroutine of the proxy has ended. It is idempotent.
func (p *Proxy) Close() error {
	p.closeOnce.Do(func() {
		p.mu.Lock()
		p.closed = true
		p.mu.Unlock()
		p.ln.Close()
		p.CloseAll()
		p.wg.Wait()
	})
	return nil
}

func (p *Proxy) serve() {
	defer p.wg.Done()
	for {
		nc, err := p.ln.Accept()
		if err != nil {
			// Closed, or a failure (descriptors exhausted) that the
			// tests would rather see as refused connections than
			// as a proxy that spins.
			return
		}
		c := &pconn{client: nc.(*net.TCPConn), done: make(chan struct{})}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			reset(c.client)
			return
		}
		p.conns[c] = struct{}{}
		p.wg.Add(1)
		p.mu.Unlock()
		go p.run(c)
	}
}

// run dials the target for c once the client's bytes may cross, and
// forwards until both directions end or c is reset.
func (p *Proxy) run(c *pconn) {
	defer p.wg.Done()
	defer p.forget(c)
	if !p.await(c, ClientToServer) {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	p.mu.Lock()
	if c.aborted {
		p.mu.Unlock()
		return
	}
	c.cancel = cancel
	p.mu.Unlock()
	// The socket resets when closed until the connection has ended
	// well (forget): a dial that CloseAll cancels just as it connects
	// is closed by the net package, and the server must see a reset
	// then too.
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		err := rc.Control(func(fd uintptr) {
			serr = syscall.SetsockoptLinger(int(fd), syscall.SOL_SOCKET, syscall.SO_LINGER, &syscall.Linger{Onoff: 1, Linger: 0})
		})
		return errors.Join(err, serr)
	}}
	nc, err := d.DialContext(ctx, "tcp", p.target)
	if err != nil {
		// The target refused or is gone: the client is reset, as a
		// refused SYN would end its dial.
		p.abort(c)
		return
	}
	s := nc.(*net.TCPConn)
	p.mu.Lock()
	if c.aborted {
		p.mu.Unlock()
		reset(s)
		return
	}
	c.server = s
	p.mu.Unlock()

	back := make(chan struct{})
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		defer close(back)
		p.pump(c, ServerToClient, s, c.client)
	}()
	p.pump(c, ClientToServer, c.client, s)
	<-back
}

// forget closes what c still has open and removes it from the proxy.
func (p *Proxy) forget(c *pconn) {
	p.mu.Lock()
	delete(p.conns, c)
	s := c.server
	if s != nil && !c.aborted {
		_ = s.SetLinger(-1) // ended well: a close, not a reset
	}
	p.mu.Unlock()
	c.client.Close()
	if s != nil {
		s.Close()
	}
}

// abort resets both sides of c and ends its goroutines' waits.
func (p *Proxy) abort(c *pconn) {
	p.mu.Lock()
	if c.aborted {
		p.mu.Unlock()
		return
	}
	c.aborted = true
	// SO_LINGER 0 (a close resets) is set before anything closes a
	// socket, so that the close in forget, which may come first once
	// done is closed, resets too.
	_ = c.client.SetLinger(0)
	s, cancel := c.server, c.cancel
	if s != nil {
		_ = s.SetLinger(0)
	}
	close(c.done)
	p.mu.Unlock()
	if cancel != nil {
		cancel()
	}
	c.client.Close()
	if s != nil {
		s.Close()
	}
}

// reset closes conn with an RST rather than a FIN.
func reset(conn *net.TCPConn) {
	_ = conn.SetLinger(0)
	conn.Close()
}

// await waits until d is not cut, and reports false if c was reset first.
func (p *Proxy) await(c *pconn, d Dir) bool {
	return p.awaitThen(c, d, nil)
}

// awaitThen is await, calling then (if not nil) under the lock once d is
// open: a cut that comes later sees what then did.
func (p *Proxy) awaitThen(c *pconn, d Dir, then func()) bool {
	for {
		p.mu.Lock()
		if c.aborted {
			p.mu.Unlock()
			return false
		}
		if p.cut&d == 0 {
			if then != nil {
				then()
			}
			p.mu.Unlock()
			return true
		}
		changed := p.changed
		p.mu.Unlock()
		select {
		case <-changed:
		case <-c.done:
			return false
		}
	}
}

// opposite is the other direction of d.
func opposite(d Dir) Dir { return Both &^ d }

// pump forwards d, from src to dst, while it is not cut.
func (p *Proxy) pump(c *pconn, d Dir, src, dst *net.TCPConn) {
	buf := make([]byte, 32<<10)
	for {
		// The read deadline is cleared under the lock, so that a Cut
		// either comes before (and the pump waits) or after (and its
		// deadline interrupts the read).
		if !p.awaitThen(c, d, func() { _ = src.SetReadDeadline(time.Time{}) }) {
			return
		}
		n, rerr := src.Read(buf)
		for b := buf[:n]; len(b) > 0; {
			if !p.awaitThen(c, d, func() { _ = dst.SetWriteDeadline(time.Time{}) }) {
				return
			}
			w, werr := dst.Write(b)
			b = b[w:]
			if werr != nil && !errors.Is(werr, os.ErrDeadlineExceeded) {
				// The receiver is gone: its reset travels back to
				// the sender, when that direction lets it.
				if p.await(c, opposite(d)) {
					p.abort(c)
				}
				return
			}
		}
		switch {
		case rerr == nil, errors.Is(rerr, os.ErrDeadlineExceeded):
		case errors.Is(rerr, io.EOF):
			// The sender's FIN crosses when d is open.
			if p.await(c, d) {
				_ = dst.CloseWrite()
			}
			return
		default:
			// A reset from the sender (or c reset here), which
			// crosses when d is open.
			if p.await(c, d) {
				p.abort(c)
			}
			return
		}
	}
}
