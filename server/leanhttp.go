package server

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/internal/auth"
	"golang.org/x/net/http/httpguts"
)

// The lean HTTP/1.1 loop. The hot requests — keep-alive POSTs to /lock,
// /unlock and /cancel with a small body — are answered here with next to no
// allocation; net/http's per-request work (header maps, request and
// response objects, two goroutines a connection) was the largest part of
// the server's CPU under load. The first request on a connection that the
// loop does not fully vouch for (another method or path, a header it does
// not understand, any framing net/http could read differently) passes the
// connection, with every byte already read from it, to net/http for the
// rest of its life. The loop answers no request that net/http would frame
// differently: FuzzLeanMatchesNetHTTP holds it to http.ReadRequest.

// The lean loop's buffers are pooled, as net/http's are: a connection that
// opens a stream gives its socket to the hub after one request, and on the
// etcd backend, where no event loop reads requests, each such connection
// allocated 8 KiB for that one request (docs/BENCHMARKS.md, "The lean
// loop's buffers, pooled"). A request's head and body are views of br,
// valid until it is answered (request.head), as an event loop's are of its
// one buffer.
var (
	leanReaders = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, leanBufSize) }}
	leanWriters = sync.Pool{New: func() any { return bufio.NewWriterSize(nil, leanBufSize) }}
)

// leanBufSize is the lean loop's read buffer: a request (head and body) that
// does not fit goes to net/http.
const leanBufSize = 4096

// leanConn is a connection served by the lean loop.
type leanConn struct {
	net.Conn
	idle atomic.Bool // waiting for the next request
	// peer is the client certificate of a TLS connection (auth.go).
	peer *auth.Peer
	// remote is the peer's address as accepted, for a connection an
	// event loop hands over or the raw accept loop passes on: it goes
	// through net.FileConn, which gives none for a socket whose peer
	// has reset it already.
	remote net.Addr
}

// RemoteAddr is the peer's address as accepted.
func (c *leanConn) RemoteAddr() net.Addr {
	if c.remote != nil {
		return c.remote
	}
	return c.Conn.RemoteAddr()
}

// addrOf is a for a log line; "?" for none.
func addrOf(a net.Addr) string {
	if a == nil {
		return "?"
	}
	return a.String()
}

// leanPaths are the paths the lean loop answers, all POSTs with a core
// (server.go); the values are the interned path strings.
var leanPaths = map[string]string{"/lock": "/lock", "/unlock": "/unlock", "/cancel": "/cancel"}

// handover is what a connection brings from the poller (poller.go) to the
// lean loop: bytes read and not yet answered, and an answer not all
// written, after which the connection closes when close is set.
type handover struct {
	in, out []byte
	close   bool
}

