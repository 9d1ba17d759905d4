package server

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/dlock/dlock/api"
	"golang.org/x/sys/unix"
)

// Serve serves the API on ln: the lean loop (leanhttp.go) in front, and hs
// for every connection the lean loop passes on. hs.Handler should be s.
// Serve fills hs's zero ReadTimeout, ReadHeaderTimeout and WriteTimeout
// from the Options, so both loops bound reads and writes alike.
//
// Accept errors (EMFILE and ENFILE when file descriptors run out, ...) are
// retried with a back-off of 5 ms doubling to 1 s, as net/http's Serve
// does: a connection flood must not end the service and every lock with
// it. Past Options.MaxConns open connections, a new one is answered 503
// overloaded and closed.
func (s *Server) Serve(ln net.Listener, hs *http.Server) error {
	s.configure(hs)
	pass := newPassListener(ln.Addr())
	s.mu.Lock()
	if s.closing.Load() {
		s.mu.Unlock()
		return http.ErrServerClosed
	}
	s.passes = append(s.passes, pass)
	s.listeners = append(s.listeners, ln)
	s.https = append(s.https, hs)
	s.mu.Unlock()
	ka := listenerKeepAlive(ln)
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(pass) }()
	defer pass.Close()
	if l, lf := s.rawListener(ln, ka); l != nil {
		return s.serveRaw(l, lf, pass, hs, ka, errc)
	}
	var delay time.Duration
	for {
		c, err := ln.Accept()
		if err != nil {
			if err := s.ended(errc); err != nil {
				return err
			}
			if errors.Is(err, net.ErrClosed) {
				return err
			}
			if !s.backOff(&delay, err) {
				return http.ErrServerClosed
			}
			continue
		}
		delay = 0
		if s.maxConns > 0 && s.conns.Load() >= int64(s.maxConns) {
			s.refuse(c)
			continue
		}
		s.conns.Add(1)
		if p := s.pollerFor(c); p != nil && p.adopt(c, pass, hs, ka) {
			continue
		}
		var conn net.Conn = &trackedConn{Conn: c, open: &s.conns}
		if s.certs != nil {
			// The handshake runs in the connection's goroutine
			// (serveLean), never in this accept loop.
			conn = tls.Server(conn, s.certs.Config())
		}
		s.startConn(leanJob{lc: &leanConn{Conn: conn}, pass: pass, hs: hs}, false)
	}
}

// startConn serves j's connection, counted in s.conns, from a lean
// goroutine; handedOver as trackLean's. A server that closes takes it no
// more: it is closed.
func (s *Server) startConn(j leanJob, handedOver bool) {
	if !s.trackLean(j.lc, true, handedOver) {
		j.lc.Close()
		return
	}
	s.startLean(j)
}

// fileTCPConn is a connection of Go's netpoller on a duplicate of f's
// socket, with ka, the listener's keepalive (listenerKeepAlive): without
// it, net.FileConn gives the socket Go's.
func fileTCPConn(f *os.File, ka *net.KeepAliveConfig) (net.Conn, error) {
	c, err := fileConn(f)
	if err != nil {
		return nil, err
	}
	if tc, ok := c.(*net.TCPConn); ok && ka != nil {
		_ = tc.SetKeepAliveConfig(*ka)
	}
	return c, nil
}

// ended is why Serve ends, if it must: the server closed, or the
// net/http server behind it (errc) ended.
func (s *Server) ended(errc <-chan error) error {
	if s.closing.Load() {
		return http.ErrServerClosed
	}
	select {
	case err := <-errc:
		return err
	default:
		return nil
	}
}

// backOff counts and logs a failed accept, and waits delay, which it
// doubles from 5 ms to 1 s, before the next; false if the server closed
// meanwhile.
func (s *Server) backOff(delay *time.Duration, err error) bool {
	*delay = min(max(2**delay, 5*time.Millisecond), time.Second)
	s.metrics.acceptErrors.Inc()
	s.log.Warn("accept failed; retrying", "err", err, "delay", *delay)
	t := time.NewTimer(*delay)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-s.closed:
		return false
	}
}

