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
	lc := net.ListenConfig{
		KeepAliveConfig: net.KeepAliveConfig{
			Enable:   true,
			Idle:     max(ping, time.Second), // the kernel counts in seconds
			Interval: max(ping, time.Second),
			Count:    max(1, int((deadPeer+ping-1)/max(ping, time.Second))),
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
