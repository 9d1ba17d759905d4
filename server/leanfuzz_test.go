package server

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/textproto"
	"net/url"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/net/http/httpguts"
)

const smuggleLock = `{"type":"pull","resource_id":"smuggle","node_id":"a"}`

// smuggledUnlock is a /unlock of smuggleLock's hold hidden in what net/http
// reads as the chunked body of a /cancel: the lean loop, splitting header
// lines on CRLF only, took the Transfer-Encoding behind a bare LF for part of
// another header, read a 4-byte Content-Length body, and then executed the
// /unlock as the next request.
var smuggledUnlock = func() string {
	unlock := rawPost("/unlock", `{"type":"pull","resource_id":"smuggle","node_id":"a","success":true}`)
	chunk := strconv.FormatInt(int64(len(unlock)), 16) + "\r\n"
	return "POST /cancel HTTP/1.1\r\nHost: x\r\nContent-Length: " + strconv.Itoa(len(chunk)) +
		"\r\nX-Pad: 1\nTransfer-Encoding: chunked\r\n\r\n" + chunk + unlock + "\r\n0\r\n\r\n"
}()

// framingCases are requests the lean loop once answered although net/http
// frames them differently or refuses them (400). Each carries a /lock of
// smuggleLock, which must not take effect. (A CRLF after a body that
// net/http reads as chunked ends its chunk-size line, so that it refuses
// the body at once instead of waiting for more.)
var framingCases = []struct{ name, raw string }{
	{"bare LF hides Transfer-Encoding", "POST /lock HTTP/1.1\r\nHost: x\r\nContent-Length: " + strconv.Itoa(len(smuggleLock)) + "\r\nX-Pad: 1\nTransfer-Encoding: chunked\r\n\r\n" + smuggleLock + "\r\n"},
	{"bare LF ends the head", "POST /lock HTTP/1.1\r\nHost: x\r\nContent-Length: " + strconv.Itoa(len(smuggleLock)) + "\r\n\nX: y\r\n\r\n" + smuggleLock},
	{"smuggled unlock in a chunked body", smuggledUnlock},
	{"Content-Length with a sign", rawPostCL("+", "", "")},
	{"vertical tab before the length", rawPostCL("\v", "", "")},
	{"vertical tab after the length", rawPostCL("", "\v", "")},
	{"NBSP after the length", rawPostCL("", "\u00a0", "")},
	{"NEL before the length", rawPostCL("\u0085", "", "")},
	{"form feed after the length", rawPostCL("", "\f", "")},
	{"NUL in a header", rawPostCL("", "", "X-A: b\x00c\r\n")},
	{"space inside a header name", rawPostCL("", "", "X Y: z\r\n")},
	{"space before the colon", rawPostCL("", "", "Connection : close\r\n")},
	{"folded header line", rawPostCL("", "", "X-A: b\r\n c\r\n")},
	{"bare CR in a header", rawPostCL("", "", "X-A: b\rTransfer-Encoding: chunked\r\n")},
	{"bare CR in the request line", "POST /lock\rX HTTP/1.1\r\nHost: x\r\nContent-Length: " + strconv.Itoa(len(smuggleLock)) + "\r\n\r\n" + smuggleLock},
	{"missing Host", "POST /lock HTTP/1.1\r\nContent-Length: " + strconv.Itoa(len(smuggleLock)) + "\r\n\r\n" + smuggleLock},
	{"two Host headers", rawPostCL("", "", "Host: y\r\n")},
	{"malformed Host", "POST /lock HTTP/1.1\r\nHost: a b\r\nContent-Length: " + strconv.Itoa(len(smuggleLock)) + "\r\n\r\n" + smuggleLock},
	{"two different lengths", rawPostCL("", "", "Content-Length: 3\r\n")},
	{"transfer-ENCODING", rawPostCL("", "", "transfer-ENCODING: chunked\r\n") + "\r\n"},
	{"Transfer-Encoding identity", rawPostCL("", "", "Transfer-Encoding: identity\r\n")},
	// net/http reads a GET's body; the lean loop opens streams only of
	// a GET without one.
	{"a stream's GET with a body", "GET /subscribe HTTP/1.1\r\nHost: x\r\nContent-Length: " + strconv.Itoa(len(rawPost("/lock", smuggleLock))) + "\r\n\r\n" + rawPost("/lock", smuggleLock)},
}

