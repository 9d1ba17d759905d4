package server

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"net/netip"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// hub serves the event streams of connections taken over from net/http
// (docs/DESIGN.md, "Event streams"). An idle stream holds no goroutine and
// no buffer: a plain-TCP stream is a descriptor in one poller's epoll set
// (hubpoll.go), which notices the peers that leave; a TLS or in-memory
// stream keeps its connection, and a goroutine blocked reading it. Events
// are written by a few writers, one per core: a feed that has events wakes
// its stream, a writer encodes them into a pooled buffer and writes what
// the socket takes without waiting. A socket that is full hands the rest
// to a goroutine of that stream's own, which waits up to the write
// timeout; a peer that does not read so never delays the others' events.
// One pinger marks the streams that have been quiet.
type hub struct {
	s *Server

	mu      sync.Mutex
	wake    *sync.Cond // signalled when queue grows, or when the hub may stop
	queue   []*hubStream
	all     map[*hubStream]struct{}
	stopped bool // drained: no stream is added any more
	started bool
	epoch   time.Time // of the streams' lastWrite clock
	// poll is the poller, started with the first plain-TCP stream (a
	// goroutine waiting in epoll_wait is one that testing/synctest cannot
	// wait for: the tests that stream over in-memory connections inside
	// it must not get one); nil: every stream has a reader goroutine.
	poll      *hubPoll
	pollTried bool // the poller was started, or could not be

	// pingDue are the streams the pinger looks at in each of its turns
	// (pinger), pingTurn the next turn's: every stream in all is on one
	// list, and an ended one on none (end).
	pingDue  [pingTurns][]*hubStream
	pingTurn int
	// turns is the pinger's turns an interval: pingTurns, fewer under
	// 8 ms, so that a turn is a millisecond at least and the turns still
	// make the interval.
	turns int
}

// Stream states, guarded by hub.mu.
const (
	streamIdle   = iota
	streamQueued // in hub.queue
	streamBusy   // a writer, or its own slow-write goroutine, has it
)

// hubStream is one event stream of the hub: a socket the poller took
// (fd), or a connection with a reader goroutine (conn).
type hubStream struct {
	h    *hub
	conn net.Conn // nil once the poller took the socket
	// raw writes to conn without waiting; nil when conn cannot (TLS, an
	// in-memory connection): every write then takes the slow path.
	raw syscall.RawConn
	src source
	// release, if not nil, runs once the stream has ended, before the
	// source's close: what the stream holds besides.
	release func()

	// fd is the socket's descriptor once the poller took it (else -1);
	// set before the stream is in the hub and not changed after. It is
	// closed (fdClosed) once the stream has ended and no writer has it:
	// a number closed under a writer could be a new connection's by its
	// write (letGo).
	fd int32
	// input counts the bytes the client sent after its request; only the
	// stream's one reader (its goroutine or the poller's loop) touches it.
	input int32

	// Guarded by hub.mu.
	state    uint8
	again    bool   // woken while busy: look again when the write is done
	ping     bool   // quiet for the ping interval but a turn (pinger): write a ping
	ending   bool   // shut: nothing more is written, its reader or the poller will end it
	closed   bool   // ended: released, out of the hub
	counted  bool   // fd carries the connection's count in Server.conns
	fdClosed bool   // fd is closed
	out      []byte // bytes to write before any event: the header and first

	lastWrite atomic.Int64 // h.now() at the last write

	// pingSlot, pingIdx: where st is in h.pingDue (guarded by hub.mu),
	// for end to take it off in one step.
	pingSlot, pingIdx int32
}

// source is what an event stream writes: a lock feed's items, encoded
// (feedSource, sse.go).
type source interface {
	// notify is the feed's Notify.
	notify(f func())
	// fill appends the frames of the waiting items to b. Calls are never
	// concurrent.
	fill(b []byte) []byte
	// ended reports whether the feed has ended.
	ended() bool
	// channels are the feed's Ready and Done, for a stream served from a
	// goroutine that waits on them (streamLoop).
	channels() (ready, done <-chan struct{})
	// close ends the feed and lets go what its request held; called
	// once, when the stream has ended.
	close()
}

