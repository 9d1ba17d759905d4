package server

import (
	"context"
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Listen opens a TCP listener whose connections notice a dead peer within
// about twice ping: TCP keepalive probes start after ping of silence, and
// TCP_USER_TIMEOUT drops a connection whose sent data stays unacknowledged
// for 2×ping. A stream's close is noticed through the request context; this
// is for peers that vanish without closing.
func Listen(ctx context.Context, addr string, ping time.Duration) (net.Listener, error) {
	userTimeout := int((2 * ping).Milliseconds())
	lc := net.ListenConfig{
		KeepAliveConfig: net.KeepAliveConfig{
			Enable:   true,
			Idle:     ping,
			Interval: max(ping/4, time.Second),
			Count:    4,
		},
		Control: func(network, address string, c syscall.RawConn) error {
			var serr error
			err := c.Control(func(fd uintptr) {
				// Accepted sockets inherit it from the listener on Linux.
				serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, userTimeout)
			})
			if err != nil {
				return err
			}
			return serr
		},
	}
	return lc.Listen(ctx, "tcp", addr)
}