// serveLean runs the lean loop on one connection until it ends or is passed
// to net/http through pass.
func (s *Server) serveLean(lc *leanConn, pass *passListener, hs *http.Server, ho handover) {
	passed := false
	var br *bufio.Reader // nil until the loop serves requests
	var bw *bufio.Writer // nil until the loop serves requests
	serving := false     // a request was read and is not answered yet
	var rq request       // the request being served
	defer func() {
		if p := recover(); p != nil {
			// As net/http does: log, keep serving the others; this
			// connection's request gets an answer, and then it closes.
			// A stream that took the connection has it: no answer then.
			s.panicked(p, addrOf(lc.RemoteAddr()))
			if rq.took {
				passed = true
			} else if serving && bw != nil {
				s.answerPanic(lc, bw)
			}
			// Its buffers go to the collector, not back to the pools.
			br, bw = nil, nil
		}
		if !passed {
			lc.Close()
		}
		// Back to the pools, empty: what bw holds unwritten (a connection
		// that failed) is dropped.
		if br != nil {
			br.Reset(nil)
			leanReaders.Put(br)
		}
		if bw != nil {
			bw.Reset(nil)
			leanWriters.Put(bw)
		}
		s.trackLean(lc, false, false)
	}()
	if tc, ok := lc.Conn.(*tls.Conn); ok {
		h2, ok := s.handshake(lc, tc)
		if !ok {
			return
		}
		if h2 {
			// net/http serves HTTP/2, on the *tls.Conn itself.
			if lc.peer != nil {
				s.h2Peers.Store(tc, lc.peer)
			}
			if !pass.give(tc) {
				s.h2Peers.Delete(tc)
				return
			}
			passed = true
			return
		}
	}
	var src io.Reader = lc
	if len(ho.in) > 0 {
		src = &prefixReader{b: ho.in, r: lc}
	}
	br = leanReaders.Get().(*bufio.Reader)
	br.Reset(src)
	if len(ho.in) > 0 {
		// All of it in br at once, as passedConn expects.
		if _, err := br.Peek(len(ho.in)); err != nil {
			return
		}
	}
	bw = leanWriters.Get().(*bufio.Writer)
	bw.Reset(lc)
	if len(ho.out) > 0 {
		_ = lc.SetWriteDeadline(time.Now().Add(s.writeTimeout))
		if _, err := lc.Write(ho.out); err != nil {
			return
		}
	}
	if ho.close {
		closeAfterAnswer(lc.Conn)
		return
	}
	var scratch []byte
	idle := idleTimeout(hs)
	// Deadlines are moved at most once a second (stale): moving them per
	// request cost 5 % of the CPU under load. The read deadline bounds an
	// idle connection; once a request has begun and is not all there, it
	// is cut to the read timeout.
	var rdeadline, wdeadline time.Time
	// now is read once a request, when its answer is ready: the write
	// deadline runs from then, and the loop waits for the next request
	// right after, so the read deadline takes the same reading.
	now := time.Now()
	waiting := func() bool {
		// The answers bw holds for the requests before this one go out
		// before the loop waits for the rest of it: held, they waited on
		// a request the client may send only once it has them, and a read
		// timeout then closed the connection with those requests, which
		// had taken effect, unanswered (docs/DESIGN.md, "When a server
		// closes a connection").
		if bw.Flush() != nil {
			return false
		}
		rdeadline = time.Now().Add(s.readTimeout)
		_ = lc.SetReadDeadline(rdeadline)
		return true
	}
	for {
		// With bytes of a request read already (pipelined, or handed
		// over), the connection is not idle: a closing server answers
		// that request, with Connection: close, after the answers bw
		// holds for the ones before it. Returning here dropped them all
		// (docs/DESIGN.md, "When a server closes a connection").
		if br.Buffered() == 0 {
			lc.idle.Store(true)
			if s.closing.Load() {
				return // bw is empty: it is flushed whenever br is
			}
			if stale(rdeadline, now, idle) {
				rdeadline = now.Add(idle)
				_ = lc.SetReadDeadline(rdeadline)
			}
			if _, err := br.Peek(1); err != nil {
				return // closed, idle too long, or closing
			}
			lc.idle.Store(false)
		}
		serving = true
		req, st := peekRequest(br, waiting)
		switch st {
		case leanMore:
			return // the peer went away or was too slow mid-request
		case leanPass:
			if bw.Flush() != nil {
				return
			}
			// net/http sets its own deadlines, but only those it is
			// configured for: ours must not linger.
			_ = lc.SetDeadline(time.Time{})
			var pc net.Conn = &passedConn{Conn: lc.Conn, r: br, peer: lc.peer, remote: lc.RemoteAddr()}
			br = nil // net/http reads it now: not pooled
			if tc, ok := lc.Conn.(*tls.Conn); ok {
				pc = passedTLSConn{passedConn: pc.(*passedConn), tc: tc}
			}
			if !pass.give(pc) {
				// net/http takes no more: the server closes. The request
				// read is answered all the same, 503 unavailable with
				// Connection: close, not dropped with the connection
				// (docs/DESIGN.md, "When a server closes a connection").
				s.answerAndClose(lc, bw, api.ErrUnavailable)
				return
			}
			passed = true
			return
		}
		rq = request{method: http.MethodPost, path: req.path, head: req.head, body: req.body, conn: lc.Conn, peer: lc.peer}
		if req.stream {
			// The answers to the requests before it go out before the
			// stream's; a stream that opens has the connection.
			if bw.Flush() != nil {
				return
			}
			rq.method, rq.query, rq.take = http.MethodGet, req.query, &streamConn{conn: lc.Conn, fd: -1}
		}
		status, body := s.serveRequest(&rq, scratch[:0])
		if rq.took {
			passed = true
			return
		}
		// The write deadline runs from when the answer is ready, not from
		// when the request came: a backend call may wait on etcd for
		// longer than the write timeout, and its answer must still go out
		// (docs/DESIGN.md, "When a server closes a connection"). It is
		// kept ahead of every write, not only of the explicit flushes:
		// answers to pipelined requests fill bw, which then flushes by
		// itself, and a client that never reads must not block that write
		// for ever.
		if now = time.Now(); stale(wdeadline, now, s.writeTimeout) {
			wdeadline = now.Add(s.writeTimeout)
			_ = lc.SetWriteDeadline(wdeadline)
		}
		// A server that closes announces it on the answer, so that the
		// client sends nothing more on a connection about to close.
		closing := req.close || s.closing.Load()
		writeLeanAnswer(bw, status, body, s.epoch[0], closing)
		scratch = body[:0]
		_, _ = br.Discard(req.size)
		if br.Buffered() == 0 || closing { // pipelined requests share one write
			if bw.Flush() != nil {
				return
			}
		}
		if closing {
			closeAfterAnswer(lc.Conn)
			return
		}
		serving = false
	}
}