func newHub(s *Server) *hub {
	h := &hub{s: s, all: make(map[*hubStream]struct{}), epoch: time.Now()}
	h.wake = sync.NewCond(&h.mu)
	h.turns = max(1, min(pingTurns, int(s.ping/time.Millisecond)))
	return h
}

func (h *hub) now() int64 { return int64(time.Since(h.epoch)) }

// admit counts a new event stream in Server.openStreams unless the server
// is draining. Under h.mu, which stop takes before Drain waits: a stream
// is either counted before the wait or refused.
func (h *hub) admit() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.stopped {
		return false
	}
	h.s.openStreams.Add(1)
	return true
}

// start serves conn as an event stream of src; first (response header and
// the first events) goes out before anything else. The stream ends when
// revoked (if not nil) is done: the credential that opened it is gone
// (docs/SECURITY.md). release (if not nil) and src's close run once it has
// ended. start returns nil when the server is draining: the caller then
// closes conn, and calls release and src's close.
func (h *hub) start(conn net.Conn, src source, first []byte, revoked context.Context, release func()) *hubStream {
	return h.startOn(conn, -1, src, first, revoked, release)
}

// startFD is start for a plain-TCP socket that an event loop read the
// request from (poller.go): the stream owns fd, and the count of the
// connection in Server.conns. It returns nil, fd and the count left to
// the caller, when the server is draining, or when fd can go neither into
// the poller nor into a connection (no descriptor to spare).
func (h *hub) startFD(fd int, src source, first []byte, revoked context.Context, release func()) *hubStream {
	return h.startOn(nil, fd, src, first, revoked, release)
}

// startOn is start on conn, or startFD on fd when conn is nil.
func (h *hub) startOn(conn net.Conn, fd int, src source, first []byte, revoked context.Context, release func()) *hubStream {
	st := &hubStream{h: h, conn: conn, src: src, release: release, out: first, fd: int32(fd)}
	if conn != nil {
		st.raw, st.fd = rawConn(conn), -1
	}
	st.lastWrite.Store(h.now())
	// Set before the stream is in the hub, where the poller may end it at
	// once. Revoked meanwhile, it is shut before it is served, and ends.
	var stopShut func() bool
	if revoked != nil {
		stopShut = context.AfterFunc(revoked, st.shut)
		st.release = func() {
			stopShut()
			if release != nil {
				release()
			}
		}
	}
	// refuse gives conn or fd back to the caller; h.mu is held.
	refuse := func() *hubStream {
		// A revocation's shut that runs late must not shut down a
		// descriptor the caller closes, whose number a new connection
		// may have by then.
		st.fdClosed = true
		h.mu.Unlock()
		if stopShut != nil {
			stopShut()
		}
		return nil
	}
	h.mu.Lock()
	if h.stopped {
		return refuse()
	}
	if !h.started {
		h.started = true
		h.run()
	}
	polled := false
	if conn == nil {
		polled = h.pollSet() != nil && h.poll.add(st, fd, true)
		if !polled {
			// No poller (epoll failed), or its set takes no more: a
			// connection and a reader goroutine, as for TLS.
			c, err := dupConn(fd)
			if err != nil {
				return refuse()
			}
			unix.Close(fd)
			st.conn = &trackedConn{Conn: c, open: &h.s.conns}
			st.raw, st.fd = rawConn(st.conn), -1
		}
	} else if tc, counted := plainTCP(conn); tc != nil && !st.ending {
		polled = h.pollSet() != nil && h.poll.take(st, tc, counted)
	}
	h.all[st] = struct{}{}
	// Looked at h.turns turns from now, a whole interval: quiet since
	// now, it is pinged then.
	h.schedule((h.pingTurn+h.turns-1)%h.turns, st)
	st.state = streamQueued
	h.queue = append(h.queue, st)
	h.wake.Signal()
	h.mu.Unlock()
	if !polled {
		go st.readLoop()
	}
	src.notify(st.wakeUp)
	return st
}

