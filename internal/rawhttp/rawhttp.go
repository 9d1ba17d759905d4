// Package rawhttp is a minimal HTTP/1.1 client for load generation: one
// keep-alive connection per Conn, and session streams read without net/http's
// transport. A load generator on the same two cores as the server must cost
// less than the server.
package rawhttp

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"golang.org/x/net/http/httpguts"
)

// Dialer opens connections to a dlock server with its transport and
// credentials. The zero value dials plain http:// servers without a token.
type Dialer struct {
	// TLS is the TLS configuration of an https:// server (nil: the
	// system's roots and no client certificate).
	TLS *tls.Config
	// Token, when set, is sent as "Authorization: Bearer Token" on every
	// request.
	Token string
}

// dial connects to base ("http://host:port" or "https://host:port"),
// completing the TLS handshake of an https:// base, so that a refused
// certificate is an error here rather than on the first request.
func (d Dialer) dial(base string) (net.Conn, string, error) {
	u, addr, err := parseBase(base)
	if err != nil {
		return nil, "", err
	}
	// Without TCP keepalive, which Go's dialer sets with four system
	// calls a connection: a load generator's connections live for one
	// run, on loopback, and it must cost less than the server.
	c, err := (&net.Dialer{KeepAlive: -1}).Dial("tcp", addr)
	if err != nil {
		return nil, "", err
	}
	if u.Scheme == "http" {
		return c, u.Host, nil
	}
	cfg := &tls.Config{}
	if d.TLS != nil {
		cfg = d.TLS.Clone()
	}
	if cfg.ServerName == "" {
		cfg.ServerName = u.Hostname()
	}
	tc := tls.Client(c, cfg)
	if err := tc.Handshake(); err != nil {
		c.Close()
		return nil, "", fmt.Errorf("rawhttp: TLS handshake with %s: %w", addr, err)
	}
	return tc, u.Host, nil
}

// parseBase reads base, "http://host[:port]" or "https://host[:port]", and
// gives the host:port to dial.
func parseBase(base string) (u *url.URL, addr string, err error) {
	u, err = url.Parse(base)
	if err != nil || u.Host == "" || (u.Scheme != "http" && u.Scheme != "https") {
		return nil, "", fmt.Errorf("rawhttp: %q is not an http:// or https:// URL", base)
	}
	addr = u.Host
	if u.Port() == "" {
		addr = net.JoinHostPort(u.Hostname(), map[string]string{"http": "80", "https": "443"}[u.Scheme])
	}
	return u, addr, nil
}

// authLine is the Authorization header line of every request, "" without
// a token.
func (d Dialer) authLine() string {
	if d.Token == "" {
		return ""
	}
	return "Authorization: Bearer " + d.Token + "\r\n"
}

// Dial connects to a dlock server at base without credentials.
func Dial(base string) (*Conn, error) { return Dialer{}.Dial(base) }

// Subscribe opens node's session stream at base without credentials.
func Subscribe(base, node string) (*Stream, error) { return Dialer{}.Subscribe(base, node) }

// Conn is a minimal HTTP/1.1 keep-alive client for one connection: a load
// generator on the same two cores as the server must cost less than
// net/http's client, which spends more CPU than the server does.
type Conn struct {
	net.Conn
	host string
	auth string // the Authorization header line, or ""
	r    *bufio.Reader
	buf  []byte
	// Body is the last answer's body, valid until the next call.
	Body []byte
}

// Dial connects to a dlock server at base ("http://host:port" or
// "https://host:port").
func (d Dialer) Dial(base string) (*Conn, error) {
	c, host, err := d.dial(base)
	if err != nil {
		return nil, err
	}
	return &Conn{Conn: c, host: host, auth: d.authLine(), r: bufio.NewReaderSize(c, 8192)}, nil
}

// Post sends one POST and reads the answer; it returns the status code.
func (c *Conn) Post(path string, body []byte) (int, error) {
	return c.do("POST ", path, body, true)
}

// Get sends one GET (path with its query) and reads the answer; it
// returns the status code.
func (c *Conn) Get(path string) (int, error) {
	return c.do("GET ", path, nil, false)
}

