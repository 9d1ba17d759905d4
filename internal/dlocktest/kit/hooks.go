package kit

import (
	"bytes"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Hooks let a test act on its server's connections at a moment it chooses:
// kill them, as a network that fails does, or stall or refuse a node's
// session stream. Serve the server on Listen's listener. The zero value
// is ready; hooks outlive a listener, so a restarted server keeps them.
//
// A session stream is recognised by its request line as the server reads
// it (GET /subscribe?…node_id=N, or /lock/subscribe), whichever of the
// server's HTTP loops reads it. A stream without node_id (an observer)
// counts as node "".
//
// Over TLS the hooks see the connection's bytes before the server
// decrypts them: KillAll and Accepted work, the stream hooks see no
// stream.
type Hooks struct {
	mu      sync.Mutex
	conns   map[*hookConn]struct{}
	blocked map[string]chan struct{} // node → closed when its streams may go on
	refused map[string]bool
	opened  map[string]int // stream requests seen, per node
	accepts int            // connections accepted
}

// Listen wraps ln: the connections it accepts are under the hooks.
func (h *Hooks) Listen(ln net.Listener) net.Listener { return &hookListener{Listener: ln, h: h} }

// KillAll closes every connection the server has open, streams and
// keep-alive connections alike, and returns how many there were.
func (h *Hooks) KillAll() int {
	return h.kill(func(*hookConn) bool { return true })
}

// KillStreams closes node's session streams and returns how many there
// were: the node's client sees its stream break mid-wait.
func (h *Hooks) KillStreams(node string) int {
	return h.kill(func(c *hookConn) bool { return c.stream && c.node == node })
}

func (h *Hooks) kill(match func(*hookConn) bool) int {
	h.mu.Lock()
	var doomed []*hookConn
	for c := range h.conns {
		if match(c) {
			doomed = append(doomed, c)
		}
	}
	h.mu.Unlock()
	for _, c := range doomed {
		c.Close()
	}
	return len(doomed)
}

// BlockStreams stops delivery on node's session streams, open ones and
// those opened later, until release is called: the server's writes to
// them wait as on a network path that has stalled, and fail at the
// write deadline the server set, as they would there. The stream stays
// open and the server keeps the node's session.
func (h *Hooks) BlockStreams(node string) (release func()) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.blocked == nil {
		h.blocked = make(map[string]chan struct{})
	}
	gate, ok := h.blocked[node]
	if !ok {
		gate = make(chan struct{})
		h.blocked[node] = gate
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			h.mu.Lock()
			if h.blocked[node] == gate {
				delete(h.blocked, node)
			}
			h.mu.Unlock()
			close(gate)
		})
	}
}

// RefuseStreams makes node's new session streams fail until allow is
// called: a connection is closed as soon as the server has read a stream
// request of node on it, before any answer. Streams already open stay;
// KillStreams ends them.
func (h *Hooks) RefuseStreams(node string) (allow func()) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.refused == nil {
		h.refused = make(map[string]bool)
	}
	h.refused[node] = true
	return func() {
		h.mu.Lock()
		delete(h.refused, node)
		h.mu.Unlock()
	}
}

// StreamsOpened counts node's stream requests the server has read,
// refused ones included.
func (h *Hooks) StreamsOpened(node string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.opened[node]
}

// Accepted counts the connections the server has accepted, across
// listeners.
func (h *Hooks) Accepted() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.accepts
}

type hookListener struct {
	net.Listener
	h *Hooks
}

func (l *hookListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	hc := &hookConn{Conn: c, h: l.h, closed: make(chan struct{})}
	l.h.mu.Lock()
	if l.h.conns == nil {
		l.h.conns = make(map[*hookConn]struct{})
	}
	l.h.conns[hc] = struct{}{}
	l.h.accepts++
	l.h.mu.Unlock()
	return hc, nil
}

// hookConn is one server-side connection under the hooks.
type hookConn struct {
	net.Conn
	h      *Hooks
	closed chan struct{}
	once   sync.Once

	// Guarded by h.mu.
	line   []byte // the start of the line being read, while no stream is seen
	inHead bool   // reading a request's header lines
	length int64  // the Content-Length of the request being read
	body   int64  // the bytes of its body still to come
	stream bool
	node   string
	wdl    time.Time // the write deadline the server set
}