// pollSet is the poller, started by the first plain-TCP stream; nil when
// it could not be. h.mu is held.
func (h *hub) pollSet() *hubPoll {
	if !h.pollTried {
		h.pollTried = true
		h.startPoll()
	}
	return h.poll
}

// startPoll starts the poller, which stops once the server is drained and
// every stream has ended; called with h.mu held.
func (h *hub) startPoll() {
	if h.poll = newHubPoll(h); h.poll != nil {
		h.s.openStreams.Add(1)
		go func() {
			defer h.s.openStreams.Done()
			h.poll.run()
		}()
	}
}

// run starts the writers and the pinger, which stop once the server is
// drained and every stream has ended; called with h.mu held.
func (h *hub) run() {
	s := h.s
	n := runtime.GOMAXPROCS(0)
	s.openStreams.Add(n + 1)
	for range n {
		go func() {
			defer s.openStreams.Done()
			h.writer()
		}()
	}
	go func() {
		defer s.openStreams.Done()
		h.pinger()
	}()
}

// writer writes the streams that have something to write until the hub
// stops.
func (h *hub) writer() {
	var batch []*hubStream
	for {
		h.mu.Lock()
		for len(h.queue) == 0 && !(h.stopped && len(h.all) == 0) {
			h.wake.Wait()
		}
		if len(h.queue) == 0 {
			h.mu.Unlock()
			return
		}
		// Take a share of the queue, so that a fan-out to thousands of
		// streams is spread over every writer without a lock round trip
		// per stream.
		k := min(len(h.queue), max(1, len(h.queue)/runtime.GOMAXPROCS(0)), 64)
		batch = append(batch[:0], h.queue[:k]...)
		n := copy(h.queue, h.queue[k:])
		clear(h.queue[n:])
		h.queue = h.queue[:n]
		if n > 0 {
			h.wake.Signal()
		}
		for _, st := range batch {
			st.state = streamBusy
		}
		h.mu.Unlock()
		for _, st := range batch {
			st.writeOne()
		}
		clear(batch)
	}
}

// writeOne writes st. A panic (in encoding an event, say) ends that
// stream alone, as it would end its connection in a request's goroutine.
func (st *hubStream) writeOne() {
	defer func() {
		if p := recover(); p != nil {
			st.h.s.panicked(p, st.remote())
			st.shut()
			st.idle()
		}
	}()
	st.write()
}

// wakeUp queues st for a writer: its feed has events or has ended.
func (st *hubStream) wakeUp() {
	h := st.h
	h.mu.Lock()
	switch {
	case st.closed || st.ending:
	case st.state == streamIdle:
		st.state = streamQueued
		h.queue = append(h.queue, st)
		h.wake.Signal()
	case st.state == streamBusy:
		st.again = true
	}
	h.mu.Unlock()
}

