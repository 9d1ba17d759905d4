package server

import (
	"encoding/binary"
	"net"
	"net/http"
	"os"
	"runtime"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The event loop (Options.EventLoop). Plain-TCP connections wait between
// requests in one epoll set, and one goroutine, a poller, reads, answers
// and writes for all of them, as Redis does. A connection with a goroutine
// of its own pays, per request, a read that returns EAGAIN and a park and
// wake-up in Go's netpoller, with the scheduler's work around them; the
// poller reads a connection only when epoll says it has a request. On a
// 2-core machine that was a third of the server's CPU per lock + unlock.
//
// A poller answers only what it read whole: requests the lean loop takes
// (leanNext, the same parser), and answers that one write takes. Anything
// else — half a request, a request the lean loop passes to net/http, an
// answer the client is slow to take, a panic — leaves the poller: the
// connection, with the bytes read and the answer not yet written, goes to
// a goroutine of its own in the lean loop (serveLean) for the rest of its
// life, where the read and write timeouts apply as before. So a poller
// never waits on a client, and a connection it holds is always between
// requests, under the idle timeout alone, which a sweep enforces.
//
// The poller calls the backend itself: a call that waited would hold up
// every connection of the poller. Hence the option, for backends that
// never wait. Without it a poller answers nothing: it holds the
// connections of the raw accept loop (accept.go) until their first
// request, opens streams, and hands every other request over.

// maxPollEvents is the most connections one epoll_wait returns.
const maxPollEvents = 256

// poller is one event loop and its connections.
type poller struct {
	s      *Server
	epfd   int
	wakefd int // an eventfd: stopLean wakes the loop with it
	start  time.Time

	mu sync.Mutex // guards conns, n, closed and every
	// conns are the connections by descriptor: a lookup per request is
	// an index, not a map's hash.
	conns  []*pollConn
	n      int  // connections in conns
	closed bool // epfd, wakefd and every connection are closed
	// every is the time between sweeps for idle connections: a quarter of
	// the shortest idle timeout, a second at most.
	every time.Duration
}

// pollConn is a connection a poller holds. Its descriptor is the poller's
// alone: Go's netpoller does not know it, or it would be woken by every
// request too.
type pollConn struct {
	fd     int
	remote net.Addr
	pass   *passListener
	hs     *http.Server
	ka     *net.KeepAliveConfig // the listener's (listenerKeepAlive)
	idle   time.Duration        // the idle timeout
	last   time.Duration        // since poller.start: its last request
}

func (c *pollConn) RemoteAddr() net.Addr { return c.remote }

// newPoller opens a poller; nil when epoll is not there to use.
func newPoller(s *Server) *poller {
	epfd, wakefd, ok := openEpoll()
	if !ok {
		return nil
	}
	return &poller{s: s, epfd: epfd, wakefd: wakefd, start: time.Now(), every: time.Second}
}

// dupFD is a duplicate of tc's descriptor (close-on-exec), which outlives
// tc's close; ok false when tc is closed already.
func dupFD(tc *net.TCPConn) (int, bool) {
	raw, err := tc.SyscallConn()
	if err != nil {
		return -1, false
	}
	fd := -1
	if cerr := raw.Control(func(s uintptr) {
		fd, err = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 0)
	}); cerr != nil || err != nil {
		return -1, false
	}
	return fd, true
}

// openEpoll opens an epoll set with an eventfd in it, which a write to
// wakes; ok false when either cannot be had (nothing is left open).
func openEpoll() (epfd, wakefd int, ok bool) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return -1, -1, false
	}
	wakefd, err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		unix.Close(epfd)
		return -1, -1, false
	}
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(wakefd)}
	if err := unix.EpollCtl(epfd, unix.EPOLL_CTL_ADD, wakefd, &ev); err != nil {
		unix.Close(epfd)
		unix.Close(wakefd)
		return -1, -1, false
	}
	return epfd, wakefd, true
}

