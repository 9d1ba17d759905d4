package server

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dlock/dlock/internal/wire"
)

// Serve serves the API on ln. The hot requests — keep-alive POSTs to /lock,
// /unlock and /cancel with a small body — are answered by a lean HTTP/1.1
// loop that allocates next to nothing; net/http's per-request work (header
// maps, request and response objects, two goroutines a connection) was the
// largest part of the server's CPU under load. The first request on a
// connection that the loop does not fully understand (any other method,
// path or header it cannot vouch for: Expect, Transfer-Encoding, a large
// body, ...) hands the connection, with everything already read from it,
// to hs for the rest of its life, so every other request gets net/http's
// complete HTTP. hs.Handler should be s.
func (s *Server) Serve(ln net.Listener, hs *http.Server) error {
	handoff := &handoffListener{addr: ln.Addr(), conns: make(chan net.Conn), done: make(chan struct{})}
	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		return http.ErrServerClosed
	}
	s.handoffs = append(s.handoffs, handoff)
	s.listeners = append(s.listeners, ln)
	s.mu.Unlock()
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(handoff) }()
	defer handoff.Close()
	for {
		c, err := ln.Accept()
		if err != nil {
			s.mu.Lock()
			closing := s.closing
			s.mu.Unlock()
			if closing {
				return http.ErrServerClosed
			}
			select {
			case err := <-errc:
				return err
			default:
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				time.Sleep(5 * time.Millisecond)
				continue
			}
			return err
		}
		fc := &fastConn{Conn: c}
		if !s.trackFast(fc, true) {
			c.Close()
			continue
		}
		go s.serveFast(fc, handoff, hs)
	}
}

// fastConn is a connection served by the lean loop.
type fastConn struct {
	net.Conn
	idle atomic.Bool // waiting for the next request
}

func (s *Server) trackFast(fc *fastConn, add bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !add {
		delete(s.fastConns, fc)
		s.fastWG.Done()
		return true
	}
	if s.closing {
		return false
	}
	if s.fastConns == nil {
		s.fastConns = make(map[*fastConn]struct{})
	}
	s.fastConns[fc] = struct{}{}
	s.fastWG.Add(1)
	return true
}

// Close stops Serve: its listeners close, idle lean connections close, and
// the others finish the request they serve first; it waits for them. Call
// it after Drain and before http.Server.Shutdown, which finishes the
// connections net/http serves.
func (s *Server) Close() error {
	s.mu.Lock()
	s.closing = true
	for fc := range s.fastConns {
		if fc.idle.Load() {
			_ = fc.SetReadDeadline(time.Now())
		}
	}
	hs, lns := s.handoffs, s.listeners
	s.mu.Unlock()
	for _, ln := range lns {
		ln.Close()
	}
	for _, h := range hs {
		h.Close()
	}
	s.fastWG.Wait()
	return nil
}

func (s *Server) serveFast(fc *fastConn, handoff *handoffListener, hs *http.Server) {
	handedOff := false
	defer func() {
		if !handedOff {
			fc.Close()
		}
		s.trackFast(fc, false)
	}()
	br := bufio.NewReaderSize(fc, 4096)
	bw := bufio.NewWriterSize(fc, 4096)
	var scratch []byte
	// One read deadline, moved at most once a second, bounds both an idle
	// connection and a slow request: moving it per request cost 5 % of the
	// CPU under load.
	timeout := hs.IdleTimeout
	if timeout <= 0 {
		timeout = 2 * time.Minute
	}
	var deadline time.Time
	for {
		fc.idle.Store(true)
		s.mu.Lock()
		closing := s.closing
		s.mu.Unlock()
		if closing {
			return
		}
		if now := time.Now(); now.Add(timeout).Sub(deadline) > time.Second {
			deadline = now.Add(timeout)
			_ = fc.SetReadDeadline(deadline)
		}
		if _, err := br.Peek(1); err != nil {
			return // closed, idle too long, or closing
		}
		fc.idle.Store(false)
		req, ok := peekRequest(br, func() {
			// The request did not come in one piece: bound the rest as
			// net/http bounds a request's headers.
			if hs.ReadHeaderTimeout > 0 {
				deadline = time.Now().Add(hs.ReadHeaderTimeout)
				_ = fc.SetReadDeadline(deadline)
			}
		})
		if !ok {
			if bw.Flush() != nil {
				return
			}
			_ = fc.SetReadDeadline(time.Time{}) // net/http sets its own
			if !handoff.give(&replayConn{Conn: fc.Conn, r: br}) {
				return
			}
			handedOff = true
			return
		}
		start := time.Now()
		status, body := s.fastHandle(req.path, req.body, scratch[:0])
		writeFastAnswer(bw, status, body, s.epoch[0])
		scratch = body[:0]
		s.fastLatency[req.path].Observe(time.Since(start).Seconds())
		_, _ = br.Discard(req.size)
		if br.Buffered() == 0 || req.close { // pipelined requests share one write
			if bw.Flush() != nil {
				return
			}
		}
		if req.close {
			return
		}
	}
}