// write writes what st has: its first bytes, its feed's events or a ping.
// st is busy.
func (st *hubStream) write() {
	h := st.h
	h.mu.Lock()
	if st.closed || st.ending {
		st.state = streamIdle
		st.letGo()
		h.mu.Unlock()
		return
	}
	bp := bufPool.Get().(*[]byte)
	b := append((*bp)[:0], st.out...)
	st.out = nil
	ping := st.ping
	st.ping = false
	h.mu.Unlock()
	// A feed that ended (too slow, or the backend closed) ends the
	// response, after its first bytes if they are not out yet, and the
	// client reconnects with Last-Event-ID.
	ended := st.src.ended()
	if !ended {
		b = st.src.fill(b)
		if len(b) == 0 && ping {
			b = append(b, ": ping\n\n"...)
		}
	}
	n, err := st.writeNow(b)
	if err == nil && n < len(b) {
		if st.raw != nil || st.fd >= 0 {
			h.s.metrics.fullSockets.Inc()
		}
		// The socket is full: this stream's own goroutine waits for it,
		// up to the write timeout, and the writer goes on with the
		// others. It counts as an open stream: Drain returns once it has
		// finished too.
		h.s.openStreams.Add(1)
		go st.writeSlow(bp, b, n, ended)
		return
	}
	if n > 0 {
		st.lastWrite.Store(h.now())
	}
	giveBack(bp, b)
	if err != nil || ended {
		st.shut()
	}
	st.idle()
}

// writeSlow writes b[n:] waiting as long as the write timeout allows, then
// makes st idle again, or ends it when its feed had ended. A socket the
// poller took is written through a connection of its own for the while,
// on a duplicate of its descriptor in Go's netpoller; without a descriptor
// to spare for that (EMFILE), the stream ends as on a failed write.
func (st *hubStream) writeSlow(bp *[]byte, b []byte, n int, ended bool) {
	defer st.h.s.openStreams.Done()
	c := st.conn
	var err error
	if c == nil {
		c, err = dupConn(int(st.fd))
	}
	if err == nil {
		_ = c.SetWriteDeadline(time.Now().Add(st.h.s.writeTimeout))
		_, err = c.Write(b[n:])
		if st.conn == nil {
			c.Close()
		} else if err == nil {
			// A deadline left behind would fail the writers' next write
			// on this socket once it passed.
			_ = c.SetWriteDeadline(time.Time{})
		}
	}
	if err == nil {
		st.lastWrite.Store(st.h.now())
	}
	giveBack(bp, b)
	if err != nil || ended {
		st.shut()
	}
	st.idle()
}

// writeNow writes as much of b as the socket takes without waiting.
func (st *hubStream) writeNow(b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	if st.fd >= 0 {
		return writeFD(int(st.fd), b)
	}
	if st.raw == nil {
		return 0, nil
	}
	var n int
	var werr error
	err := st.raw.Write(func(fd uintptr) bool {
		n, werr = writeFD(int(fd), b)
		return true // never wait here
	})
	return n, errors.Join(err, werr)
}

// writeFD writes as much of b as the non-blocking socket fd takes. It
// never waits, so it does not tell the scheduler it might (rawIO): told,
// the scheduler's monitor takes the writer's processor away from a write
// that runs long, as one on loopback does that runs the reader's TCP input
// too, and another thread is woken to run what waits.
func writeFD(fd int, b []byte) (n int, err error) {
	for n < len(b) {
		m, err := rawIO(unix.SYS_WRITE, fd, b[n:])
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			if err != unix.EAGAIN {
				return n, err
			}
			break
		}
		n += m
	}
	return n, nil
}

// idle ends st's turn: queued again when it was woken meanwhile.
func (st *hubStream) idle() {
	h := st.h
	h.mu.Lock()
	switch {
	case st.closed || st.ending:
		st.state = streamIdle
		st.letGo()
	case st.again || st.ping:
		st.again = false
		st.state = streamQueued
		h.queue = append(h.queue, st)
		h.wake.Signal()
	default:
		st.state = streamIdle
	}
	h.mu.Unlock()
}

// giveBack returns a writer's buffer to the pool (server.go): an idle
// stream keeps none.
func giveBack(bp *[]byte, b []byte) {
	*bp = b
	putBuf(bp)
}