func (c *Conn) do(method, path string, body []byte, hasBody bool) (int, error) {
	c.buf = append(c.buf[:0], method...)
	c.buf = append(c.buf, path...)
	c.buf = append(c.buf, " HTTP/1.1\r\nHost: "...)
	c.buf = append(c.buf, c.host...)
	c.buf = append(c.buf, "\r\n"...)
	c.buf = append(c.buf, c.auth...)
	if hasBody {
		c.buf = append(c.buf, "Content-Type: application/json\r\nContent-Length: "...)
		c.buf = strconv.AppendInt(c.buf, int64(len(body)), 10)
		c.buf = append(c.buf, "\r\n"...)
	}
	c.buf = append(c.buf, "\r\n"...)
	c.buf = append(c.buf, body...)
	if _, err := c.Write(c.buf); err != nil {
		return 0, err
	}
	return c.readAnswer()
}

func (c *Conn) readAnswer() (int, error) {
	line, err := c.r.ReadSlice('\n')
	if err != nil {
		return 0, err
	}
	if len(line) < 12 || !bytes.HasPrefix(line, []byte("HTTP/1.1 ")) {
		return 0, fmt.Errorf("bad status line %q", line)
	}
	status, err := strconv.Atoi(string(line[9:12]))
	if err != nil {
		return 0, fmt.Errorf("bad status line %q", line)
	}
	n := 0
	for {
		line, err := c.r.ReadSlice('\n')
		if err != nil {
			return 0, err
		}
		if len(line) <= 2 {
			break
		}
		if v, ok := bytes.CutPrefix(line, []byte("Content-Length: ")); ok {
			n, _ = strconv.Atoi(string(bytes.TrimSpace(v)))
		}
	}
	if cap(c.Body) < n {
		c.Body = make([]byte, n)
	}
	c.Body = c.Body[:n]
	_, err = ioReadFull(c.r, c.Body)
	return status, err
}

