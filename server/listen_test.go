package server

import (
	"context"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestListenSetsUserTimeout(t *testing.T) {
	ln, err := Listen(context.Background(), "127.0.0.1:0", time.Second, 3*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	// The client's end stays open until the accepted end has been read.
	dialed := make(chan net.Conn, 1)
	go func() {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Error(err)
			ln.Close() // Accept must not wait for it
		}
		dialed <- c
	}()
	defer func() {
		if c := <-dialed; c != nil {
			c.Close()
		}
	}()
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	raw, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var got int
	var gerr error
	_ = raw.Control(func(fd uintptr) {
		got, gerr = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT)
	})
	if gerr != nil || got != 3000 {
		t.Fatalf("accepted connection has TCP_USER_TIMEOUT %d ms (%v), want the dead-peer timeout, 3000", got, gerr)
	}
	var ka [4]int
	_ = raw.Control(func(fd uintptr) { ka = keepalive(t, int(fd)) })
	if ka != [4]int{1, 1, 1, 3} {
		t.Fatalf("keepalive (on, idle s, interval s, count) %v: want probes every ping (1 s) for the dead-peer timeout (3 probes), inherited from the listener", ka)
	}
}
