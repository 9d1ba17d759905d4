package rawhttp

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
)

func TestReadEvent(t *testing.T) {
	r := bufio.NewReader(strings.NewReader(": ping\n\n" +
		"retry: 1000\nevent: subscribed\ndata: {\"a\":1}\n\n" +
		"id: 7\r\nevent: lock_assigned\r\ndata:one\r\ndata: two\r\n\r\n" +
		"event: x\nbogus: y\n\n"))
	var ev Event
	want := []Event{
		{Name: "subscribed", Data: []byte(`{"a":1}`), Retry: "1000"},
		{ID: "7", Name: "lock_assigned", Data: []byte("one\ntwo")},
	}
	for i, w := range want {
		if err := ReadEvent(r, &ev); err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
		if ev.ID != w.ID || ev.Name != w.Name || string(ev.Data) != string(w.Data) || ev.Retry != w.Retry {
			t.Fatalf("event %d: %+v, want %+v", i, ev, w)
		}
	}
	if err := ReadEvent(r, &ev); err == nil || !strings.Contains(err.Error(), "bogus") {
		t.Fatalf("a stray field: %v, want an error naming the line", err)
	}
	if err := ReadEvent(bufio.NewReader(strings.NewReader("event: cut")), &ev); !errors.Is(err, io.EOF) {
		t.Fatalf("a stream that ends mid-event: %v, want EOF", err)
	}
	// Lines longer than the reader's buffer are read across its reads,
	// up to MaxEventLine.
	long := bufio.NewReaderSize(strings.NewReader("id: 12345678901234567890\ndata: "+strings.Repeat("x", 100)+"\n\nevent: "+strings.Repeat("y", 40)+"\n\n"), 16)
	if err := ReadEvent(long, &ev); err != nil || ev.ID != "12345678901234567890" || string(ev.Data) != strings.Repeat("x", 100) {
		t.Fatalf("lines over the buffer: %+v, %v", ev, err)
	}
	if err := ReadEvent(long, &ev); err != nil || ev.Name != strings.Repeat("y", 40) || ev.ID != "" || len(ev.Data) != 0 {
		t.Fatalf("the event after them: %+v, %v", ev, err)
	}
	huge := bufio.NewReaderSize(io.MultiReader(strings.NewReader("data: "), strings.NewReader(strings.Repeat("x", MaxEventLine))), 16)
	if err := ReadEvent(huge, &ev); err == nil || !strings.Contains(err.Error(), "over 1048576 bytes") {
		t.Fatalf("a line over MaxEventLine: %v", err)
	}
}

func TestStreamLine(t *testing.T) {
	s := &Stream{r: bufio.NewReaderSize(strings.NewReader(": ping\n\nevent: x\r\n"+strings.Repeat("y", 40)+"\n"), 16)}
	for _, want := range []string{": ping\n", "\n", "event: x\r\n"} {
		if line, err := s.Line(); err != nil || string(line) != want {
			t.Fatalf("line %q %v, want %q", line, err, want)
		}
	}
	if _, err := s.Line(); err == nil || !strings.Contains(err.Error(), "over 16 bytes") {
		t.Fatalf("a line over the buffer: %v", err)
	}
}

// serverHead is the head of a dlock server's stream answer as the lean and
// event loops write it (server/sse.go, takeStream).
const serverHead = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nX-Accel-Buffering: no\r\n" +
	"Connection: close\r\nDlock-Ping-Ms: 15000\r\nDlock-Epoch: 63615c664835dbd4\r\n\r\n"

func TestLeanHead(t *testing.T) {
	first := "id: 1\nevent: subscribed\ndata: {}\n\n"
	for _, tc := range []struct {
		in             string
		n              int
		complete, lean bool
	}{
		{serverHead + first, len(serverHead), true, true},
		{serverHead[:40], 0, false, true},                // more may come
		{serverHead[:len(serverHead)-1], 0, false, true}, // the last LF to come
		{"HTTP/1.", 0, false, true},                      // the status line cut short
		{"HTTP/1.1 503 Service Unavailable\r\n", 0, false, false},
		{"HTTP/1.0 200 OK\r\n\r\n", 0, false, false},
		{"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", 0, false, false},
		{"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", 0, false, false},
		{"HTTP/1.1 200 OK\r\n folded\r\n\r\n", 0, false, false},
		{"HTTP/1.1 200 OK\nA: b\n\n", 0, false, false}, // bare LF: net/http's to read
		{"HTTP/1.1 200 OK\r\nA b: c\r\n\r\n", 0, false, false},
		{"HTTP/1.1 200 OK\r\nA: b\x00\r\n\r\n", 0, false, false},
		{"HTTP/1.1 200 \r\nA:\r\n\r\n", len("HTTP/1.1 200 \r\nA:\r\n\r\n"), true, true},
	} {
		n, complete, lean := leanHead([]byte(tc.in))
		if n != tc.n || complete != tc.complete || lean != tc.lean {
			t.Errorf("leanHead(%q) = %d, %v, %v; want %d, %v, %v", tc.in, n, complete, lean, tc.n, tc.complete, tc.lean)
		}
	}
}