// leanJob is a connection for the lean loop: a new one, or one an event
// loop hands over with ho's bytes (poller.handTo); or, with run, a
// stream's opening an event loop hands over (poller.openStream).
type leanJob struct {
	lc   *leanConn
	pass *passListener
	hs   *http.Server
	ho   handover
	run  func()
}

// maxLeanIdle bounds the lean goroutines kept waiting for a connection,
// and leanIdleTimeout how long one waits before it ends: what a burst of
// connections leaves behind goes once the burst is over.
const (
	maxLeanIdle     = 128
	leanIdleTimeout = 10 * time.Second
)

// startLean serves j's connection from a lean goroutine that waits for
// one, or a new one. A goroutine starts with a small stack that the
// backend's calls grow, copying it; on etcd, where every connection has a
// goroutine of its own (no event loop), that copying was 9 % of a profile
// of the server while it opened 10,000 streams (docs/BENCHMARKS.md, "Lean
// goroutines, reused"). A goroutine that served one connection keeps its
// grown stack for the next. The one that waited least takes it: handed
// out in turn, a steady trickle of connections would keep every waiting
// goroutine from its timeout.
func (s *Server) startLean(j leanJob) {
	s.leanMu.Lock()
	if n := len(s.leanWaiting); n > 0 {
		// The one that waited least: its stack is the likeliest to be
		// grown still, and those that wait longer end.
		w := s.leanWaiting[n-1]
		s.leanWaiting[n-1] = nil
		s.leanWaiting = s.leanWaiting[:n-1]
		s.leanMu.Unlock()
		w <- j // buffered, and it waits for it: never blocks
		return
	}
	s.leanMu.Unlock()
	// Counted while it lives: the connection's count (trackLean) is
	// held, so this Add never starts from zero while Close waits.
	s.leanWG.Add(1)
	s.leanWorkers.Add(1)
	go s.leanWorker(j)
}

// leanWorker serves j, then the connections startLean hands it, until
// the server closes or enough others wait.
func (s *Server) leanWorker(j leanJob) {
	defer s.leanWG.Done()
	defer s.leanWorkers.Add(-1)
	jobs := make(chan leanJob, 1)
	var idle *time.Timer
	for {
		if j.run != nil {
			j.run()
		} else {
			s.serveLean(j.lc, j.pass, j.hs, j.ho)
		}
		j = leanJob{}
		s.leanMu.Lock()
		if len(s.leanWaiting) >= maxLeanIdle || s.closing.Load() {
			s.leanMu.Unlock()
			return
		}
		s.leanWaiting = append(s.leanWaiting, jobs)
		s.leanMu.Unlock()
		if idle == nil {
			idle = time.NewTimer(s.leanIdleFor)
		} else {
			idle.Reset(s.leanIdleFor)
		}
		select {
		case j = <-jobs:
			idle.Stop()
			continue
		case <-idle.C:
		case <-s.closed:
			idle.Stop()
		}
		s.leanMu.Lock()
		i := slices.Index(s.leanWaiting, jobs)
		if i >= 0 {
			s.leanWaiting = slices.Delete(s.leanWaiting, i, i+1)
		}
		s.leanMu.Unlock()
		if i >= 0 {
			return
		}
		j = <-jobs // startLean took it as it ended: serve what it sent
	}
}

// configure fills hs's zero timeouts from the Options. An event stream
// outlives them: it takes its connection over (sse.go) and sets its own.
func (s *Server) configure(hs *http.Server) {
	if hs.ReadTimeout == 0 {
		hs.ReadTimeout = s.readTimeout
	}
	if hs.ReadHeaderTimeout == 0 {
		hs.ReadHeaderTimeout = hs.ReadTimeout
	}
	if hs.WriteTimeout == 0 {
		hs.WriteTimeout = s.writeTimeout
	}
	if s.mtls {
		hs.ConnContext = s.connContext(hs.ConnContext)
	}
}

// trackedConn is a connection counted in Server.conns from accept until it
// is closed, whoever serves it then: the lean loop, net/http, or an event
// stream that took it over (the hub's poller carries the count on with the
// socket it takes, hubpoll.go).
type trackedConn struct {
	net.Conn
	open *atomic.Int64
	once sync.Once
}

func (c *trackedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() { c.open.Add(-1) })
	return err
}

