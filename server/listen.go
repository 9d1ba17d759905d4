package server

import (
	"context"
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Listen opens a TCP listener whose connections notice a peer that
// vanished without closing (a machine that died, a cable pulled, a
// partition) within ping + deadPeer (docs/DESIGN.md, "Leases"): an event
// stream sends a ping at least every ping, and TCP_USER_TIMEOUT drops a
// connection whose sent data stays unacknowledged for deadPeer; TCP
// keepalive probes, every ping after ping of silence, do the same for an
// idle request connection. A stream's clean close is noticed at once: its
// socket becomes readable (hub.go).
func Listen(ctx context.Context, addr string, ping, deadPeer time.Duration) (net.Listener, error) {
	userTimeout := int(deadPeer.Milliseconds())
	idle := int((max(ping, time.Second) + time.Second - 1) / time.Second) // the kernel counts in seconds; rounded up, as Go does
	count := max(1, int((deadPeer+ping-1)/max(ping, time.Second)))
	lc := net.ListenConfig{
		// Set on the listening socket, which every accepted one inherits
		// on Linux, not by Go on each accepted socket: four system calls
		// less a connection, a tenth of a session stream's opening on a
		// machine whose system calls are dear (docs/BENCHMARKS.md,
		// "Streams opened by the lean loop").
		KeepAlive: -1,
		Control: func(network, address string, c syscall.RawConn) error {
			var serr error
			err := c.Control(func(fd uintptr) {
				for _, o := range []struct{ level, opt, v int }{
					{unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1},
					{unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, idle},
					{unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, idle},
					{unix.IPPROTO_TCP, unix.TCP_KEEPCNT, count},
					{unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, userTimeout},
					// As Go's Accept sets it on each connection; the raw
					// accept loop (accept.go) sets nothing.
					{unix.IPPROTO_TCP, unix.TCP_NODELAY, 1},
				} {
					if serr = unix.SetsockoptInt(int(fd), o.level, o.opt, o.v); serr != nil {
						return
					}
				}
			})
			if err != nil {
				return err
			}
			return serr
		},
	}
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	return &listener{TCPListener: ln.(*net.TCPListener)}, nil
}