// adopt takes a new plain-TCP connection into the poller, or reports
// false and leaves c as it was. An adopted c is closed: the poller keeps a
// duplicate of its descriptor, outside Go's netpoller.
func (p *poller) adopt(c net.Conn, pass *passListener, hs *http.Server, ka *net.KeepAliveConfig) bool {
	tc, ok := c.(*net.TCPConn)
	p.mu.Lock()
	closed := p.closed // after an epoll_wait failure: serve c without it
	p.mu.Unlock()
	if !ok || closed {
		return false
	}
	fd, ok := dupFD(tc)
	if !ok {
		return false
	}
	if !p.adoptFD(fd, tc.RemoteAddr(), pass, hs, ka) {
		unix.Close(fd)
		return false
	}
	tc.Close() // the socket stays open through fd
	return true
}

// adoptFD takes the non-blocking descriptor fd of a new connection from
// remote into the poller, or reports false and leaves fd open: a poller
// closed since just now, or an epoll set that takes no more (ENOSPC at
// max_user_watches, ENOMEM).
func (p *poller) adoptFD(fd int, remote net.Addr, pass *passListener, hs *http.Server, ka *net.KeepAliveConfig) bool {
	pc := &pollConn{fd: fd, remote: remote, pass: pass, hs: hs, ka: ka, idle: idleTimeout(hs)}
	p.mu.Lock()
	defer p.mu.Unlock()
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)}
	if p.closed || unix.EpollCtl(p.epfd, unix.EPOLL_CTL_ADD, fd, &ev) != nil {
		return false
	}
	pc.last = time.Since(p.start)
	if fd >= len(p.conns) {
		p.conns = append(p.conns, make([]*pollConn, fd+1-len(p.conns))...)
	}
	p.conns[fd] = pc
	p.n++
	p.every = min(p.every, max(pc.idle/4, time.Millisecond))
	return true
}

// wake makes the loop look at s.closing.
func (p *poller) wake() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.closed {
		var one [8]byte
		binary.NativeEndian.PutUint64(one[:], 1)
		_, _ = unix.Write(p.wakefd, one[:])
	}
}

// run is the event loop. It returns when the server closes, closing every
// connection it holds: they are all between requests.
func (p *poller) run() {
	defer p.s.leanWG.Done()
	events := make([]unix.EpollEvent, maxPollEvents)
	buf := make([]byte, leanBufSize)
	var out, scratch []byte
	var swept, yielded time.Duration
	for {
		p.mu.Lock()
		nextSweep := swept + p.every
		p.mu.Unlock()
		wait := int(max(nextSweep-time.Since(p.start), 0)/time.Millisecond) + 1
		n, err := unix.EpollWait(p.epfd, events, wait)
		if err != nil && err != unix.EINTR {
			p.s.log.Error("epoll_wait failed; the event loop's connections are closed", "err", err)
			// EBADF: the epoll descriptor is not ours any more, and its
			// number may be another file's now.
			p.closeAll(err != unix.EBADF)
			return
		}
		now := time.Since(p.start)
		if p.s.closing.Load() {
			p.serveArrived(events, buf, now)
			p.closeAll(true)
			return
		}
		out, scratch = p.serveReady(events[:max(n, 0)], now, buf, out, scratch)
		if now >= nextSweep {
			swept = now
			p.sweep(now)
		}
		// A goroutine that never passes through the scheduler looks to
		// the runtime's sysmon like one that runs for ever: every 10 ms it
		// takes the P away mid-syscall and then polls every 20 µs for a
		// while, which cost 10 % of the CPU. A yield now and then tells it
		// otherwise; one per batch would wake another thread each time.
		if now-yielded >= 5*time.Millisecond {
			yielded = now
			runtime.Gosched()
		}
	}
}

// serveArrived serves, as the server closes, the connections whose
// requests have arrived: they are not between requests, and closed
// unread they would get a reset for an answer (docs/DESIGN.md, "When a
// server closes a connection"). Without Options.EventLoop every new
// connection waits here for its first request. Each one served leaves the
// loop (answered with Connection: close, or handed over, which a closing
// server still takes), so a few rounds see them all.
func (p *poller) serveArrived(events []unix.EpollEvent, buf []byte, now time.Duration) {
	var out, scratch []byte
	for range 64 {
		n, err := unix.EpollWait(p.epfd, events, 0)
		if err != nil || n == 0 {
			return
		}
		out, scratch = p.serveReady(events[:n], now, buf, out, scratch)
		if n < len(events) {
			return
		}
	}
}

