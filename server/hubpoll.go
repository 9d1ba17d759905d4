package server

import (
	"encoding/binary"
	"net"

	"golang.org/x/sys/unix"
)

// hubPoll notices the peers that leave the hub's plain-TCP streams: one
// epoll set and one goroutine for all of them, instead of a goroutine
// blocked reading each (docs/DESIGN.md, "Event streams"). A parked
// goroutine is its stack and its descriptor, some 2.6 kB that an idle
// stream kept for nothing else. The client sends nothing after its
// request, so a stream's socket becomes readable only when the peer closes
// (or half-closes), resets or times out (TCP_USER_TIMEOUT), or sends bytes
// that are read and dropped, as the reader does, up to maxStreamInput; the
// set is level-triggered, so what one read does not take is reported again.
//
// The poller takes the socket itself, as a descriptor, out of its
// connection: net/http's wrappers, the net package's descriptor and its
// addresses, and Go's netpoller's entry with its two deadline timers were
// some 650 bytes more a stream. The writers write the descriptor; a write
// that has to wait goes through a connection made for it (dupConn). The
// set reports a stream by its descriptor; a report read before the stream
// ended and its descriptor went to a new stream costs that stream one
// read that finds nothing.
type hubPoll struct {
	h      *hub
	epfd   int
	wakefd int // an eventfd: wake makes the loop look whether the hub stopped

	// Guarded by h.mu.
	streams []*hubStream // by descriptor
	closed  bool         // epfd and wakefd are closed
}

// pollBatch is the most reports one epoll_wait returns.
const pollBatch = 128

// newHubPoll opens a hubPoll; nil when epoll is not there to use (the
// streams then keep a reader goroutine each).
func newHubPoll(h *hub) *hubPoll {
	epfd, wakefd, ok := openEpoll()
	if !ok {
		return nil
	}
	return &hubPoll{h: h, epfd: epfd, wakefd: wakefd}
}

// plainTCP is the TCP connection under c's wrappers (the lean loop's and
// the connection count's, counted), or nil when c is not one (TLS, in
// memory).
func plainTCP(c net.Conn) (tc *net.TCPConn, counted bool) {
	for {
		switch v := c.(type) {
		case *passedConn:
			c = v.Conn
		case *trackedConn:
			c, counted = v.Conn, true
		case *net.TCPConn:
			return v, counted
		default:
			return nil, false
		}
	}
}

// take takes st's socket, that of tc, the TCP connection under st's
// (plainTCP), into the set; tc closes, and st keeps a duplicate of its
// descriptor and, when counted, the connection's count in Server.conns.
// It reports false, leaving st as it was, when tc is closed already, or
// the set takes no more (ENOSPC at max_user_watches, ENOMEM): st then
// needs a reader of its own. h.mu is held.
func (p *hubPoll) take(st *hubStream, tc *net.TCPConn, counted bool) bool {
	fd, ok := dupFD(tc)
	if !ok {
		return false
	}
	if !p.add(st, fd, counted) {
		unix.Close(fd)
		return false
	}
	// The socket stays open through fd. The trackedConn around tc is not
	// closed: its count goes with fd (letGo).
	tc.Close()
	return true
}

// add puts fd, a socket st is to own, into the set as st's; false (st and
// fd as they were) when the set takes no more. h.mu is held.
func (p *hubPoll) add(st *hubStream, fd int, counted bool) bool {
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLRDHUP, Fd: int32(fd)}
	if unix.EpollCtl(p.epfd, unix.EPOLL_CTL_ADD, fd, &ev) != nil {
		return false
	}
	st.conn, st.raw, st.fd, st.counted = nil, nil, int32(fd), counted
	if fd >= len(p.streams) {
		p.streams = append(p.streams, make([]*hubStream, fd+1-len(p.streams))...)
	}
	p.streams[fd] = st
	return true
}

// remove takes st's socket out of the set before st closes it: closed
// alone, it would stay in the set while a copy of the socket is open
// elsewhere (a child forked just then, a slow write's connection),
// reported under a number a new stream may get. h.mu is held.
func (p *hubPoll) remove(st *hubStream) {
	if int(st.fd) < len(p.streams) && p.streams[st.fd] == st {
		p.streams[st.fd] = nil
	}
	if !p.closed {
		_ = unix.EpollCtl(p.epfd, unix.EPOLL_CTL_DEL, int(st.fd), nil)
	}
}

// wake makes the loop look whether the hub has stopped. h.mu is held:
// the loop closes wakefd under it.
func (p *hubPoll) wake() {
	if p.closed {
		return
	}
	var one [8]byte
	binary.NativeEndian.PutUint64(one[:], 1)
	_, _ = unix.Write(p.wakefd, one[:])
}

// run is the loop. It returns once the hub has stopped and every stream
// has ended, and closes the set.
func (p *hubPoll) run() {
	h := p.h
	events := make([]unix.EpollEvent, pollBatch)
	var buf [512]byte
	for {
		n, err := epollWait(p.epfd, events, -1)
		if err != nil && err != unix.EINTR {
			h.s.log.Error("epoll_wait failed; the event streams it waited on are ended, and new ones get a reader goroutine each", "err", err)
			p.abandon()
			return
		}
		for _, ev := range events[:max(n, 0)] {
			if int(ev.Fd) == p.wakefd {
				_, _ = unix.Read(p.wakefd, buf[:8])
				continue
			}
			h.mu.Lock()
			var st *hubStream
			if int(ev.Fd) < len(p.streams) {
				st = p.streams[ev.Fd]
			}
			h.mu.Unlock()
			if st != nil && st.peerLeft(buf[:]) {
				st.end()
			}
		}
		h.mu.Lock()
		done := h.stopped && len(h.all) == 0
		if done {
			p.close()
		}
		h.mu.Unlock()
		if done {
			return
		}
	}
}

// abandon ends every stream in the set (their clients open new ones, and
// replay what they missed), and gives new streams a reader of their own:
// the set cannot be waited on any more.
func (p *hubPoll) abandon() {
	h := p.h
	h.mu.Lock()
	h.poll = nil
	var ending []*hubStream
	for _, st := range p.streams {
		if st != nil {
			ending = append(ending, st)
		}
	}
	p.streams = nil
	p.close()
	h.mu.Unlock()
	for _, st := range ending {
		st.shut()
		st.end()
	}
}

// close closes the set; h.mu is held.
func (p *hubPoll) close() {
	p.closed = true
	unix.Close(p.epfd)
	unix.Close(p.wakefd)
}

// epollWait is unix.EpollWait; tests make it fail.
var epollWait = unix.EpollWait

// peerLeft reads what st's peer sent, without waiting, and reports
// whether the peer has left: the read ended the stream (EOF) or failed,
// or the peer sent more than maxStreamInput in all. Only the poller's loop
// calls it, and only it ends a stream it took: fd is open.
func (st *hubStream) peerLeft(buf []byte) bool {
	for {
		// MSG_DONTWAIT: never wait, even on a socket that someone set
		// blocking (the poller waits for every stream).
		n, _, err := unix.Recvfrom(int(st.fd), buf, unix.MSG_DONTWAIT)
		switch err {
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			return false // an old report: nothing to read
		}
		return err != nil || n == 0 || st.tooMuchInput(n)
	}
}