// shut ends st from the server's side: nothing more is written to it, and
// its transport closes at once; its reader then sees the end and releases
// it. A TLS connection's Close would first send close_notify, which waits
// (for a blocked write, then up to 5 s) on a socket its peer does not
// read: that wait must hold neither a writer nor Drain. A socket the
// poller took is shut down instead, both ways, which the poller sees:
// closed, it would leave the set without a word. Under h.mu, which its
// close takes too.
func (st *hubStream) shut() {
	h := st.h
	h.mu.Lock()
	st.ending = true
	if st.fd >= 0 {
		if !st.fdClosed {
			_ = unix.Shutdown(int(st.fd), unix.SHUT_RDWR)
		}
		h.mu.Unlock()
		return
	}
	c := st.conn
	h.mu.Unlock()
	_ = transport(c).Close()
}

// letGo closes the socket the poller took once st has ended and no
// writer has it; h.mu is held.
func (st *hubStream) letGo() {
	if st.fd < 0 || st.fdClosed || !st.closed || st.state == streamBusy {
		return
	}
	st.fdClosed = true
	unix.Close(int(st.fd))
	if st.counted {
		st.h.s.conns.Add(-1)
	}
}

// remote is st's peer address, for a log line.
func (st *hubStream) remote() string {
	if st.conn != nil {
		return addrOf(st.conn.RemoteAddr())
	}
	sa, err := unix.Getpeername(int(st.fd))
	if err != nil {
		return "?"
	}
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(a.Addr), uint16(a.Port)).String()
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(a.Addr), uint16(a.Port)).String()
	}
	return "?"
}

// dupConn is a connection on a duplicate of the socket fd, in Go's
// netpoller: closing it leaves fd open.
func dupConn(fd int) (net.Conn, error) {
	d, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(d), "")
	defer f.Close()
	return net.FileConn(f)
}

// transport is the connection under c's TLS, or c.
func transport(c net.Conn) net.Conn {
	for {
		switch v := c.(type) {
		case passedTLSConn:
			c = v.tc
		case *passedConn:
			c = v.Conn
		case *tls.Conn:
			c = v.NetConn()
		default:
			return c
		}
	}
}

// readLoop waits for the peer to leave (it sends nothing more), then ends
// the stream.
func (st *hubStream) readLoop() {
	s := st.h.s
	defer func() {
		if p := recover(); p != nil {
			s.panicked(p, st.remote())
		}
		st.end()
	}()
	var b [512]byte
	for {
		n, err := st.conn.Read(b[:])
		if err != nil || st.tooMuchInput(n) {
			return
		}
	}
}

// maxStreamInput bounds what a stream's client may send after its request.
// The protocol has it send nothing, so a client past this is broken or
// hostile, and its stream ends (docs/DESIGN.md, "Event streams") rather
// than keep its reader dropping bytes without end. A variable for the test
// of a flood that goes on while the server ends the stream for its own
// reasons.
var maxStreamInput int32 = 64 << 10

// tooMuchInput counts n more bytes from st's client and reports whether
// they passed maxStreamInput. Only st's one reader calls it.
func (st *hubStream) tooMuchInput(n int) bool {
	st.input += int32(n) // at most maxStreamInput plus one read: no overflow
	return st.input > maxStreamInput
}

// end closes st's connection and releases what it held, once: from its
// reader, or the poller's loop.
func (st *hubStream) end() {
	h := st.h
	h.mu.Lock()
	st.closed = true
	st.out = nil
	if st.fd >= 0 && h.poll != nil {
		h.poll.remove(st)
	}
	if st.fd >= 0 && !st.fdClosed && st.state == streamBusy {
		// A writer has the socket, maybe blocked on a peer that left
		// without reading (a half-close): shut down, its write fails
		// now, and the socket and its count go, as a connection's close
		// let them go, not at the write timeout.
		_ = unix.Shutdown(int(st.fd), unix.SHUT_RDWR)
	}
	st.letGo()
	if _, ok := h.all[st]; ok {
		// Off the pinger's list now, not at its turn: a stream that
		// ended holds its feed, connection and release, and a fleet that
		// reconnects would leave an interval's worth of them behind.
		l := h.pingDue[st.pingSlot]
		i, last := st.pingIdx, len(l)-1
		l[i] = l[last]
		l[i].pingIdx = i
		l[last] = nil
		h.pingDue[st.pingSlot] = l[:last]
	}
	delete(h.all, st)
	if h.stopped && len(h.all) == 0 {
		h.wake.Broadcast()
		if h.poll != nil {
			h.poll.wake()
		}
	}
	h.mu.Unlock()
	if st.conn != nil {
		st.conn.Close()
	}
	if st.release != nil {
		st.release()
	}
	st.src.close()
	h.s.metrics.streams.Dec()
	h.s.openStreams.Done()
}

