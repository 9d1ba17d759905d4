package server

import (
	"errors"
	"net"
	"net/http"
	"os"
	"strconv"
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
// "The raw accept loop"). Here, for a plain-TCP listener that carries its
// own keepalive (Listen), Serve accepts with accept4(2) on a duplicate of
// the listening socket and puts each connection straight into an event
// loop's epoll set (poller.adoptFD); Go's netpoller never holds it unless
// the connection goes to the lean loop. The accepted sockets inherit
// TCP_NODELAY and the keepalive from the listening socket (Listen).

// acceptCheck is how often the raw accept loop, idle, looks whether its
// listener was closed under it rather than through the Server: only then
// would nothing wake it.
var acceptCheck = time.Second

// rawListener is a duplicate of ln's socket for the raw accept loop, or
// nil when ln is not for it: not plain TCP, over TLS, without an event
// loop to put connections in, or without TCP_NODELAY and a keepalive on
// the listening socket (Listen sets both), which its connections inherit
// from the moment they are made. Go's Accept would set them on each one.
func (s *Server) rawListener(ln net.Listener, ka *net.KeepAliveConfig) *os.File {
	tl, ok := ln.(*net.TCPListener)
	if !ok || ka == nil || s.certs != nil {
		return nil
	}
	rc, err := tl.SyscallConn()
	if err != nil {
		return nil
	}
	fd, nodelay := -1, 0
	if cerr := rc.Control(func(s uintptr) {
		if nodelay, err = unix.GetsockoptInt(int(s), unix.IPPROTO_TCP, unix.TCP_NODELAY); err == nil && nodelay != 0 {
			fd, err = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 0)
		}
	}); cerr != nil || err != nil || fd < 0 {
		return nil
	}
	if s.poller() == nil {
		unix.Close(fd)
		return nil
	}
	// Non-blocking as ln's is (the flag is the socket's, shared by the
	// duplicate), so os.NewFile puts it in Go's netpoller, where the
	// loop waits for connections without a thread.
	return os.NewFile(uintptr(fd), "listener")
}

// serveRaw is Serve's accept loop on lf, a duplicate of ln (rawListener).
// It returns when the server closes (stopLean closes lf), when ln is
// closed (seen within acceptCheck), or when hs's Serve ends.
func (s *Server) serveRaw(lf *os.File, ln net.Listener, pass *passListener, hs *http.Server, ka *net.KeepAliveConfig, errc <-chan error) error {
	defer lf.Close()
	s.mu.Lock()
	if s.closing.Load() {
		s.mu.Unlock()
		return http.ErrServerClosed
	}
	s.rawListeners = append(s.rawListeners, lf)
	s.mu.Unlock()
	rc, err := lf.SyscallConn()
	if err != nil {
		return err
	}
	lnc, _ := ln.(syscall.Conn).SyscallConn() // a *net.TCPListener's: no error
	var delay time.Duration
	for {
		var aerr error
		_ = lf.SetReadDeadline(time.Now().Add(acceptCheck))
		err := rc.Read(func(fd uintptr) bool {
			for !s.closing.Load() {
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
		switch {
		case errors.Is(err, os.ErrDeadlineExceeded):
			if lnc.Control(func(uintptr) {}) != nil {
				return net.ErrClosed // ln was closed under the Server
			}
			continue
		case err != nil:
			return err
		case aerr == nil:
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
	c, err := fileConn(f)
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
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetKeepAliveConfig(*ka) // net.FileConn set Go's
	}
	lc := &leanConn{Conn: &trackedConn{Conn: c, open: &s.conns}}
	if !s.trackLean(lc, true, false) {
		lc.Close()
		return
	}
	s.startLean(leanJob{lc: lc, pass: pass, hs: hs})
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
	switch rsa.Addr.Family {
	case unix.AF_INET:
		a := (*unix.RawSockaddrInet4)(unsafe.Pointer(rsa))
		return &net.TCPAddr{IP: append(net.IP(nil), a.Addr[:]...), Port: int(port(a.Port))}
	case unix.AF_INET6:
		a := (*unix.RawSockaddrInet6)(unsafe.Pointer(rsa))
		addr := &net.TCPAddr{IP: append(net.IP(nil), a.Addr[:]...), Port: int(port(a.Port))}
		if a.Scope_id != 0 {
			addr.Zone = strconv.Itoa(int(a.Scope_id))
			if ifi, err := net.InterfaceByIndex(int(a.Scope_id)); err == nil {
				addr.Zone = ifi.Name
			}
		}
		return addr
	}
	return &net.TCPAddr{}
}

// port is a port in network byte order, as the kernel gives it.
func port(p uint16) uint16 {
	b := (*[2]byte)(unsafe.Pointer(&p))
	return uint16(b[0])<<8 | uint16(b[1])
}