// answerPanic answers, with a 500 and Connection: close, the request whose
// handling panicked on a lean connection, after the answers bw holds for
// the requests before it, then closes the connection as closeAfterAnswer
// does. A second panic here only loses the answer.
func (s *Server) answerPanic(lc *leanConn, bw *bufio.Writer) {
	defer func() { _ = recover() }()
	s.answerAndClose(lc, bw, errPanicked)
}

// answerAndClose answers err, with Connection: close, after the answers bw
// holds, then closes the connection as closeAfterAnswer does.
func (s *Server) answerAndClose(lc *leanConn, bw *bufio.Writer, err error) {
	_ = lc.SetWriteDeadline(time.Now().Add(s.writeTimeout))
	status, body := s.errorAnswer(err, nil)
	writeLeanAnswer(bw, status, body, s.epoch[0], true)
	if bw.Flush() == nil {
		closeAfterAnswer(lc.Conn)
	}
}

// errPanicked is the error of a request whose handling panicked.
var errPanicked = errors.New("the server failed serving this request; it was logged")

// closeAfterAnswer ends a connection whose last answer said Connection:
// close. Closed with requests unread, the socket would send a reset, which
// can overtake the answer and make the client's kernel discard it: so
// half-close, and read what the client still sends until it closes, for
// half a second at most, as net/http does (docs/DESIGN.md, "When a server
// closes a connection"). The caller closes c.
func closeAfterAnswer(c net.Conn) {
	cw, ok := c.(interface{ CloseWrite() error })
	if !ok || cw.CloseWrite() != nil {
		return
	}
	_ = c.SetReadDeadline(time.Now().Add(closeLinger))
	var b [512]byte
	for {
		if _, err := c.Read(b[:]); err != nil {
			return
		}
	}
}

// closeLinger bounds closeAfterAnswer's wait for the client to close.
const closeLinger = 500 * time.Millisecond

// idleTimeout is how long a connection may wait between requests: hs's,
// or net/http's default in effect.
func idleTimeout(hs *http.Server) time.Duration {
	if hs.IdleTimeout > 0 {
		return hs.IdleTimeout
	}
	return 2 * time.Minute
}

// prefixReader reads b, then r.
type prefixReader struct {
	b []byte
	r io.Reader
}

func (p *prefixReader) Read(b []byte) (int, error) {
	if len(p.b) > 0 {
		n := copy(b, p.b)
		p.b = p.b[n:]
		return n, nil
	}
	return p.r.Read(b)
}

// stale reports whether a deadline d set for timeout should move on at
// now: when it would move by more than a second, or by half the timeout if
// that is less. A blocked read or write then ends between half and all of
// the timeout after it began.
func stale(d, now time.Time, timeout time.Duration) bool {
	return now.Add(timeout).Sub(d) > min(time.Second, timeout/2)
}

// writeLeanAnswer writes an answer into bw's free space, which it fits
// but for a large body: the head built in a local array escaped, an
// allocation per request.
func writeLeanAnswer(bw *bufio.Writer, status int, body []byte, epoch string, close bool) {
	_, _ = bw.Write(appendLeanAnswer(bw.AvailableBuffer(), status, body, epoch, close))
}