// fastHandle answers a hot request into buf.
func (s *Server) fastHandle(path string, body, buf []byte) (int, []byte) {
	ctx := context.Background()
	switch path {
	case "/lock":
		return s.lockAnswer(ctx, body, buf)
	case "/unlock":
		return s.unlockAnswer(ctx, body, buf)
	default:
		return s.cancelAnswer(ctx, body, buf)
	}
}

func writeFastAnswer(bw *bufio.Writer, status int, body []byte, epoch string) {
	var h [256]byte
	b := append(h[:0], "HTTP/1.1 "...)
	b = strconv.AppendInt(b, int64(status), 10)
	b = append(b, ' ')
	b = append(b, http.StatusText(status)...)
	b = append(b, "\r\nContent-Type: application/json\r\n"+wire.EpochHeader+": "...)
	b = append(b, epoch...)
	b = append(b, "\r\nContent-Length: "...)
	b = strconv.AppendInt(b, int64(len(body)), 10)
	if ra := wire.RetryAfterStatus(status); ra > 0 {
		b = append(b, "\r\nRetry-After: "...)
		b = strconv.AppendInt(b, int64(ra), 10)
	}
	b = append(b, "\r\n\r\n"...)
	_, _ = bw.Write(b)
	_, _ = bw.Write(body)
}

type fastRequest struct {
	path  string
	body  []byte
	size  int // bytes of the whole request
	close bool
}

var fastPaths = map[string]string{"/lock": "/lock", "/unlock": "/unlock", "/cancel": "/cancel"}

// peekRequest recognises a request the lean loop can answer, without
// consuming it. ok=false leaves every byte in br for net/http. waiting is
// called before it blocks for more of the request.
func peekRequest(br *bufio.Reader, waiting func()) (req fastRequest, ok bool) {
	var buf []byte
	end := -1
	for {
		buf, _ = br.Peek(br.Buffered())
		if end = bytes.Index(buf, []byte("\r\n\r\n")); end >= 0 {
			break
		}
		if br.Buffered() >= br.Size() {
			return req, false // headers larger than the buffer
		}
		if waiting != nil {
			waiting()
			waiting = nil
		}
		if _, err := br.Peek(br.Buffered() + 1); err != nil {
			return req, false
		}
	}
	head := buf[:end+2]
	line, rest, _ := bytes.Cut(head, []byte("\r\n"))
	method, line, _ := bytes.Cut(line, []byte(" "))
	target, proto, _ := bytes.Cut(line, []byte(" "))
	path, known := fastPaths[string(target)]
	if string(method) != "POST" || !known || string(proto) != "HTTP/1.1" {
		return req, false
	}
	req.path = path
	length := -1
	for len(rest) > 0 {
		var h []byte
		h, rest, _ = bytes.Cut(rest, []byte("\r\n"))
		name, value, found := bytes.Cut(h, []byte(":"))
		if !found || len(name) == 0 || name[len(name)-1] == ' ' || h[0] == ' ' || h[0] == '\t' {
			return req, false
		}
		value = bytes.TrimSpace(value)
		switch {
		case asciiEqualFold(name, "content-length"):
			n, err := strconv.Atoi(string(value))
			if err != nil || n < 0 || length >= 0 {
				return req, false
			}
			length = n
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
		}
	}
	if length < 0 {
		return req, false
	}
	req.size = end + 4 + length
	if req.size > br.Size() {
		return req, false
	}
	if br.Buffered() < req.size && waiting != nil {
		waiting()
	}
	full, err := br.Peek(req.size)
	if err != nil {
		return req, false
	}
	req.body = full[end+4:]
	return req, true
}

func asciiEqualFold(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := range b {
		c := b[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != s[i] {
			return false
		}
	}
	return true
}

// handoffListener passes connections from the lean loop to net/http.
type handoffListener struct {
	addr  net.Addr
	conns chan net.Conn
	once  sync.Once
	done  chan struct{}
}

func (l *handoffListener) give(c net.Conn) bool {
	select {
	case l.conns <- c:
		return true
	case <-l.done:
		return false
	}
}

func (l *handoffListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *handoffListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *handoffListener) Addr() net.Addr { return l.addr }

// replayConn gives net/http the bytes the lean loop had read, then the rest.
type replayConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *replayConn) Read(p []byte) (int, error) {
	if c.r != nil {
		if c.r.Buffered() > 0 {
			return c.r.Read(p)
		}
		c.r = nil
	}
	return c.Conn.Read(p)
}