func (c *trackedConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// maxRefusing bounds the refused connections waiting for their client to
// read the 503; past it they are closed right after it is written.
const maxRefusing = 64

// refuse answers a connection over the limit with 503 overloaded and closes
// it. The answer is written before the request is read: an over-full
// server spends nothing on it. A client whose request arrives after our
// close would get a reset instead of the answer, so the close waits,
// briefly, for the client to finish as net/http does.
func (s *Server) refuse(c net.Conn) {
	s.metrics.refused.Inc()
	if s.certs != nil {
		// A plain-text answer means nothing to a TLS client, and a
		// handshake is the work an over-full server must not do.
		c.Close()
		return
	}
	_ = c.SetWriteDeadline(time.Now().Add(time.Second))
	if _, err := c.Write(s.overloaded); err != nil || s.refusing.Add(1) > maxRefusing {
		if err == nil {
			s.refusing.Add(-1)
		}
		c.Close()
		return
	}
	go func() {
		defer s.refusing.Add(-1)
		defer c.Close()
		if cw, ok := c.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		}
		_ = c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		var b [512]byte
		for {
			if _, err := c.Read(b[:]); err != nil {
				return
			}
		}
	}()
}

// overloadedAnswer is the whole HTTP answer to a refused connection.
func overloadedAnswer(epoch string) []byte {
	status, body := api.ErrorResponse(api.ErrOverloaded)
	b, err := jsonLine(body)
	if err != nil {
		panic(err) // a fixed value
	}
	h := fmt.Sprintf("HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n%s: %s\r\nRetry-After: %d\r\nConnection: close\r\nContent-Length: %d\r\n\r\n",
		status, http.StatusText(status), api.EpochHeader, epoch, api.RetryAfter(api.ErrOverloaded), len(b))
	return append([]byte(h), b...)
}

// panicked logs a panic in a request's handling, as net/http logs one.
func (s *Server) panicked(p any, remote string) {
	s.metrics.panics.Inc()
	s.log.Error("panic serving a request; its connection is closed", "remote", remote, "panic", p, "stack", string(debug.Stack()))
}

// trackLean adds lc to the lean connections, or takes it out (!add). A new
// connection is refused once the server closes. One the event loop hands
// over (handedOver) is not, until Shutdown's context ends: it may owe the
// answers to requests that took effect, or hold a request read and not
// answered yet, and closed at once it would lose them (docs/DESIGN.md,
// "When a server closes a connection"). The poller handing it over holds
// leanWG, so the Add below never starts from zero while Close waits.
func (s *Server) trackLean(lc *leanConn, add, handedOver bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !add {
		delete(s.leanConns, lc)
		s.leanWG.Done()
		return true
	}
	if s.closing.Load() && (!handedOver || s.forced) {
		return false
	}
	if s.leanConns == nil {
		s.leanConns = make(map[*leanConn]struct{})
	}
	s.leanConns[lc] = struct{}{}
	s.leanWG.Add(1)
	return true
}

// stopLean stops accepting: listeners close, idle lean connections close,
// and busy ones end after the request they serve.
func (s *Server) stopLean() {
	s.mu.Lock()
	if !s.closing.Swap(true) {
		close(s.closed)
	}
	for lc := range s.leanConns {
		if lc.idle.Load() {
			_ = lc.SetReadDeadline(time.Now())
		}
	}
	for _, p := range s.pollers {
		p.wake()
	}
	passes, lns := s.passes, s.listeners
	s.mu.Unlock()
	for _, ln := range lns {
		ln.Close()
	}
	for _, p := range passes {
		p.Close()
	}
}

// owe registers fd, a connection whose owed answers a goroutine of its
// own writes without a net.Conn (poller.handTo), for Shutdown to cut
// short when its context ends; false when it has already: write nothing.
func (s *Server) owe(fd int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.forced {
		return false
	}
	if s.owing == nil {
		s.owing = make(map[int]struct{})
	}
	s.owing[fd] = struct{}{}
	return true
}

// paid takes fd out of owing before it is closed: its number may be
// another file's after.
func (s *Server) paid(fd int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.owing, fd)
}

// Close stops Serve: its listeners close, idle lean connections close, and
// the others finish the request they serve first; it waits for them. Call
// it after Drain and before http.Server.Shutdown, which finishes the
// connections net/http serves. Shutdown does all of it within a deadline.
func (s *Server) Close() error {
	s.stopLean()
	s.leanWG.Wait()
	return nil
}

