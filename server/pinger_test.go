package server

import (
	"bufio"
	"context"
	"net"
	"testing"
	"testing/synctest"
	"time"

	"github.com/dlock/dlock/lock/memory"
)

// TestPingerTurns: in fake time, a stream is pinged once quiet for the
// interval but a turn and never later than the interval: its first ping
// comes an interval after it opened (not half of one), the next an interval
// after that, and one after an event an interval but a turn after it at
// the soonest. A stream opened between two turns is pinged as soon after
// it opened as one opened on a turn.
func TestPingerTurns(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const ping = 800 * time.Millisecond
		const turn = ping / pingTurns
		m, err := memory.New(context.Background(), memory.DefaultConfig())
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		s := New(m, Options{PingInterval: ping})
		defer func() {
			s.Drain() // the hub's writers and pinger stop once drained
			s.Close()
		}()

		open := func() (*bufio.Reader, *fakeFeed, net.Conn) {
			client, conn := net.Pipe()
			f := newFakeFeed()
			if !s.hub.admit() {
				t.Fatal("the hub refused a stream")
			}
			s.metrics.streams.Inc()
			if s.hub.start(conn, f.source(), []byte("first\n"), nil, nil) == nil {
				t.Fatal("the hub refused a stream")
			}
			br := bufio.NewReader(client)
			if line, err := br.ReadString('\n'); err != nil || line != "first\n" {
				t.Fatalf("first bytes %q, %v", line, err)
			}
			return br, f, client
		}
		// next reads the stream's next line and says how long after since
		// it came.
		next := func(br *bufio.Reader, want string, since time.Time) time.Duration {
			t.Helper()
			line, err := br.ReadString('\n')
			if err != nil || line != want {
				t.Fatalf("read %q, %v; want %q", line, err, want)
			}
			if want == ": ping\n" {
				if blank, err := br.ReadString('\n'); err != nil || blank != "\n" {
					t.Fatalf("after a ping %q, %v", blank, err)
				}
			}
			return time.Since(since)
		}
		between := func(what string, d, lo, hi time.Duration) {
			t.Helper()
			if d < lo || d > hi {
				t.Fatalf("%s after %v, want within [%v, %v]", what, d, lo, hi)
			}
		}

		a, fa, ca := open()
		defer ca.Close()
		opened := time.Now()
		between("the first ping", next(a, ": ping\n", opened), ping-turn, ping)
		pinged := time.Now()
		between("the second ping", next(a, ": ping\n", pinged), ping-turn, ping)

		time.Sleep(3 * turn / 2)
		fa.offer("x")
		if d := next(a, "data: x\n", time.Now()); d != 0 {
			t.Fatalf("the event waited %v", d)
		}
		if blank, err := a.ReadString('\n'); err != nil || blank != "\n" {
			t.Fatalf("after the event %q, %v", blank, err)
		}
		evented := time.Now()
		between("the ping after an event", next(a, ": ping\n", evented), ping-turn, ping)

		// A second stream, opened half a turn after one: pinged on a turn
		// of its own, once quiet for the interval but a turn.
		time.Sleep(3 * turn / 2)
		b, _, cb := open()
		defer cb.Close()
		between("b's first ping", next(b, ": ping\n", time.Now()), ping-turn, ping)
	})
}
