package server

import (
	"encoding/binary"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The raw accept loop. Go's Accept makes each connection a net.Conn in its
// netpoller: an epoll_ctl, getsockname, a setsockopt for TCP_NODELAY, and,
// when the connection goes to an event loop or the hub, an fcntl for a
// duplicate, an epoll_ctl and a close to take it out again. A session's
// opening is one connection for one request, so on etcd, where a session
// costs the server most, that was a tenth of its CPU (docs/BENCHMARKS.md,
// "The raw accept loop"). Here, for a listener of Listen, Serve accepts with accept4(2) on a duplicate of
// the listening socket and puts each connection straight into an event
// loop's epoll set (poller.adoptFD); Go's netpoller never holds it unless
// the connection goes to the lean loop. The accepted sockets inherit
// TCP_NODELAY and the keepalive from the listening socket (Listen).

// listener is Listen's: a TCP listener whose Close also closes the
// duplicates the raw accept loop accepts on, so that nothing is accepted
// after it returns and the port is free.
type listener struct {
	*net.TCPListener
	closed atomic.Bool // set before the duplicates close
	mu     sync.Mutex  // guards dups
	dups   map[*os.File]struct{}
}

// Close closes l and its duplicates. A duplicate's close waits for an
// accept loop inside it to leave, which it does once it sees closed.
func (l *listener) Close() error {
	l.mu.Lock()
	l.closed.Store(true)
	dups := l.dups
	l.dups = nil
	l.mu.Unlock()
	for f := range dups {
		f.Close()
	}
	return l.TCPListener.Close()
}

// dup is a duplicate of l's socket, closed with l; nil once l is closed
// or when no descriptor is left for it.
func (l *listener) dup() *os.File {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed.Load() {
		return nil
	}
	rc, err := l.SyscallConn()
	if err != nil {
		return nil
	}
	fd := -1
	if cerr := rc.Control(func(s uintptr) {
		fd, err = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 0)
	}); cerr != nil || err != nil {
		return nil
	}
	// Non-blocking as l's is (the flag is the socket's, shared by the
	// duplicate), so os.NewFile puts it in Go's netpoller, where the
	// loop waits for connections without a thread.
	f := os.NewFile(uintptr(fd), "listener")
	if l.dups == nil {
		l.dups = make(map[*os.File]struct{})
	}
	l.dups[f] = struct{}{}
	return f
}

// release closes f, a duplicate of l's socket that an accept loop is done
// with.
func (l *listener) release(f *os.File) {
	l.mu.Lock()
	delete(l.dups, f)
	l.mu.Unlock()
	f.Close()
}

// rawListener is ln for the raw accept loop, and a duplicate of its
// socket to accept on; nil when ln is not for it: not Listen's (whose
// connections inherit TCP_NODELAY and the keepalive from the listening
// socket, from the moment the kernel makes them; Go's Accept sets them
// on each one), over TLS, closed, or with no event loop to put
// connections in.
func (s *Server) rawListener(ln net.Listener, ka *net.KeepAliveConfig) (*listener, *os.File) {
	l, ok := ln.(*listener)
	if !ok || ka == nil || s.certs != nil || s.poller() == nil {
		return nil, nil
	}
	f := l.dup()
	if f == nil {
		return nil, nil
	}
	return l, f
}

// serveRaw is Serve's accept loop on lf, a duplicate of l's socket. It
// returns when the server closes (which closes l), when l is closed, or
// when hs's Serve ends.
func (s *Server) serveRaw(l *listener, lf *os.File, pass *passListener, hs *http.Server, ka *net.KeepAliveConfig, errc <-chan error) error {
	defer l.release(lf)
	rc, err := lf.SyscallConn()
	if err != nil {
		return err
	}
	var delay time.Duration
	for {
		var aerr error
		err := rc.Read(func(fd uintptr) bool {
			for !s.closing.Load() && !l.closed.Load() {
				nfd, remote, err := accept(int(fd))
				switch err {
				case nil:
					delay = 0
					s.takeFD(nfd, remote, pass, hs, ka)
				case unix.EAGAIN:
					return false // rc.Read waits for the next
				case unix.EINTR, unix.ECONNABORTED:
				default:
					aerr = err
					return true
				}
			}
			return true
		})
		if err := s.ended(errc); err != nil {
			return err
		}
		if err != nil || l.closed.Load() {
			return net.ErrClosed // l was closed under the Server
		}
		if aerr == nil {
			continue
		}
		// EMFILE, ENFILE, ENOBUFS...: as Serve's Go accept loop.
		if !s.backOff(&delay, aerr) {
			return http.ErrServerClosed
		}
	}
}