// appendLeanAnswer appends the whole HTTP answer, head and body, to b.
func appendLeanAnswer(b []byte, status int, body []byte, epoch string, close bool) []byte {
	b = append(b, "HTTP/1.1 "...)
	b = strconv.AppendInt(b, int64(status), 10)
	b = append(b, ' ')
	b = append(b, http.StatusText(status)...)
	b = append(b, "\r\nContent-Type: application/json\r\n"+api.EpochHeader+": "...)
	b = append(b, epoch...)
	if close {
		b = append(b, "\r\nConnection: close"...)
	}
	b = append(b, "\r\nContent-Length: "...)
	b = strconv.AppendInt(b, int64(len(body)), 10)
	if ra := api.RetryAfterStatus(status); ra > 0 {
		b = append(b, "\r\nRetry-After: "...)
		b = strconv.AppendInt(b, int64(ra), 10)
	}
	if status == http.StatusUnauthorized {
		b = append(b, "\r\nWWW-Authenticate: "+wwwAuthenticateValue...)
	}
	b = append(b, "\r\n\r\n"...)
	return append(b, body...)
}

// leanRequest is a request the lean loop answers. Its slices point into the
// reader's buffer: they are valid until the request is discarded.
type leanRequest struct {
	path  string
	head  []byte // request line and header lines, each ending in CRLF
	body  []byte
	size  int // bytes of the whole request
	close bool
	// stream marks a GET of /subscribe, whose answer is an event stream
	// (leanStream); query is its raw query, as net/http's URL.RawQuery.
	stream bool
	query  string
}

type leanStatus int

const (
	leanServe leanStatus = iota // a request the lean loop answers
	leanPass                    // anything else: net/http's
	leanMore                    // the request is not all there and the read failed
)

// peekRequest recognises a request the lean loop can answer, without
// consuming it. leanPass leaves every byte in br for net/http; leanMore
// means reading the rest of the request failed (the peer left, or the read
// deadline passed). waiting is called, at most once, before it blocks for
// more of the request; when it returns false, peekRequest reports leanMore
// without reading.
func peekRequest(br *bufio.Reader, waiting func() bool) (req leanRequest, st leanStatus) {
	var buf []byte
	end, from := -1, 0
	for {
		buf, _ = br.Peek(br.Buffered())
		var ok bool
		if end, ok = headEnd(buf, from); !ok {
			return req, leanPass
		}
		if end >= 0 {
			break
		}
		if len(buf) >= br.Size() {
			return req, leanPass // headers larger than the buffer
		}
		from = max(0, len(buf)-1)
		if waiting != nil {
			if !waiting() {
				return req, leanMore
			}
			waiting = nil
		}
		if _, err := br.Peek(len(buf) + 1); err != nil {
			return req, leanMore
		}
	}
	if req, st = leanFrame(buf, end, br.Size()); st != leanMore {
		return req, st
	}
	if waiting != nil && !waiting() {
		return req, leanMore
	}
	full, err := br.Peek(req.size)
	if err != nil {
		return req, leanMore
	}
	req.body = full[end:]
	return req, leanServe
}

// leanNext recognises a request at the start of b, the bytes read so far
// from a connection, by the rules of peekRequest with a buffer of
// leanBufSize; leanMore means that b does not hold all of it yet.
func leanNext(b []byte) (req leanRequest, st leanStatus) {
	end, ok := headEnd(b, 0)
	switch {
	case !ok:
		return req, leanPass
	case end >= 0:
		return leanFrame(b, end, leanBufSize)
	case len(b) >= leanBufSize:
		return req, leanPass // headers larger than the buffer
	}
	return req, leanMore
}

// leanFrame takes the request whose head, checked by headEnd, is b[:end],
// when the whole request fits in size bytes; leanMore means b does not hold
// all of its body yet.
func leanFrame(b []byte, end, size int) (req leanRequest, st leanStatus) {
	req, ok := parseHead(b[:end])
	if !ok || req.size > size {
		return req, leanPass
	}
	if len(b) < req.size {
		return req, leanMore
	}
	req.body = b[end:req.size]
	return req, leanServe
}

