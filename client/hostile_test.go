package client

import (
	"bytes"
	"context"
	"errors"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/lock"
)

// slack is what may sit in socket buffers and the server's and client's
// bufio buffers between the bytes the hostile server wrote and the bytes
// the client read: the sockets of these tests are given small buffers.
const slack = 2 << 20

// hostileCap is where a hostile server stops: a client that has read this
// much without hanging up reads without a bound.
const hostileCap = 64 << 20

// smallBuffers gives a TCP connection small kernel buffers, so that what
// a hostile server could write is close to what the client read.
func smallBuffers(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetReadBuffer(128 << 10)
		tc.SetWriteBuffer(128 << 10)
	}
}

func smallBufferClient() *http.Client {
	d := &net.Dialer{}
	return &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := d.DialContext(ctx, network, addr)
		if err == nil {
			smallBuffers(c)
		}
		return c, err
	}}}
}

// flood writes prefix and then endless filler until the client hangs up
// or hostileCap bytes are out. It returns the bytes written and whether
// the cap was reached.
func flood(w http.ResponseWriter, r *http.Request, prefix string, filler byte) (sent int64, overrun bool) {
	rc := http.NewResponseController(w)
	n, err := w.Write([]byte(prefix))
	sent += int64(n)
	chunk := bytes.Repeat([]byte{filler}, 32<<10)
	for err == nil && r.Context().Err() == nil {
		if sent >= hostileCap {
			return sent, true
		}
		n, err = w.Write(chunk)
		sent += int64(n)
		if err == nil {
			err = rc.Flush()
		}
	}
	return sent, false
}

type floodResult struct {
	sent    int64
	overrun bool
}

// hostileServer serves handler on 127.0.0.1 with small socket buffers.
func hostileServer(t *testing.T, handler http.HandlerFunc) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: handler, ConnContext: func(ctx context.Context, c net.Conn) context.Context {
		smallBuffers(c)
		return ctx
	}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		hs.Serve(ln)
	}()
	t.Cleanup(func() {
		hs.Close()
		<-done
	})
	return "http://" + ln.Addr().String()
}

// TestEndlessEventLine: a server whose session stream is one endless line
// cannot grow the client: the client drops the stream after MaxEventLine
// bytes, reconnects, and meanwhile waits by polling /status.
func TestEndlessEventLine(t *testing.T) {
	srv := startServer(t, nil)
	var mu sync.Mutex
	var streams []floodResult
	firstDone := make(chan struct{})
	url := hostileServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/subscribe" {
			srv.Handler.ServeHTTP(w, r)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		sent, overrun := flood(w, r, "event: lock_assigned\ndata: ", 'x')
		mu.Lock()
		streams = append(streams, floodResult{sent, overrun})
		if len(streams) == 1 {
			close(firstDone)
		}
		mu.Unlock()
	})

	a := newClient(t, srv, "a")
	if res, err := a.Lock(t.Context(), pull); err != nil || !res.Acquired {
		t.Fatalf("a: %+v %v", res, err)
	}
	b := &Client{Server: url, Node: "b", LongClient: smallBufferClient(), RetryInterval: 20 * time.Millisecond, PollInterval: 50 * time.Millisecond}
	t.Cleanup(func() { b.Close() })
	type outcome struct {
		res Result
		err error
	}
	got := make(chan outcome, 1)
	go func() {
		res, err := b.Lock(t.Context(), pull)
		got <- outcome{res, err}
	}()

	<-firstDone
	mu.Lock()
	first := streams[0]
	mu.Unlock()
	if first.overrun {
		t.Fatalf("the client read %d bytes of one event line without hanging up", first.sent)
	}
	t.Logf("the server wrote %d bytes of the first stream's endless line", first.sent)
	if first.sent > MaxEventLine+slack {
		t.Fatalf("the server wrote %d bytes of one line before the client hung up, want at most %d", first.sent, MaxEventLine+slack)
	}
	kit.WaitFor(t, "b queued", func() bool {
		st, _ := srv.Backend.Status(t.Context(), lock.Pull, pull.Resource, "b")
		return st.Position == 1
	})
	if err := a.Unlock(t.Context(), pull, nil); err != nil {
		t.Fatal(err)
	}
	o := <-got
	if o.err != nil || !o.res.Skipped || o.res.SkippedBy != "a" {
		t.Fatalf("b's wait over a broken stream: %+v %v, want skipped by a (found by polling)", o.res, o.err)
	}
	b.Close()
	mu.Lock()
	defer mu.Unlock()
	for _, s := range streams {
		if s.overrun || s.sent > MaxEventLine+slack {
			t.Errorf("a reconnected stream: the server wrote %d bytes of one line", s.sent)
		}
	}
}

// TestHugeAnswer: an answer longer than MaxAnswer is an error, not a
// silent truncation, and the client stops reading it; an error answer too.
func TestHugeAnswer(t *testing.T) {
	for _, status := range []int{http.StatusOK, http.StatusServiceUnavailable} {
		floods := make(chan floodResult, 1)
		var hits atomic.Int64
		url := hostileServer(t, func(w http.ResponseWriter, r *http.Request) {
			hits.Add(1)
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(status)
			sent, overrun := flood(w, r, `{"type":"pull","resource_id":"`, 'x')
			select {
			case floods <- floodResult{sent, overrun}:
			default: // a retry, which the test reports
			}
		})
		c := &Client{Server: url, Node: "a", ShortClient: smallBufferClient(), RetryInterval: time.Millisecond}
		_, err := c.Status(t.Context(), lock.Pull, "r")
		c.Close()
		if !errors.Is(err, ErrAnswerTooLarge) {
			t.Errorf("HTTP %d with an endless body: %.300v, want ErrAnswerTooLarge", status, err)
		}
		f := <-floods
		t.Logf("HTTP %d: the server wrote %d bytes of the endless answer", status, f.sent)
		if f.overrun || f.sent > MaxAnswer+slack {
			t.Errorf("HTTP %d: the server wrote %d bytes before the client hung up, want at most %d", status, f.sent, MaxAnswer+slack)
		}
		if err != nil && len(err.Error()) > 2<<10 {
			t.Errorf("HTTP %d: an error of %d bytes: the server's text is kept to 1 KiB", status, len(err.Error()))
		}
		if n := hits.Load(); n != 1 {
			t.Errorf("HTTP %d: %d requests: an oversized answer is not retried", status, n)
		}
	}
}

// TestSilenceBoundFromAHostileHeader: the ping interval a server announces
// is bounded before it is doubled, so no header makes the stream's
// watchdog fire at once (an overflow into the negative) or never.
func TestSilenceBoundFromAHostileHeader(t *testing.T) {
	for header, want := range map[string]time.Duration{
		"1000":                 3 * time.Second,
		"":                     31 * time.Second,
		"-5":                   31 * time.Second,
		"0":                    31 * time.Second,
		"1e3":                  31 * time.Second,
		"9223372036854775807":  2*time.Hour + time.Second,
		"99999999999999999999": 31 * time.Second, // not an int64
	} {
		if got := silenceBound(header); got != want {
			t.Errorf("%s: %q gives %v, want %v", api.PingHeader, header, got, want)
		}
	}
}