// maxLine bounds what a connection keeps of a line it reads: a request
// line the hooks look at is far shorter.
const maxLine = 8 << 10

func (c *hookConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 && c.sniff(p[:n]) {
		c.Close()
		return 0, net.ErrClosed
	}
	return n, err
}

// sniff follows the requests the server reads, by their request lines,
// Content-Length headers and bodies, until one is a stream's; it reports a
// stream the hooks refuse. A chunked body is not followed: the tests do
// not open a stream after one on a connection.
func (c *hookConn) sniff(b []byte) (refuse bool) {
	c.h.mu.Lock()
	defer c.h.mu.Unlock()
	for len(b) > 0 && !c.stream {
		if c.body > 0 {
			n := min(int64(len(b)), c.body)
			b, c.body = b[n:], c.body-n
			continue
		}
		i := bytes.IndexByte(b, '\n')
		if i < 0 {
			if len(c.line)+len(b) <= maxLine {
				c.line = append(c.line, b...)
			} else {
				c.line = c.line[:0] // too long to be a line that matters
			}
			return false
		}
		line := append(c.line, b[:i]...)
		b = b[i+1:]
		c.line = line[:0]
		line = bytes.TrimSuffix(line, []byte("\r"))
		switch {
		case c.inHead && len(line) == 0:
			c.inHead, c.body, c.length = false, c.length, 0
		case c.inHead:
			if k, v, ok := bytes.Cut(line, []byte(":")); ok && strings.EqualFold(string(bytes.TrimSpace(k)), "Content-Length") {
				c.length, _ = strconv.ParseInt(string(bytes.TrimSpace(v)), 10, 64)
			}
		case len(line) > 0:
			c.inHead = true
			if node, ok := streamRequest(line); ok {
				c.stream, c.node, c.line = true, node, nil
				if c.h.opened == nil {
					c.h.opened = make(map[string]int)
				}
				c.h.opened[node]++
				return c.h.refused[node]
			}
		}
	}
	return false
}

// streamRequest reads a request line of a session stream.
func streamRequest(line []byte) (node string, ok bool) {
	f := bytes.Fields(line)
	if len(f) != 3 || string(f[0]) != "GET" || !bytes.HasPrefix(f[2], []byte("HTTP/")) {
		return "", false
	}
	u, err := url.ParseRequestURI(string(f[1]))
	if err != nil || (u.Path != "/subscribe" && u.Path != "/lock/subscribe") {
		return "", false
	}
	return u.Query().Get("node_id"), true
}

// Write waits while the stream is blocked, then writes all of p.
func (c *hookConn) Write(p []byte) (int, error) {
	for {
		c.h.mu.Lock()
		var gate chan struct{}
		if c.stream {
			gate = c.h.blocked[c.node]
		}
		deadline := c.wdl
		c.h.mu.Unlock()
		if gate == nil {
			return c.Conn.Write(p)
		}
		if err := c.await(gate, deadline); err != nil {
			return 0, err
		}
	}
}

// await waits for a blocked stream's release, its close or its deadline.
func (c *hookConn) await(gate <-chan struct{}, deadline time.Time) error {
	var expired <-chan time.Time
	if !deadline.IsZero() {
		t := time.NewTimer(time.Until(deadline))
		defer t.Stop()
		expired = t.C
	}
	select {
	case <-gate:
		return nil
	case <-c.closed:
		return net.ErrClosed
	case <-expired:
		return os.ErrDeadlineExceeded
	}
}

func (c *hookConn) SetDeadline(t time.Time) error {
	c.h.mu.Lock()
	c.wdl = t
	c.h.mu.Unlock()
	return c.Conn.SetDeadline(t)
}

func (c *hookConn) SetWriteDeadline(t time.Time) error {
	c.h.mu.Lock()
	c.wdl = t
	c.h.mu.Unlock()
	return c.Conn.SetWriteDeadline(t)
}

func (c *hookConn) Close() error {
	c.once.Do(func() {
		close(c.closed)
		c.h.mu.Lock()
		delete(c.h.conns, c)
		c.h.mu.Unlock()
	})
	return c.Conn.Close()
}

// CloseWrite half-closes the connection as the TCP connection beneath does:
// the server relies on it to let a client read an answer before a close.
func (c *hookConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}
