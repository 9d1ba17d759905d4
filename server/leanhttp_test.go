package server

import (
	"bufio"
	"bytes"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
)

// rawExchange writes raw bytes on one connection and reads n answers.
func rawExchange(t *testing.T, addr, raw string, n int) []*http.Response {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, raw); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	var out []*http.Response
	for range n {
		resp, err := http.ReadResponse(br, nil)
		for err == nil && resp.StatusCode == http.StatusContinue {
			resp, err = http.ReadResponse(br, nil)
		}
		if err != nil {
			t.Fatalf("answer %d: %v", len(out)+1, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body = io.NopCloser(strings.NewReader(string(body)))
		out = append(out, resp)
	}
	return out
}

func rawPost(path, body string, headers ...string) string {
	h := ""
	for _, x := range headers {
		h += x + "\r\n"
	}
	return "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n" + h + "\r\n" + body
}

func bodyOf(r *http.Response) string { b, _ := io.ReadAll(r.Body); return string(b) }

// TestLeanLoop: the lean loop answers pipelined hot requests in order, and
// hands a connection to net/http at the first request it does not take,
// with nothing lost.
func TestLeanLoop(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) { testLeanLoop(t, l.goroutines) })
	}
}

func testLeanLoop(t *testing.T, goroutines bool) {
	e := newEnvWith(t, envConfig{goroutines: goroutines})
	addr := strings.TrimPrefix(e.ts.URL, "http://")
	lockA := `{"type":"pull","resource_id":"r","node_id":"a"}`
	lockB := `{"type":"pull","resource_id":"r","node_id":"b"}`
	raw := rawPost("/lock", lockA) + rawPost("/lock", lockB) +
		"GET /status?type=pull&resource_id=r HTTP/1.1\r\nHost: x\r\n\r\n" + // handed to net/http
		rawPost("/unlock", `{"type":"pull","resource_id":"r","node_id":"a","success":false}`) // net/http, same connection
	rs := rawExchange(t, addr, raw, 4)
	want := []string{`"acquired":true`, `"queued":true`, `"state":"held"`, `"next_holder":"b"`}
	for i, r := range rs {
		if body := bodyOf(r); r.StatusCode != 200 || !strings.Contains(body, want[i]) || r.Header.Get("Dlock-Epoch") != e.m.Info().Epoch {
			t.Fatalf("answer %d: %d %s %v", i+1, r.StatusCode, body, r.Header)
		}
	}
	cases := []struct {
		name, raw string
		status    int
		code      string
	}{
		{"bad JSON", rawPost("/lock", `{"type":`), 400, "invalid_request"},
		{"expect 100-continue", rawPost("/lock", lockA, "Expect: 100-continue"), 200, ""},
		{"chunked body", "POST /cancel HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + "2f\r\n" + lockB + "\r\n0\r\n\r\n", 200, ""},
		{"wrong method", "GET /lock HTTP/1.1\r\nHost: x\r\n\r\n", 405, "method_not_allowed"},
		{"too large", rawPost("/lock", `{"type":"pull","resource_id":"`+strings.Repeat("x", 70<<10)+`"}`), 413, "too_large"},
		{"no length", "POST /lock HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid_request"},
		{"HTTP/1.0", "POST /unlock HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}", 400, "invalid_request"},
	}
	for _, c := range cases {
		r := rawExchange(t, addr, c.raw, 1)[0]
		if body := bodyOf(r); r.StatusCode != c.status || !strings.Contains(body, c.code) {
			t.Errorf("%s: %d %s, want %d %s", c.name, r.StatusCode, body, c.status, c.code)
		}
	}
	// Connection: close is honoured.
	c, _ := net.Dial("tcp", addr)
	defer c.Close()
	io.WriteString(c, rawPost("/lock", lockA, "Connection: close"))
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	all, err := io.ReadAll(c)
	if err != nil || !strings.Contains(string(all), `"acquired":true`) {
		t.Fatalf("Connection: close: %q %v", all, err)
	}
}

// BenchmarkLeanParse: the lean loop's parse of a typical hot request.
func BenchmarkLeanParse(b *testing.B) {
	raw := []byte("POST /lock HTTP/1.1\r\nHost: 127.0.0.1:7380\r\nUser-Agent: Go-http-client/1.1\r\nContent-Length: 60\r\nContent-Type: application/json\r\nAccept-Encoding: gzip\r\n\r\n" +
		`{"type":"pull","resource_id":"sha256:0123456789","node_id":"n1"}`[:60])
	rd := bytes.NewReader(raw)
	br := bufio.NewReaderSize(rd, leanBufSize)
	b.ReportAllocs()
	for b.Loop() {
		rd.Reset(raw)
		br.Reset(rd)
		if _, st := peekRequest(br, nil); st != leanServe {
			b.Fatal(st)
		}
	}
}

// readUntil reads a stream's lines up to the one that holds want, and
// returns them all.
func readUntil(t *testing.T, br *bufio.Reader, want string) string {
	t.Helper()
	seen := ""
	for !strings.Contains(seen, want) {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("the stream ended: %v, after %q", err, seen)
		}
		seen += line
	}
	return seen
}

// TestLeanStream: a plain GET of /subscribe opens its stream from the lean
// loop, never net/http, on both loops: the answers to the requests before
// it go out first, a /subscribe refused is answered and the connection
// serves the next request, and the stream that opens has the connection.
func TestLeanStream(t *testing.T) {
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) { testLeanStream(t, l.goroutines) })
	}
}

func testLeanStream(t *testing.T, goroutines bool) {
	e := newEnvWith(t, envConfig{goroutines: goroutines, prep: leanOnly(t)})
	lockA := `{"type":"pull","resource_id":"r","node_id":"a"}`
	c, err := net.Dial("tcp", e.addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(c, rawPost("/lock", lockA)+
		"GET /subscribe?node_id= HTTP/1.1\r\nHost: x\r\n\r\n"+ // refused: no node, no key
		rawPost("/cancel", `{"type":"pull","resource_id":"r","node_id":"b"}`)+
		"GET /subscribe?node_id=a HTTP/1.1\r\nHost: x\r\nLast-Event-ID: 0\r\n\r\n")
	br := bufio.NewReader(c)
	for i, want := range []struct {
		status int
		body   string
	}{{200, `"acquired":true`}, {400, `"invalid_request"`}, {200, `"dequeued":false`}} {
		r, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("answer %d: %v", i+1, err)
		}
		if body := bodyOf(r); r.StatusCode != want.status || !strings.Contains(body, want.body) {
			t.Fatalf("answer %d: %d %s, want %d %s", i+1, r.StatusCode, body, want.status, want.body)
		}
	}
	r, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if r.StatusCode != 200 || r.Header.Get("Content-Type") != "text/event-stream" || r.Header.Get("Dlock-Epoch") != e.m.Info().Epoch {
		t.Fatalf("the stream's answer: %d %v", r.StatusCode, r.Header)
	}
	// The stream is a's session's: a grant to a is told on it.
	e.call("POST", "/lock", `{"type":"pull","resource_id":"r2","node_id":"a"}`)
	if seen := readUntil(t, bufio.NewReader(r.Body), "event: lock_assigned"); !strings.Contains(seen, "event: subscribed") {
		t.Fatalf("no subscribed event first: %q", seen)
	}
}