// headEnd returns the length of the request head at the start of b,
// through the blank line that ends it, or -1 when b does not hold all of it
// yet. ok is false when the head holds a byte the lean loop does not vouch
// for: an LF without a CR before it (net/http ends a line there, which could
// hide a header or end the head early), a CR without an LF after it, a
// control byte other than HTAB, DEL, or a byte outside ASCII. Bytes before
// from were checked already.
func headEnd(b []byte, from int) (end int, ok bool) {
	for i := from; i < len(b); i++ {
		if plainHeadByte[b[i]] {
			continue
		}
		switch c := b[i]; {
		case c == '\n':
			if i == 0 || b[i-1] != '\r' {
				return -1, false
			}
			if i >= 3 && b[i-2] == '\n' && b[i-3] == '\r' {
				return i + 1, true
			}
		case c == '\r':
			if i+1 < len(b) && b[i+1] != '\n' {
				return -1, false
			}
		default:
			return -1, false
		}
	}
	return -1, true
}

// plainHeadByte marks the bytes headEnd passes over: visible ASCII, SP
// and HTAB.
var plainHeadByte = func() (t [256]bool) {
	for c := ' '; c < 0x7f; c++ {
		t[c] = true
	}
	t['\t'] = true
	return t
}()

// parseHead reads a request head checked by headEnd. It takes only a
// request whose framing it fully knows and net/http would read alike (RFC
// 9112): the request line exactly "POST <lean path> HTTP/1.1", or "GET
// /subscribe?<query> HTTP/1.1" with a target net/http's url.ParseRequestURI
// takes; header names that are tokens, exactly one valid Host, exactly one
// Content-Length of digits only for a POST and none for a GET, at most one
// Authorization and one Last-Event-ID, Connection only close or
// keep-alive, and no Transfer-Encoding, Expect, Upgrade, Origin or
// Sec-Fetch-Site in any spelling.
func parseHead(head []byte) (req leanRequest, ok bool) {
	line, rest := cutLine(head)
	method, line, _ := bytes.Cut(line, []byte(" "))
	target, proto, _ := bytes.Cut(line, []byte(" "))
	if string(proto) != "HTTP/1.1" {
		return req, false
	}
	switch string(method) {
	case http.MethodPost:
		path, known := leanPaths[string(target)]
		if !known {
			return req, false
		}
		req.path = path
	case http.MethodGet:
		// The path exactly, unescaped; the query as net/http reads it.
		if p, _, _ := bytes.Cut(target, []byte("?")); string(p) != streamPath {
			return req, false
		}
		u, err := url.ParseRequestURI(string(target))
		if err != nil || u.Path != streamPath || u.RawPath != "" {
			return req, false
		}
		req.path, req.stream, req.query = streamPath, true, u.RawQuery
	default:
		return req, false
	}
	req.head = head[:len(head)-2]
	length, hosts, auths, lastIDs := -1, 0, 0, 0
	for {
		var h []byte
		h, rest = cutLine(rest)
		if len(h) == 0 {
			break // the blank line
		}
		colon := bytes.IndexByte(h, ':')
		if colon <= 0 || !isToken(h[:colon]) {
			return req, false // also a line folded onto the one before
		}
		name, value := h[:colon], trimOWS(h[colon+1:])
		switch {
		case asciiEqualFold(name, "content-length"):
			n, ok := parseDigits(value)
			if !ok || length >= 0 {
				return req, false
			}
			length = n
		case asciiEqualFold(name, "host"):
			hosts++
			if hosts > 1 || !httpguts.ValidHostHeader(string(value)) {
				return req, false
			}
		case asciiEqualFold(name, "authorization"):
			// Kept in req.head for the entry point; two would leave it
			// ambiguous which one a check read.
			if auths++; auths > 1 {
				return req, false
			}
		case asciiEqualFold(name, "last-event-id"):
			if lastIDs++; lastIDs > 1 {
				return req, false
			}
		case asciiEqualFold(name, "connection"):
			switch {
			case asciiEqualFold(value, "close"):
				req.close = true
			case asciiEqualFold(value, "keep-alive"):
			default:
				return req, false
			}
		case asciiEqualFold(name, "transfer-encoding"), asciiEqualFold(name, "expect"), asciiEqualFold(name, "upgrade"):
			return req, false
		case asciiEqualFold(name, "origin"), asciiEqualFold(name, "sec-fetch-site"):
			// A browser's request: net/http's reading of it is checked
			// for another site (crossSite).
			return req, false
		}
	}
	if hosts != 1 || (length < 0) != req.stream {
		return req, false
	}
	req.size = len(head) + max(length, 0)
	return req, true
}