// TestStreamLeanHead: a stream whose head the lean path reads, in pieces
// as a network delivers it, gives the events after it and the header
// net/http gives.
func TestStreamLeanHead(t *testing.T) {
	client, server := net.Pipe()
	defer client.Close()
	go func() {
		defer server.Close()
		all := serverHead + "id: 1\nevent: subscribed\ndata: {}\n\nevent: x\ndata: y\n\n"
		for i := 0; i < len(all); i += 7 {
			if _, err := server.Write([]byte(all[i:min(i+7, len(all))])); err != nil {
				return
			}
		}
	}()
	br := bufio.NewReaderSize(client, streamBufSize)
	head, ok := peekHead(br)
	if !ok || string(head) != serverHead {
		t.Fatalf("peekHead: %q, %v; want the server's head, true", head, ok)
	}
	s := &Stream{conn: client, r: br, head: bytes.Clone(head)}
	br.Discard(len(head))
	for _, want := range []string{"subscribed", "x"} {
		if name, _, err := s.Next(); err != nil || name != want {
			t.Fatalf("event %q, %v; want %q", name, err, want)
		}
	}
	if got := s.Header().Get("Dlock-Ping-Ms"); got != "15000" {
		t.Fatalf("Dlock-Ping-Ms: %q", got)
	}
}

// FuzzStreamHeadMatchesNetHTTP holds leanHead to net/http: a head it
// takes, http.ReadResponse reads as a 200 of the same length whose body is
// the rest of the connection; and where it waits for more bytes, net/http
// too would need more (peekHead never waits on a peer that has said all
// it will).
func FuzzStreamHeadMatchesNetHTTP(f *testing.F) {
	f.Add([]byte(serverHead + "id: 1\n\n"))
	f.Add([]byte(serverHead[:60]))
	f.Add([]byte("HTTP/1.1 200 \r\nA:\r\nB: c\td\r\n\r\n"))
	f.Add([]byte("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"))
	f.Add([]byte("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"))
	f.Add([]byte("HTTP/1.1 200 OK\r\nA: b\r\n c\r\n\r\n"))
	f.Add([]byte("HTTP/1.1 200 OK\r\nTrailer: X\r\nConnection: keep-alive\r\n\r\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		n, complete, lean := leanHead(b)
		if !complete {
			if n != 0 {
				t.Fatalf("incomplete with n = %d", n)
			}
			if lean {
				// A peer that has sent b and waits: net/http too must
				// want more than b to decide.
				if err := readStarving(b); err != errStarved {
					t.Fatalf("leanHead waits for more after %q; net/http decided: %v", b, err)
				}
			}
			return
		}
		if !lean || n <= 0 || n > len(b) {
			t.Fatalf("complete: n = %d, lean %v", n, lean)
		}
		br := bufio.NewReaderSize(bytes.NewReader(b), len(b)+16)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("leanHead took %q; net/http: %v", b[:n], err)
		}
		if resp.StatusCode != http.StatusOK || len(resp.TransferEncoding) > 0 || resp.ContentLength != -1 {
			t.Fatalf("leanHead took %q; net/http: status %d, transfer-encoding %v, content-length %d", b[:n], resp.StatusCode, resp.TransferEncoding, resp.ContentLength)
		}
		if rest := br.Buffered(); rest != len(b)-n {
			t.Fatalf("leanHead took %d bytes of %q; net/http %d", n, b, len(b)-rest)
		}
		// The body is the rest, byte for byte.
		body, err := io.ReadAll(resp.Body)
		if err != nil || !bytes.Equal(body, b[n:]) {
			t.Fatalf("body %q, %v; want %q", body, err, b[n:])
		}
	})
}

// errStarved is a read past what the peer has sent: on a connection, a
// read that waits.
var errStarved = errors.New("starved")

// readStarving reads an answer's head from b with net/http, as from a peer
// that has sent b and waits: errStarved if net/http read past b. A reader's
// error would not do: bufio.Reader.ReadLine hands a line cut short by one
// back as a whole line.
func readStarving(b []byte) (err error) {
	defer func() {
		if r := recover(); r != nil {
			if r != errStarved {
				panic(r)
			}
			err = errStarved
		}
	}()
	_, err = http.ReadResponse(bufio.NewReader(starving{bytes.NewReader(b)}), nil)
	return err
}

// starving reads r, then panics with errStarved where a connection would
// wait.
type starving struct{ r *bytes.Reader }

func (s starving) Read(p []byte) (int, error) {
	if s.r.Len() == 0 {
		panic(errStarved)
	}
	return s.r.Read(p)
}