// serveReady serves the connections epoll reported in events. out and
// scratch are the loop's buffers, returned for the next round.
func (p *poller) serveReady(events []unix.EpollEvent, now time.Duration, buf, out, scratch []byte) (_, _ []byte) {
	for _, ev := range events {
		p.mu.Lock()
		pc := p.get(int(ev.Fd))
		p.mu.Unlock()
		if pc == nil {
			continue // the eventfd, or a connection closed in this batch
		}
		pc.last = now
		out, scratch = p.serve(pc, buf, out[:0], scratch[:0])
	}
	return out, scratch
}

// serve reads what one connection sent and answers it. out and scratch
// are the loop's buffers, returned for the next connection.
func (p *poller) serve(pc *pollConn, buf, out, scratch []byte) (_, _ []byte) {
	written := false
	defer func() {
		if r := recover(); r != nil {
			// As net/http does: log, keep serving the others. This
			// connection's request gets an answer, after those of the
			// requests before it, and then the connection closes
			// (closeAfterAnswer, in the lean loop).
			p.s.panicked(r, pc.remote.String())
			if written {
				p.drop(pc)
				return
			}
			status, body := p.s.errorAnswer(errPanicked, nil)
			p.handOver(pc, handover{out: appendLeanAnswer(out, status, body, p.s.epoch[0], true), close: true})
		}
	}()
	n, err := rawIO(unix.SYS_READ, pc.fd, buf)
	if err == unix.EAGAIN || err == unix.EINTR {
		return out, scratch
	}
	if n <= 0 {
		p.drop(pc) // the client closed, or the connection broke
		return out, scratch
	}
	data := buf[:n]
	closing := false
	var stream leanRequest
	for len(data) > 0 && !closing {
		req, st := leanNext(data)
		if st != leanServe {
			break
		}
		if req.stream {
			stream = req // its socket goes to the hub (openStream)
			break
		}
		if !p.s.eventLoop {
			break // the backend's calls may wait: the lean loop runs them
		}
		rq := request{method: http.MethodPost, path: req.path, head: req.head, body: req.body, conn: pc}
		status, body := p.s.serveRequest(&rq, scratch)
		// A server that closes announces it (serveLean).
		closing = req.close || p.s.closing.Load()
		out = appendLeanAnswer(out, status, body, p.s.epoch[0], closing)
		scratch = body[:0]
		data = data[req.size:]
	}
	if closing {
		data = nil // what follows a Connection: close is not read
	}
	w := 0
	written = true
	if len(out) > 0 {
		w, err = rawIO(unix.SYS_WRITE, pc.fd, out)
		if err != nil && err != unix.EAGAIN && err != unix.EINTR {
			p.drop(pc)
			return out, scratch
		}
		w = max(w, 0)
	}
	switch {
	case w < len(out) || (len(data) > 0 && !stream.stream):
		p.handOver(pc, handover{in: data, out: out[w:], close: closing})
	case stream.stream:
		p.openStream(pc, stream, data)
	case closing:
		// Closed at once, the socket could reset the answer away when
		// the client has sent more: closeAfterAnswer, in the lean loop.
		p.handOver(pc, handover{close: true})
	}
	return out, scratch
}

// openStream opens the event stream of req, a /subscribe at the start of
// data, the bytes read from pc and not answered, all earlier answers
// written: a lean goroutine opens it (the backend may wait, and the loop
// never does) and gives the hub pc's socket itself. Handed over to
// the lean loop, the socket went through a connection of Go's netpoller,
// which the hub then took it out of again: a third of the system calls of
// a session's opening (docs/DESIGN.md, "Event streams"). A stream that
// does not open is answered from the lean loop, which serves what follows.
func (p *poller) openStream(pc *pollConn, req leanRequest, data []byte) {
	if !p.remove(pc) {
		return
	}
	req.head = clone(req.head) // they are the loop's buffers
	rest := clone(data[req.size:])
	// A lean goroutine, reused as the lean loop's are (startLean): it
	// grew its stack on a stream's opening already.
	p.s.startLean(leanJob{run: func() { p.serveStream(pc, req, rest) }})
}