func ioReadFull(r *bufio.Reader, p []byte) (int, error) {
	n := 0
	for n < len(p) {
		m, err := r.Read(p[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// Stream is a node's session stream read over its own connection.
type Stream struct {
	conn net.Conn
	resp *http.Response // nil until Header, when head is set
	head []byte         // the answer's head, when the lean path read it
	r    *bufio.Reader
	ev   Event
}

// OpenSubscribe opens node's session stream: the connection and the 200
// answer, whose body is the stream.
func (d Dialer) OpenSubscribe(base, node string) (net.Conn, *http.Response, error) {
	c, br, err := d.request(base, node, "")
	if err != nil {
		return nil, nil, err
	}
	resp, err := streamAnswer(c, br)
	if err != nil {
		return nil, nil, err
	}
	return c, resp, nil
}

// streamAnswer reads the answer to a GET /subscribe from br with net/http:
// a 200, or an error, c closed.
func streamAnswer(c net.Conn, br *bufio.Reader) (*http.Response, error) {
	resp, err := http.ReadResponse(br, nil)
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("subscribe: %s", resp.Status)
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	return resp, nil
}

// streamBufSize is a stream's read buffer. The events dlock sends are a
// few hundred bytes; ReadEvent reads a longer line across reads. A load
// generator holds one buffer a node, and a page each (4 KiB) was a page
// fault each for 10,000 fresh nodes (docs/BENCHMARKS.md, "The load
// generator's share").
const streamBufSize = 512

// request dials base and sends node's GET /subscribe; the answer is to be
// read from the reader it returns.
func (d Dialer) request(base, node, lastEventID string) (net.Conn, *bufio.Reader, error) {
	c, host, err := d.dial(base)
	if err != nil {
		return nil, nil, err
	}
	req := appendRequest(make([]byte, 0, 256), host, node, lastEventID, d.authLine())
	if _, err := c.Write(req); err != nil {
		c.Close()
		return nil, nil, err
	}
	return c, bufio.NewReaderSize(c, streamBufSize), nil
}

// appendRequest appends node's GET /subscribe to host, with auth (an
// Authorization line, or "") and lastEventID (or "").
func appendRequest(req []byte, host, node, lastEventID, auth string) []byte {
	req = append(req, "GET /subscribe?node_id="...)
	req = append(req, url.QueryEscape(node)...)
	req = append(req, " HTTP/1.1\r\nHost: "...)
	req = append(req, host...)
	req = append(req, "\r\n"...)
	req = append(req, auth...)
	if lastEventID != "" {
		req = append(req, "Last-Event-ID: "+lastEventID+"\r\n"...)
	}
	return append(req, "\r\n"...)
}

// Subscribe opens node's session stream and reads up to its subscribed event.
func (d Dialer) Subscribe(base, node string) (*Stream, error) {
	return d.Resume(base, node, "")
}

// Resume reopens node's session stream with Last-Event-ID: lastEventID
// (docs/API.md, "GET /subscribe"), on any server of the service, and reads
// up to its subscribed event; the events after lastEventID follow it. An
// empty lastEventID opens the stream as Subscribe does.
func (d Dialer) Resume(base, node, lastEventID string) (*Stream, error) {
	c, br, err := d.request(base, node, lastEventID)
	if err != nil {
		return nil, err
	}
	s := &Stream{conn: c, r: br}
	if head, ok := peekHead(br); ok {
		// The usual answer: 200 and the stream unframed after it. Its
		// header is parsed only if asked for (Header).
		s.head = bytes.Clone(head)
		br.Discard(len(head))
	} else {
		resp, err := streamAnswer(c, br)
		if err != nil {
			return nil, err
		}
		s.resp = resp
		// A stream's body is the rest of the connection: read from br
		// itself, not through a second buffer, unless it is framed
		// (chunked).
		if len(resp.TransferEncoding) > 0 || resp.ContentLength >= 0 {
			s.r = bufio.NewReaderSize(resp.Body, streamBufSize)
		}
	}
	for {
		name, _, err := s.Next()
		if err != nil {
			s.Close()
			return nil, err
		}
		if name == "subscribed" {
			return s, nil
		}
	}
}

// peekHead waits for an answer's head in br and returns it (valid until
// br is read) if it is the answer a stream usually has: "HTTP/1.1 200", and header lines
// that say nothing of the body's framing, so the stream is the rest of the
// connection. It consumes nothing: for any other head (or one longer than
// br's buffer, or a read that fails) the caller reads the answer with
// net/http, which gives the reason. leanHead decides, held to
// http.ReadResponse by FuzzStreamHeadMatchesNetHTTP.
func peekHead(br *bufio.Reader) ([]byte, bool) {
	for want := 1; want <= br.Size(); {
		if _, err := br.Peek(want); err != nil {
			return nil, false
		}
		b, _ := br.Peek(br.Buffered())
		if n, complete, ok := leanHead(b); !ok {
			return nil, false
		} else if complete {
			return b[:n], true
		}
		want = len(b) + 1
	}
	return nil, false
}

// leanHead reads b, the start of an answer. With complete, the head is
// b[:n] (through its blank line) and ok says whether http.ReadResponse
// would read it as a 200 whose body is the rest of the connection; without
// it, ok says whether it still may. It accepts a strict subset of what
// net/http does: CRLF line ends, header names of token characters, values
// of visible ASCII, spaces and tabs, and no Content-Length,
// Transfer-Encoding or continuation lines.
func leanHead(b []byte) (n int, complete, ok bool) {
	const status = "HTTP/1.1 200 "
	line, rest, found := bytes.Cut(b, []byte("\r\n"))
	if !found {
		line = bytes.TrimSuffix(line, []byte("\r"))
		if len(line) < len(status) {
			return 0, false, strings.HasPrefix(status, string(line))
		}
		return 0, false, bytes.HasPrefix(line, []byte(status)) && visible(line[len(status):], false)
	}
	if !bytes.HasPrefix(line, []byte(status)) || !visible(line[len(status):], false) {
		return 0, false, false
	}
	n = len(line) + 2
	for {
		line, rest, found = bytes.Cut(rest, []byte("\r\n"))
		if !found {
			line = bytes.TrimSuffix(line, []byte("\r"))
			return 0, false, len(line) == 0 || headerLine(line, true)
		}
		n += len(line) + 2
		if len(line) == 0 {
			return n, true, true
		}
		if !headerLine(line, false) {
			return 0, false, false
		}
	}
}

// headerLine reports whether line is a header line leanHead takes: a name
// of token characters, a colon, a value of visible ASCII, spaces and tabs;
// not Content-Length nor Transfer-Encoding. With partial, line may be cut
// short anywhere.
func headerLine(line []byte, partial bool) bool {
	name, value, found := bytes.Cut(line, []byte(":"))
	if len(name) == 0 || !token(name) {
		return false
	}
	if !found {
		return partial
	}
	if bytes.EqualFold(name, []byte("Content-Length")) || bytes.EqualFold(name, []byte("Transfer-Encoding")) {
		return false
	}
	return visible(value, true)
}

// token reports whether b is all token characters (RFC 9110, 5.6.2).
func token(b []byte) bool {
	for _, c := range b {
		if !httpguts.IsTokenRune(rune(c)) {
			return false
		}
	}
	return true
}

// visible reports whether b is all visible ASCII and spaces (and tabs,
// with tabs).
func visible(b []byte, tabs bool) bool {
	for _, c := range b {
		if (c < 0x20 || c > 0x7e) && !(tabs && c == '\t') {
			return false
		}
	}
	return true
}

// Next returns the next event's name and data, skipping pings. data is
// valid until the next call.
func (s *Stream) Next() (name string, data []byte, err error) {
	if err := ReadEvent(s.r, &s.ev); err != nil {
		return "", nil, err
	}
	return s.ev.Name, s.ev.Data, nil
}

// Line reads the stream's next raw line, its "\n" included: pings and the
// blank lines that end events too. It is for a reader that counts what
// arrives (bench's pings scenario); line is valid until the next call.
func (s *Stream) Line() (line []byte, err error) {
	line, err = s.r.ReadSlice('\n')
	if errors.Is(err, bufio.ErrBufferFull) {
		return nil, fmt.Errorf("rawhttp: an event line over %d bytes", s.r.Size())
	}
	return line, err
}

// Header is the header of the stream's 200 answer (Dlock-Ping-Ms, …).
func (s *Stream) Header() http.Header {
	if s.resp == nil {
		// leanHead took the head only if net/http reads it
		// (FuzzStreamHeadMatchesNetHTTP): no error here.
		resp, err := http.ReadResponse(bufio.NewReader(bytes.NewReader(s.head)), nil)
		if err != nil {
			return http.Header{}
		}
		s.resp = resp
	}
	return s.resp.Header
}

// ID is the id of the last event Next returned ("" if it had none): what
// a reopened stream sends as Last-Event-ID.
func (s *Stream) ID() string { return s.ev.ID }

// SetReadDeadline bounds the wait of the next calls of Next.
func (s *Stream) SetReadDeadline(t time.Time) error { return s.conn.SetReadDeadline(t) }

// Close ends the stream.
func (s *Stream) Close() error { return s.conn.Close() }

// Event is one Server-Sent Event.
type Event struct {
	ID, Name string
	// Data is the event's data lines, joined by "\n". ReadEvent reuses
	// its array.
	Data []byte
	// Retry is the reconnection delay the event carried, "" if none.
	Retry string
	long  []byte // a line longer than the reader's buffer
}

// MaxEventLine bounds a line ReadEvent reads: a stream that sends a longer
// one is broken, not a reason to hold its bytes.
const MaxEventLine = 1 << 20

// ReadEvent reads the next event of a Server-Sent Events stream into ev,
// skipping comments (the server's pings). It is the one parser of the
// tests and the load generator. A line of another field than id, event,
// data and retry is an error: dlock's servers send no other, and a test
// must see a stray line rather than have it ignored.
func ReadEvent(r *bufio.Reader, ev *Event) error {
	ev.ID, ev.Name, ev.Retry, ev.Data = "", "", "", ev.Data[:0]
	fields, data := 0, 0
	for {
		line, err := r.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			// A line longer than r's buffer: gathered in ev's own.
			ev.long = append(ev.long[:0], line...)
			for errors.Is(err, bufio.ErrBufferFull) && len(ev.long) <= MaxEventLine {
				line, err = r.ReadSlice('\n')
				ev.long = append(ev.long, line...)
			}
			if len(ev.long) > MaxEventLine {
				return fmt.Errorf("rawhttp: an event line over %d bytes", MaxEventLine)
			}
			line = ev.long
		}
		if err != nil {
			return err
		}
		line = bytes.TrimSuffix(bytes.TrimSuffix(line, []byte("\n")), []byte("\r"))
		if len(line) == 0 {
			if fields > 0 {
				return nil
			}
			continue
		}
		field, value, ok := bytes.Cut(line, []byte(":"))
		if !ok {
			return fmt.Errorf("rawhttp: unexpected event stream line %q", line)
		}
		if len(field) == 0 {
			continue // a comment: a ping
		}
		value = bytes.TrimPrefix(value, []byte(" "))
		switch string(field) {
		case "id":
			ev.ID = string(value)
		case "event":
			ev.Name = string(value)
		case "retry":
			ev.Retry = string(value)
		case "data":
			if data > 0 {
				ev.Data = append(ev.Data, '\n')
			}
			ev.Data = append(ev.Data, value...)
			data++
		default:
			return fmt.Errorf("rawhttp: unexpected event stream line %q", line)
		}
		fields++
	}
}