// rawPostCL is a /lock of smuggleLock whose Content-Length value has before
// and after around it, with extra header lines.
func rawPostCL(before, after, extra string) string {
	return "POST /lock HTTP/1.1\r\nHost: x\r\nContent-Length: " + before + strconv.Itoa(len(smuggleLock)) + after + "\r\n" + extra + "\r\n" + smuggleLock
}

// leanRead is a request as the lean loop read it.
type leanRead struct {
	method, path, auth string
	query, lastID      string // a stream's
	body               []byte
	end                int // offset just past it
	close              bool
}

// readOf is the leanRead of req, which ends at end.
func readOf(req leanRequest, end int) leanRead {
	rq := request{head: req.head}
	r := leanRead{method: http.MethodPost, path: req.path, auth: rq.header("Authorization"), body: bytes.Clone(req.body), end: end, close: req.close}
	if req.stream {
		r.method, r.query, r.lastID = http.MethodGet, req.query, rq.header("Last-Event-ID")
	}
	return r
}

// leanReads runs the lean loop's parser over data as serveLean does:
// request after request until it declines one.
func leanReads(data []byte) []leanRead {
	br := bufio.NewReaderSize(bytes.NewReader(data), leanBufSize)
	var out []leanRead
	pos := 0
	for {
		if _, err := br.Peek(1); err != nil {
			return out
		}
		req, st := peekRequest(br, nil)
		if st != leanServe {
			return out
		}
		pos += req.size
		out = append(out, readOf(req, pos))
		_, _ = br.Discard(req.size)
		if req.close {
			return out
		}
	}
}

// pollerReads runs the event loop's parser over data as a poller does
// (poller.go): read after read of up to leanBufSize bytes, each answered
// request by request, until a read leaves bytes it does not answer (the
// connection then goes to the lean loop's goroutine).
func pollerReads(data []byte) []leanRead {
	var out []leanRead
	pos := 0
	for pos < len(data) {
		b := data[pos:min(len(data), pos+leanBufSize)]
		for len(b) > 0 {
			req, st := leanNext(b)
			if st != leanServe || req.stream {
				return out // a stream is the lean loop's
			}
			pos += req.size
			out = append(out, readOf(req, pos))
			b = b[req.size:]
			if req.close {
				return out
			}
		}
	}
	return out
}

type countingReader struct {
	r io.Reader
	n int
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += n
	return n, err
}

// serverChecks are the checks net/http's server makes after
// http.ReadRequest (net/http/server.go, (*conn).readRequest).
func serverChecks(req *http.Request, host []string) error {
	if req.ProtoMajor != 1 {
		return errors.New("unsupported protocol version")
	}
	if req.ProtoAtLeast(1, 1) && len(host) == 0 && req.Method != "CONNECT" {
		return errors.New("missing required Host header")
	}
	if len(host) > 1 {
		return errors.New("too many Host headers")
	}
	if len(host) == 1 && !httpguts.ValidHostHeader(host[0]) {
		return errors.New("malformed Host header")
	}
	for k, vv := range req.Header {
		if !httpguts.ValidHeaderFieldName(k) {
			return errors.New("invalid header name")
		}
		for _, v := range vv {
			if !httpguts.ValidHeaderFieldValue(v) {
				return errors.New("invalid header value")
			}
		}
	}
	return nil
}

// netHTTPReads reads n requests from data as net/http's server does.
func netHTTPReads(data []byte, n int, check func(i int, req *http.Request, body []byte, end int) error) error {
	cr := &countingReader{r: bytes.NewReader(data)}
	br := bufio.NewReader(cr)
	last := ""
	for i := range n {
		if last == http.MethodPost {
			// After a POST the server skips up to 4 CR or LF (RFC 9112 §2.2).
			peek, _ := br.Peek(4)
			k := 0
			for k < len(peek) && (peek[k] == '\r' || peek[k] == '\n') {
				k++
			}
			_, _ = br.Discard(k)
		}
		hosts := hostsAt(data[cr.n-br.Buffered():])
		req, err := http.ReadRequest(br)
		if err != nil {
			return fmt.Errorf("request %d: net/http: %v", i, err)
		}
		if err := serverChecks(req, hosts); err != nil {
			return fmt.Errorf("request %d: net/http's server: %v", i, err)
		}
		body, err := io.ReadAll(req.Body)
		if err != nil {
			return fmt.Errorf("request %d: net/http reading the body: %v", i, err)
		}
		if err := check(i, req, body, cr.n-br.Buffered()); err != nil {
			return fmt.Errorf("request %d: %v", i, err)
		}
		last = req.Method
	}
	return nil
}