// serveStream opens the stream of req, read from pc, whose socket the
// poller let go of; rest is what pc sent after req.
func (p *poller) serveStream(pc *pollConn, req leanRequest, rest []byte) {
	s := p.s
	var ho handover
	rq := request{method: http.MethodGet, path: req.path, head: req.head, conn: pc, query: req.query, take: &streamConn{fd: pc.fd}}
	func() {
		defer func() {
			if r := recover(); r != nil {
				s.panicked(r, pc.remote.String())
				if rq.took {
					return // the socket is the hub's, or closed
				}
				status, body := s.errorAnswer(errPanicked, nil)
				ho = handover{out: appendLeanAnswer(nil, status, body, s.epoch[0], true), close: true}
			}
		}()
		status, body := s.serveRequest(&rq, nil)
		if rq.took {
			return
		}
		closing := req.close || s.closing.Load()
		ho = handover{in: rest, out: appendLeanAnswer(nil, status, body, s.epoch[0], closing), close: closing}
	}()
	if ho.out != nil {
		p.handTo(pc, ho)
	}
}

// handOver moves a connection from the poller to a goroutine of the lean
// loop (startLean) for the rest of its life, with ho's bytes.
func (p *poller) handOver(pc *pollConn, ho handover) {
	if !p.remove(pc) {
		return
	}
	ho.in, ho.out = clone(ho.in), clone(ho.out) // they are the loop's buffers
	p.handTo(pc, ho)
}

// handTo is handOver for pc, out of the poller already, with ho's bytes
// its own.
func (p *poller) handTo(pc *pollConn, ho handover) {
	f := os.NewFile(uintptr(pc.fd), "")
	c, err := fileTCPConn(f, pc.ka)
	if err != nil {
		// No descriptor to spare (EMFILE) for the duplicate. The requests
		// whose answers are in ho.out have run: those answers still go
		// out, through f, within the write timeout, from a goroutine of
		// their own; then the connection closes. A request read and not
		// run (ho.in: without Options.EventLoop, every connection's
		// first) is answered 503 overloaded, which the client may retry,
		// rather than dropped unanswered.
		p.s.log.Warn("an event loop could not hand a connection over; it is closed after the answers it owes", "remote", pc.remote.String(), "err", err)
		if len(ho.in) > 0 && !ho.close {
			p.s.metrics.refused.Inc()
			ho.out = append(ho.out, p.s.overloaded...)
		}
		p.s.leanWG.Add(1) // the loop holds one: never from zero
		owed := p.s.owe(pc.fd)
		go func() {
			defer p.s.leanWG.Done()
			if rc, err := f.SyscallConn(); err == nil && len(ho.out) > 0 && owed {
				_ = rc.Write(func(fd uintptr) bool {
					writeOwed(int(fd), ho.out, time.Now().Add(p.s.writeTimeout))
					return true
				})
				// Closed with requests unread, the socket would send a
				// reset, which can overtake the answers: half-close, and
				// read what the client still sends for closeLinger first,
				// as net/http does before it closes.
				_ = rc.Read(func(fd uintptr) bool {
					_ = unix.Shutdown(int(fd), unix.SHUT_WR)
					drainFor(int(fd), time.Now().Add(closeLinger))
					return true
				})
			}
			p.s.paid(pc.fd)
			f.Close()
			p.s.conns.Add(-1)
		}()
		return
	}
	f.Close()
	lc := &leanConn{Conn: &trackedConn{Conn: c, open: &p.s.conns}, remote: pc.remote}
	p.s.startConn(leanJob{lc: lc, pass: pc.pass, hs: pc.hs, ho: ho}, true)
}

// writeOwed writes b to the non-blocking descriptor fd, waiting in
// poll(2) while the socket is full, until deadline at the latest.
func writeOwed(fd int, b []byte, deadline time.Time) {
	for len(b) > 0 {
		n, err := unix.Write(fd, b)
		switch {
		case err == unix.EINTR:
		case err == unix.EAGAIN:
			if !pollUntil(fd, unix.POLLOUT, deadline) {
				return
			}
		case err != nil:
			return
		default:
			b = b[n:]
		}
	}
}