// takeFD serves fd, a connection the raw accept loop accepted from
// remote: in an event loop, or, when none takes it, as Serve serves a
// connection of Go's Accept.
func (s *Server) takeFD(fd int, remote net.Addr, pass *passListener, hs *http.Server, ka *net.KeepAliveConfig) {
	over := s.maxConns > 0 && s.conns.Load() >= int64(s.maxConns)
	if !over {
		s.conns.Add(1)
		if p := s.poller(); p != nil && p.adoptFD(fd, remote, pass, hs, ka) {
			return
		}
	}
	f := os.NewFile(uintptr(fd), "")
	c, err := fileTCPConn(f, ka)
	f.Close()
	if err != nil {
		// No descriptor to spare for Go's copy: the connection closes,
		// as Go's Accept would have failed with EMFILE.
		s.log.Warn("accepted a connection with no descriptor to serve it; closed", "remote", remote.String(), "err", err)
		if !over {
			s.conns.Add(-1)
		}
		return
	}
	if over {
		s.refuse(c)
		return
	}
	lc := &leanConn{Conn: &trackedConn{Conn: c, open: &s.conns}, remote: remote}
	s.startConn(leanJob{lc: lc, pass: pass, hs: hs}, false)
}

// accept is accept4(2) on the non-blocking listening socket lfd: a
// non-blocking connection and its peer's address. As rawIO, it never
// waits, so it does not tell the scheduler it might; and unlike
// unix.Accept4 it asks nothing more of the socket (unix's asks each one's
// protocol, a getsockopt a connection).
func accept(lfd int) (int, net.Addr, error) {
	var rsa unix.RawSockaddrAny
	n := uint32(unix.SizeofSockaddrAny)
	fd, _, e := syscall.RawSyscall6(unix.SYS_ACCEPT4, uintptr(lfd), uintptr(unsafe.Pointer(&rsa)), uintptr(unsafe.Pointer(&n)), unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0, 0)
	if e != 0 {
		return -1, nil, e
	}
	return int(fd), tcpAddr(&rsa), nil
}

// tcpAddr is an accepted connection's peer address as Go's Accept gives
// it.
func tcpAddr(rsa *unix.RawSockaddrAny) *net.TCPAddr {
	var ap netip.AddrPort
	switch rsa.Addr.Family {
	case unix.AF_INET:
		a := (*unix.RawSockaddrInet4)(unsafe.Pointer(rsa))
		ap = netip.AddrPortFrom(netip.AddrFrom4(a.Addr), port(a.Port))
	case unix.AF_INET6:
		a := (*unix.RawSockaddrInet6)(unsafe.Pointer(rsa))
		ip := netip.AddrFrom16(a.Addr)
		if a.Scope_id != 0 {
			ip = ip.WithZone(zoneName(int(a.Scope_id)))
		}
		ap = netip.AddrPortFrom(ip, port(a.Port))
	default:
		return &net.TCPAddr{}
	}
	return net.TCPAddrFromAddrPort(ap)
}

// port is a port as the kernel gives it, in network byte order.
func port(p uint16) uint16 {
	return binary.BigEndian.Uint16((*[2]byte)(unsafe.Pointer(&p))[:])
}

// zones are the names of interfaces by index, as Go's Accept names an
// IPv6 link-local peer's zone: asking the kernel (a netlink dump of every
// interface) for each such connection would cost more than the accept.
var zones sync.Map // int → string

func zoneName(i int) string {
	if name, ok := zones.Load(i); ok {
		return name.(string)
	}
	name := strconv.Itoa(i)
	if ifi, err := net.InterfaceByIndex(i); err == nil {
		name = ifi.Name
	}
	zones.Store(i, name)
	return name
}