// hostsAt returns the Host header values of the request at the start of
// data as net/http's server sees them (it reads the head with
// net/textproto, as here; http.ReadRequest then drops them from req.Header).
func hostsAt(data []byte) []string {
	tp := textproto.NewReader(bufio.NewReader(bytes.NewReader(data)))
	if _, err := tp.ReadLine(); err != nil {
		return nil
	}
	h, err := tp.ReadMIMEHeader()
	if err != nil {
		return nil
	}
	return h["Host"]
}

// queryOf is a raw query as net/http's URL.Query reads it.
func queryOf(raw string) url.Values {
	v, _ := url.ParseQuery(raw)
	return v
}

// FuzzLeanMatchesNetHTTP holds the lean loop to net/http: every request
// the lean loop answers on a connection is one net/http reads at the same
// place, with the same method, path, query, body, Authorization,
// Last-Event-ID and keep-alive, and does not refuse. The event loop, which
// answers what it read before it hands a connection to the lean loop,
// answers the same requests as the lean loop, up to where it hands over (a
// stream is always handed over).
func FuzzLeanMatchesNetHTTP(f *testing.F) {
	for _, c := range framingCases {
		f.Add([]byte(c.raw))
	}
	f.Add([]byte(rawPost("/lock", smuggleLock) + rawPost("/unlock", "{}", "Authorization: Bearer t", "Connection: close")))
	f.Add([]byte(rawPost("/cancel", "{}", "Connection: keep-alive") + "\r\n" + rawPost("/lock", "{}")))
	// Pipelined requests across the event loop's first read.
	f.Add([]byte(strings.Repeat(rawPost("/lock", smuggleLock), 2*leanBufSize/len(rawPost("/lock", smuggleLock))+1)))
	// Streams, and what follows one answered with an error.
	f.Add([]byte("GET /subscribe?node_id=a HTTP/1.1\r\nHost: x\r\nLast-Event-ID: 7\r\n\r\n"))
	f.Add([]byte("GET /subscribe?type=pull&resource_id=r%20s&node_id=a;b HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t\r\n\r\n" + rawPost("/lock", smuggleLock)))
	f.Add([]byte("GET /subscribe?node_id=%zz#f HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
	f.Add([]byte("GET /sub%73cribe?node_id=a HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		lean := leanReads(data)
		polled := pollerReads(data)
		if len(polled) > len(lean) {
			t.Fatalf("%q: the event loop answers %d requests, the lean loop %d", data, len(polled), len(lean))
		}
		for i, p := range polled {
			if l := lean[i]; !reflect.DeepEqual(p, l) {
				t.Fatalf("%q: request %d: the event loop read %+v, the lean loop %+v", data, i, p, l)
			}
		}
		if len(lean) == 0 {
			return
		}
		err := netHTTPReads(data, len(lean), func(i int, req *http.Request, body []byte, end int) error {
			l := lean[i]
			switch {
			case req.Method != l.method || req.URL.Path != l.path || req.URL.RawQuery != l.query || (l.method == http.MethodPost && req.RequestURI != l.path):
				return fmt.Errorf("net/http read %s %s (%s), the lean loop %s %s?%s", req.Method, req.URL.Path, req.RequestURI, l.method, l.path, l.query)
			case !reflect.DeepEqual(req.URL.Query(), queryOf(l.query)):
				return fmt.Errorf("net/http reads the query %v, the lean loop %v", req.URL.Query(), queryOf(l.query))
			case req.Header.Get("Last-Event-ID") != l.lastID:
				return fmt.Errorf("net/http reads Last-Event-ID %q, the lean loop %q", req.Header.Get("Last-Event-ID"), l.lastID)
			case !bytes.Equal(body, l.body):
				return fmt.Errorf("net/http read body %q, the lean loop %q", body, l.body)
			case end != l.end:
				return fmt.Errorf("net/http ends it at %d, the lean loop at %d", end, l.end)
			case req.Header.Get("Authorization") != l.auth:
				return fmt.Errorf("net/http reads Authorization %q, the lean loop %q", req.Header.Get("Authorization"), l.auth)
			case req.Close != l.close:
				return fmt.Errorf("net/http closes after it: %v, the lean loop: %v", req.Close, l.close)
			}
			return nil
		})
		if err != nil {
			t.Fatalf("%q: %v", data, err)
		}
	})
}