// pollUntil waits in poll(2) for events on fd, until deadline at the
// latest; false when the deadline passed or poll failed.
func pollUntil(fd int, events int16, deadline time.Time) bool {
	left := time.Until(deadline)
	if left <= 0 {
		return false
	}
	pfd := []unix.PollFd{{Fd: int32(fd), Events: events}}
	_, err := unix.Poll(pfd, int(left/time.Millisecond)+1)
	return err == nil || err == unix.EINTR
}

// drainFor reads and drops what arrives on the non-blocking descriptor fd
// until the peer closes or deadline.
func drainFor(fd int, deadline time.Time) {
	var b [4096]byte
	for {
		n, err := unix.Read(fd, b[:])
		switch {
		case err == unix.EINTR:
		case err == unix.EAGAIN:
			if !pollUntil(fd, unix.POLLIN, deadline) {
				return
			}
		case err != nil || n == 0:
			return
		}
	}
}

// fileConn is net.FileConn; tests make it fail as it does without a spare
// descriptor.
var fileConn = net.FileConn

// rawIO is read or write (trap) on a connection's non-blocking descriptor
// without telling the scheduler, as syscall.Read and Write do, that it
// may block: it never does, and the telling and its undoing
// (entersyscall, exitsyscall) were 3 % of the CPU of a request.
func rawIO(trap uintptr, fd int, b []byte) (int, error) {
	n, _, e := syscall.RawSyscall(trap, uintptr(fd), uintptr(unsafe.Pointer(unsafe.SliceData(b))), uintptr(len(b)))
	if e != 0 {
		return -1, e
	}
	return int(n), nil
}

func clone(b []byte) []byte {
	if len(b) == 0 {
		return nil
	}
	return append([]byte(nil), b...)
}

// get returns the connection with descriptor fd, or nil. p.mu is held.
func (p *poller) get(fd int) *pollConn {
	if fd < 0 || fd >= len(p.conns) {
		return nil
	}
	return p.conns[fd]
}

// forget takes pc out of conns if it is there. p.mu is held.
func (p *poller) forget(pc *pollConn) bool {
	if p.get(pc.fd) != pc {
		return false
	}
	p.conns[pc.fd] = nil
	p.n--
	return true
}

// remove takes pc out of the poller, its descriptor still open; false if
// it was not there (closed already).
func (p *poller) remove(pc *pollConn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.forget(pc) {
		return false
	}
	_ = unix.EpollCtl(p.epfd, unix.EPOLL_CTL_DEL, pc.fd, nil)
	return true
}

// drop closes a connection the poller holds.
func (p *poller) drop(pc *pollConn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.forget(pc) {
		p.closeFD(pc)
	}
}

// closeFD takes pc's descriptor out of the epoll set and closes it. The
// close alone would leave it in the set if a copy of the socket were open
// elsewhere (a child forked just then), and the set would report a number
// that a new connection may get. p.mu is held: no new connection has the
// descriptor's number before it is out of conns.
func (p *poller) closeFD(pc *pollConn) {
	_ = unix.EpollCtl(p.epfd, unix.EPOLL_CTL_DEL, pc.fd, nil)
	unix.Close(pc.fd)
	p.s.conns.Add(-1)
}

// sweep closes the connections idle for their idle timeout.
func (p *poller) sweep(now time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, pc := range p.conns {
		if pc != nil && now-pc.last >= pc.idle {
			p.forget(pc)
			p.closeFD(pc)
		}
	}
}

// closeAll closes every connection and the poller itself; its epoll
// descriptor too unless ownEpoll is false.
func (p *poller) closeAll(ownEpoll bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	if !ownEpoll {
		p.epfd = -1 // closeFD's EPOLL_CTL_DEL must not reach another file
	}
	for _, pc := range p.conns {
		if pc != nil {
			p.forget(pc)
			p.closeFD(pc)
		}
	}
	if p.epfd >= 0 {
		unix.Close(p.epfd)
	}
	unix.Close(p.wakefd)
}