// pingTurns is how many turns the pinger takes an interval.
const pingTurns = 8

// pinger marks for a ping each stream that has been quiet for all but a
// turn of the ping interval, so that none is quiet for longer than the
// interval and none is pinged much sooner. It takes pingTurns turns an
// interval, and each turn looks only at the streams due in it: each
// stream is in one turn's list, the one in which it will have been quiet
// long enough unless it writes meanwhile (then it moves on, when looked
// at). Marking the streams quiet for half the interval every half
// interval, as it did, pinged a new stream after half an interval, and
// pinged every stream in one of two bursts an interval: at 10,000
// streams, 5,000 writes ahead of any event queued behind them, and a
// ping for every stream opened in a fleet's first second
// (docs/BENCHMARKS.md, "Pings in eight turns").
func (h *hub) pinger() {
	turn := max(h.s.ping/time.Duration(h.turns), time.Millisecond)
	t := time.NewTicker(turn)
	defer t.Stop()
	var spare []*hubStream
	for {
		select {
		case <-t.C:
		case <-h.s.drained.Done():
			return
		}
		// Pinged: quiet since due or before, the interval but a turn.
		due := h.now() - int64(h.s.ping-turn)
		h.mu.Lock()
		k := h.pingTurn
		h.pingTurn = (k + 1) % h.turns
		l := h.pingDue[k]
		h.pingDue[k] = spare
		queued := false
		for _, st := range l {
			if w := st.lastWrite.Load(); w > due {
				// Written since: due the interval but a turn after that
				// write, as many turns on (at least one, at most all).
				d := int((w - due + int64(turn) - 1) / int64(turn))
				h.schedule((k+min(max(d, 1), h.turns))%h.turns, st)
				continue
			}
			st.ping = true
			if st.state == streamIdle {
				st.state = streamQueued
				h.queue = append(h.queue, st)
				queued = true
			}
			h.schedule(k, st) // an interval on
		}
		clear(l)
		spare = l[:0]
		if queued {
			h.wake.Broadcast()
		}
		h.mu.Unlock()
	}
}

// schedule puts st on turn j's list; h.mu held.
func (h *hub) schedule(j int, st *hubStream) {
	st.pingSlot, st.pingIdx = int32(j), int32(len(h.pingDue[j]))
	h.pingDue[j] = append(h.pingDue[j], st)
}

// stop ends every stream at once, and the hub once they have ended: the
// server is draining.
func (h *hub) stop() {
	h.mu.Lock()
	h.stopped = true
	all := make([]*hubStream, 0, len(h.all))
	for st := range h.all {
		all = append(all, st)
	}
	h.wake.Broadcast()
	if h.poll != nil {
		h.poll.wake()
	}
	h.mu.Unlock()
	for _, st := range all {
		st.shut()
	}
}

// rawConn returns the raw connection under c's wrappers, nil when c is not
// a plain socket (TLS must write through its own record layer).
func rawConn(c net.Conn) syscall.RawConn {
	for {
		switch v := c.(type) {
		case *passedConn:
			c = v.Conn
		case *trackedConn:
			c = v.Conn
		case syscall.Conn:
			rc, err := v.SyscallConn()
			if err != nil {
				return nil
			}
			return rc
		default:
			return nil
		}
	}
}
