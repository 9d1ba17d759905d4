package server

import (
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
)

// TestLeanGoroutinesReused: without the event loop, each connection is
// served by a lean goroutine; one that has served a connection serves the
// next (its stack, grown by the first, is not grown again).
func TestLeanGoroutinesReused(t *testing.T) {
	e := newEnvWith(t, envConfig{goroutines: true, goAccept: true})
	addr := e.ts.Listener.Addr().String()
	for i := range 20 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		kit.WaitFor(t, "the connection accepted", func() bool { return e.srv.conns.Load() == 1 })
		c.Close()
		kit.WaitFor(t, "its goroutine waiting for the next", func() bool {
			return e.srv.conns.Load() == 0 && e.srv.leanWaitingLen() == 1
		})
		if n := e.srv.leanWorkers.Load(); n != 1 {
			t.Fatalf("connection %d: %d lean goroutines, want the one reused", i, n)
		}
	}
}

// TestLeanGoroutinesIdleBounded: after a burst of connections, at most
// maxLeanIdle goroutines stay to wait for more; the others end. Close ends
// those that wait (goleak checks the package's goroutines at its end).
func TestLeanGoroutinesIdleBounded(t *testing.T) {
	e := newEnvWith(t, envConfig{goroutines: true, goAccept: true})
	addr := e.ts.Listener.Addr().String()
	const n = maxLeanIdle + 20
	conns := make([]net.Conn, 0, n)
	for range n {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	kit.WaitFor(t, "every connection accepted, each in its own goroutine", func() bool {
		return e.srv.conns.Load() == n && e.srv.leanWorkers.Load() == n
	})
	for _, c := range conns {
		c.Close()
	}
	kit.WaitFor(t, "the goroutines past the bound gone", func() bool {
		return e.srv.conns.Load() == 0 && e.srv.leanWorkers.Load() == maxLeanIdle && e.srv.leanWaitingLen() == maxLeanIdle
	})
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	kit.WaitFor(t, "the next connection taken by one waiting", func() bool {
		return e.srv.conns.Load() == 1 && e.srv.leanWaitingLen() == maxLeanIdle-1
	})
	if w := e.srv.leanWorkers.Load(); w != maxLeanIdle {
		t.Fatalf("%d lean goroutines, want the %d that waited", w, maxLeanIdle)
	}
}

// TestLeanGoroutinesIdleEnd: a lean goroutine that waits for a connection
// for leanIdleFor ends.
func TestLeanGoroutinesIdleEnd(t *testing.T) {
	e := newEnvWith(t, envConfig{goroutines: true, goAccept: true, prep: func(s *Server) { s.leanIdleFor = 20 * time.Millisecond }})
	c, err := net.Dial("tcp", e.ts.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, "the connection accepted", func() bool { return e.srv.conns.Load() == 1 })
	c.Close()
	kit.WaitFor(t, "the idle goroutine gone", func() bool {
		return e.srv.conns.Load() == 0 && e.srv.leanWorkers.Load() == 0 && e.srv.leanWaitingLen() == 0
	})
}

// TestLeanGoroutinesTrickle: after a burst, connections that come one at a
// time go to the goroutine that waited least, and the others the burst
// left end. (Handed out in turn, each would get a connection before its
// timeout, and all would stay.)
func TestLeanGoroutinesTrickle(t *testing.T) {
	e := newEnvWith(t, envConfig{goroutines: true, goAccept: true, prep: func(s *Server) { s.leanIdleFor = 300 * time.Millisecond }})
	addr := e.ts.Listener.Addr().String()
	const burst = 20
	var cs []net.Conn
	for range burst {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		cs = append(cs, c)
	}
	kit.WaitFor(t, "the burst accepted", func() bool { return e.srv.conns.Load() == burst && e.srv.leanWorkers.Load() == burst })
	for _, c := range cs {
		c.Close()
	}
	kit.WaitFor(t, "the burst over", func() bool { return e.srv.conns.Load() == 0 && e.srv.leanWaitingLen() == burst })
	deadline := time.Now().Add(kit.Patience)
	for n := 0; e.srv.leanWorkers.Load() > 1; n++ {
		if time.Now().After(deadline) {
			t.Fatalf("after %d connections one at a time, %d lean goroutines of the burst's %d remain", n, e.srv.leanWorkers.Load(), burst)
		}
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		kit.WaitFor(t, "the connection accepted", func() bool { return e.srv.conns.Load() == 1 })
		c.Close()
		kit.WaitFor(t, "the connection served", func() bool { return e.srv.conns.Load() == 0 && e.srv.leanWaitingLen() >= 1 })
	}
}

// leanWaitingLen is the number of lean goroutines waiting for a connection.
func (s *Server) leanWaitingLen() int32 {
	s.leanMu.Lock()
	defer s.leanMu.Unlock()
	return int32(len(s.leanWaiting))
}

// TestLeanGoroutinesTakeHandOvers: a connection the event loop hands to
// the lean loop (here, half a request) goes to a lean goroutine as a new
// one does, and one that served such a connection serves the next.
func TestLeanGoroutinesTakeHandOvers(t *testing.T) {
	e := newEnvWith(t, envConfig{})
	addr := e.ts.Listener.Addr().String()
	for i := range 3 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Write([]byte("POST /lock HTTP/1.1\r\nHost: x\r\n")); err != nil {
			t.Fatal(err)
		}
		kit.WaitFor(t, "the half request handed to a lean goroutine", func() bool {
			return e.srv.conns.Load() == 1 && e.srv.leanWorkers.Load() == 1 && e.srv.leanWaitingLen() == 0
		})
		c.Close()
		kit.WaitFor(t, "its goroutine waiting for the next", func() bool {
			return e.srv.conns.Load() == 0 && e.srv.leanWaitingLen() == 1
		})
		if n := e.srv.leanWorkers.Load(); n != 1 {
			t.Fatalf("hand-over %d: %d lean goroutines, want the one reused", i, n)
		}
	}
}

// TestLeanGoroutinesOpenStreams: a stream the event loop reads the request
// of is opened by a lean goroutine, which then waits for the next and
// opens that one too.
func TestLeanGoroutinesOpenStreams(t *testing.T) {
	e := newEnvWith(t, envConfig{})
	for i := range 3 {
		s := e.subscribe(fmt.Sprintf("node_id=n%d", i), "")
		if f := s.Next(t); f.Event != "subscribed" {
			t.Fatalf("stream %d: %+v, want subscribed", i, f)
		}
		kit.WaitFor(t, "the goroutine that opened it waiting for the next", func() bool {
			return e.srv.leanWaitingLen() == 1
		})
		if n := e.srv.leanWorkers.Load(); n != 1 {
			t.Fatalf("stream %d: %d lean goroutines, want the one reused", i, n)
		}
	}
}