// streamPath is the path of the event streams the lean loop opens.
const streamPath = "/subscribe"

// cutLine cuts the first line off a head checked by headEnd, in which
// every LF has a CR before it.
func cutLine(b []byte) (line, rest []byte) {
	i := bytes.IndexByte(b, '\n')
	if i < 1 {
		return b, nil
	}
	return b[:i-1], b[i+1:]
}

// leanHeader returns the value of the first header called name in a head
// parseHead took, OWS trimmed; nil when there is none.
func leanHeader(head []byte, name string) []byte {
	_, rest := cutLine(head)
	for len(rest) > 0 {
		var h []byte
		h, rest = cutLine(rest)
		if n, v, ok := bytes.Cut(h, []byte(":")); ok && asciiEqualFold(n, name) {
			return trimOWS(v)
		}
	}
	return nil
}

func isToken(b []byte) bool {
	for _, c := range b {
		if !httpguts.IsTokenRune(rune(c)) {
			return false
		}
	}
	return len(b) > 0
}

// trimOWS trims optional white space, which is SP and HTAB only (RFC 9110
// §5.6.3): a vertical tab or a non-ASCII space is not.
func trimOWS(b []byte) []byte {
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t') {
		b = b[1:]
	}
	for len(b) > 0 && (b[len(b)-1] == ' ' || b[len(b)-1] == '\t') {
		b = b[:len(b)-1]
	}
	return b
}

// parseDigits reads a Content-Length: ASCII digits only, no sign; more
// than 9 digits is more than the lean loop takes anyway.
func parseDigits(b []byte) (int, bool) {
	if len(b) == 0 || len(b) > 9 {
		return 0, false
	}
	n := 0
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int(c-'0')
	}
	return n, true
}

func asciiEqualFold(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := range b {
		if lowerASCII(b[i]) != lowerASCII(s[i]) {
			return false
		}
	}
	return true
}

func lowerASCII(c byte) byte {
	if 'A' <= c && c <= 'Z' {
		return c + 'a' - 'A'
	}
	return c
}

// passListener passes connections from the lean loop to net/http: it is
// the listener net/http's Serve accepts from.
type passListener struct {
	addr  net.Addr
	conns chan net.Conn
	once  sync.Once
	done  chan struct{}
}

func newPassListener(addr net.Addr) *passListener {
	return &passListener{addr: addr, conns: make(chan net.Conn), done: make(chan struct{})}
}

func (l *passListener) give(c net.Conn) bool {
	select {
	case l.conns <- c:
		return true
	case <-l.done:
		return false
	}
}

func (l *passListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *passListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *passListener) Addr() net.Addr { return l.addr }

// passedConn gives net/http the bytes the lean loop had read, then the rest.
type passedConn struct {
	net.Conn
	r      *bufio.Reader
	peer   *auth.Peer // the client certificate, over TLS
	remote net.Addr   // leanConn's
}

func (c *passedConn) RemoteAddr() net.Addr { return c.remote }

func (c *passedConn) Read(p []byte) (int, error) {
	if c.r != nil {
		if c.r.Buffered() > 0 {
			return c.r.Read(p)
		}
		c.r = nil
	}
	return c.Conn.Read(p)
}

// CloseWrite lets net/http close a connection as it does a TCP one: it
// half-closes and lets the client read the answer before the reset an
// unread request would cause.
func (c *passedConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// handshake runs the TLS handshake of a connection the lean loop took,
// within the read timeout, and reports whether ALPN chose h2. While it
// runs the connection counts as idle: a shutdown ends it at once.
func (s *Server) handshake(lc *leanConn, tc *tls.Conn) (h2, ok bool) {
	lc.idle.Store(true)
	defer lc.idle.Store(false)
	if s.closing.Load() {
		return false, false
	}
	_ = tc.SetDeadline(time.Now().Add(s.readTimeout))
	peer, err := s.certs.Handshake(context.Background(), tc)
	if err != nil {
		s.am.handshakeErrors.Inc()
		s.log.Debug("TLS handshake failed", "remote", addrOf(tc.RemoteAddr()), "err", err)
		return false, false
	}
	_ = tc.SetDeadline(time.Time{})
	lc.peer = peer
	return tc.ConnectionState().NegotiatedProtocol == "h2", true
}
