package kit

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// pair connects a client to a server end under h, in the test's bubble.
func pair(t *testing.T, h *Hooks) (client, server net.Conn) {
	t.Helper()
	pl := NewPipeListener()
	t.Cleanup(func() { pl.Close() })
	ln := h.Listen(pl)
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			t.Error(err)
		}
		accepted <- c
	}()
	client, err := pl.Dial(context.Background(), "", "")
	if err != nil {
		t.Fatal(err)
	}
	server = <-accepted
	t.Cleanup(func() { client.Close(); server.Close() })
	return client, server
}

// send writes raw from the client while the server reads n bytes of it,
// and returns the error of the server's read.
func send(t *testing.T, client, server net.Conn, raw string) error {
	t.Helper()
	go func() {
		if _, err := io.WriteString(client, raw); err != nil && !errors.Is(err, io.ErrClosedPipe) {
			t.Error(err)
		}
	}()
	_, err := io.ReadFull(server, make([]byte, len(raw)))
	return err
}

// TestHooksFindStreams: a stream request is recognised after a request
// with a body on the same keep-alive connection, and not in a body.
func TestHooksFindStreams(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var h Hooks
		client, server := pair(t, &h)
		body := "GET /subscribe?node_id=inbody HTTP/1.1\r\n" // no request: a body
		raw := "POST /lock HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n" + body +
			"GET /subscribe?node_id=n HTTP/1.1\r\nHost: x\r\n\r\n"
		if len(body) != 40 {
			t.Fatalf("body of %d bytes", len(body))
		}
		if err := send(t, client, server, raw); err != nil {
			t.Fatal(err)
		}
		if n, in := h.StreamsOpened("n"), h.StreamsOpened("inbody"); n != 1 || in != 0 {
			t.Fatalf("streams seen: n %d, inbody %d; want 1 and 0", n, in)
		}
	})
}

func TestHooksRefuseAndKill(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var h Hooks
		allow := h.RefuseStreams("r")
		client, server := pair(t, &h)
		if err := send(t, client, server, "GET /lock/subscribe?node_id=r HTTP/1.1\r\n\r\n"); err == nil {
			t.Fatal("the server read a refused stream's request")
		}
		if _, err := client.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
			t.Fatalf("the client of a refused stream read %v, want EOF", err)
		}
		allow()
		client, server = pair(t, &h)
		if err := send(t, client, server, "GET /subscribe?node_id=r HTTP/1.1\r\n\r\n"); err != nil {
			t.Fatalf("a stream allowed again: %v", err)
		}
		_, other := pair(t, &h)
		if n := h.KillStreams("r"); n != 1 {
			t.Fatalf("KillStreams closed %d connections, want 1", n)
		}
		if _, err := client.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
			t.Fatalf("the client of a killed stream read %v, want EOF", err)
		}
		if n := h.KillAll(); n != 1 {
			t.Fatalf("KillAll closed %d connections, want the one left", n)
		}
		if _, err := other.Write([]byte("x")); err == nil {
			t.Fatal("a killed connection still writes")
		}
		if h.StreamsOpened("r") != 2 {
			t.Fatalf("%d streams of r counted, want 2 (one refused)", h.StreamsOpened("r"))
		}
		if n := h.Accepted(); n != 3 {
			t.Fatalf("%d connections accepted, want 3 (killed ones too)", n)
		}
	})
}

// TestHooksBlock: a blocked stream's writes wait for the release, or fail
// at the write deadline; another node's stream is not blocked.
func TestHooksBlock(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var h Hooks
		client, server := pair(t, &h)
		if err := send(t, client, server, "GET /subscribe?node_id=b HTTP/1.1\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		release := h.BlockStreams("b")
		wrote := make(chan error, 1)
		go func() {
			_, err := server.Write([]byte("event: x\n\n"))
			wrote <- err
		}()
		synctest.Wait()
		select {
		case err := <-wrote:
			t.Fatalf("a blocked stream's write returned %v", err)
		default:
		}
		release()
		if _, err := io.ReadFull(client, make([]byte, 10)); err != nil {
			t.Fatal(err)
		}
		if err := <-wrote; err != nil {
			t.Fatal(err)
		}

		h.BlockStreams("b")
		server.SetWriteDeadline(time.Now().Add(time.Second))
		start := time.Now()
		if _, err := server.Write([]byte("x")); !errors.Is(err, os.ErrDeadlineExceeded) || time.Since(start) != time.Second {
			t.Fatalf("a blocked write: %v after %v, want the deadline's error after 1s", err, time.Since(start))
		}

		c2, s2 := pair(t, &h)
		if err := send(t, c2, s2, "GET /subscribe?node_id=other HTTP/1.1\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		go s2.Write([]byte("y"))
		if _, err := io.ReadFull(c2, make([]byte, 1)); err != nil {
			t.Fatalf("another node's stream: %v", err)
		}
	})
}