// Shutdown stops the server within ctx whatever clients do: /healthz
// answers 503, event streams end, listeners close, idle connections close
// and requests in progress may finish. When ctx ends first, every
// connection still open is closed (a client that sends half a request, or
// pipelines and never reads, cannot hold it) and ctx's error is returned.
func (s *Server) Shutdown(ctx context.Context) error {
	s.startDrain()
	s.stopLean()
	streams := make(chan struct{})
	go func() {
		s.openStreams.Wait()
		s.leanWG.Wait()
		close(streams)
	}()
	var err error
	select {
	case <-streams:
	case <-ctx.Done():
		err = ctx.Err()
		s.mu.Lock()
		s.forced = true
		for lc := range s.leanConns {
			lc.Close()
		}
		// A shut-down socket wakes the poll(2) its writer waits in,
		// and fails the writes and reads after it.
		for fd := range s.owing {
			_ = unix.Shutdown(fd, unix.SHUT_RDWR)
		}
		s.mu.Unlock()
		<-streams // they end at once, their connections closed
	}
	s.mu.Lock()
	https := s.https
	s.mu.Unlock()
	for _, hs := range https {
		if herr := hs.Shutdown(ctx); herr != nil {
			err = herr
			hs.Close()
		}
	}
	if err != nil {
		return fmt.Errorf("shutdown: connections closed unfinished: %w", err)
	}
	return nil
}

// pollerFor returns the event loop's poller (poller.go) for a connection
// of Go's Accept, or nil: without Options.EventLoop, over TLS (the lean
// loop reads through crypto/tls), or for a connection that is not plain
// TCP.
func (s *Server) pollerFor(c net.Conn) *poller {
	if _, ok := c.(*net.TCPConn); !ok || !s.eventLoop || s.certs != nil {
		return nil
	}
	return s.poller()
}

// poller returns an event loop's poller, in turn, or nil once the server
// closes or when epoll is not there to use. The pollers start when first
// asked for: one for every two CPUs, each one goroutine that serves many
// connections, which leaves CPU for the rest of the server and the system.
func (s *Server) poller() *poller {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pollers == nil && !s.closing.Load() {
		s.pollers = []*poller{}
		for range (runtime.GOMAXPROCS(0) + 1) / 2 {
			p := newPoller(s)
			if p == nil {
				s.log.Warn("no epoll: the event loop is off")
				break
			}
			s.pollers = append(s.pollers, p)
			s.leanWG.Add(1)
			go p.run()
		}
	}
	if len(s.pollers) == 0 {
		return nil
	}
	s.nextPoller++
	return s.pollers[s.nextPoller%len(s.pollers)]
}

// listenerKeepAlive is the TCP keepalive of ln's socket, which its accepted
// sockets inherit (Listen); nil when ln is not a socket or has none (Go's
// accept then set its default on each accepted socket, as net.FileConn
// does). net.FileConn sets Go's default keepalive on the socket it wraps,
// and an event loop's connection handed to the lean loop goes through it
// (poller.handTo), which then sets this one again: an idle connection
// whose peer vanished is noticed as Listen says, not after Go's two and a
// half minutes.
func listenerKeepAlive(ln net.Listener) *net.KeepAliveConfig {
	sc, ok := ln.(syscall.Conn)
	if !ok {
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	var on, idle, intvl, cnt int
	var gerr error
	if err := rc.Control(func(fd uintptr) {
		for _, o := range []struct {
			level, opt int
			v          *int
		}{
			{unix.SOL_SOCKET, unix.SO_KEEPALIVE, &on},
			{unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, &idle},
			{unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, &intvl},
			{unix.IPPROTO_TCP, unix.TCP_KEEPCNT, &cnt},
		} {
			if *o.v, gerr = unix.GetsockoptInt(int(fd), o.level, o.opt); gerr != nil {
				return
			}
		}
	}); err != nil || gerr != nil {
		return nil
	}
	if on == 0 {
		return nil
	}
	return &net.KeepAliveConfig{Enable: true, Idle: time.Duration(idle) * time.Second, Interval: time.Duration(intvl) * time.Second, Count: cnt}
}
