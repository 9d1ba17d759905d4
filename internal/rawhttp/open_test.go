package rawhttp

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeServer answers every GET /subscribe on 127.0.0.1 with answer(node),
// written in pieces of step bytes, and then holds the connection until its
// client closes it (or closes it at once, when hold says not to). It records the nodes it was asked for, the headers of
// the first request, and the connections still open.
type fakeServer struct {
	ln     net.Listener
	answer func(node string) (text string, hold bool)
	step   int
	wg     sync.WaitGroup

	mu    sync.Mutex
	nodes map[string]int
	head  []string
	open  int
	conns map[net.Conn]bool
}

func newFakeServer(t *testing.T, step int, answer func(node string) (string, bool)) *fakeServer {
	t.Helper()
	return newFakeServerOn(t, "127.0.0.1:0", step, answer)
}

// newFakeServerOn is newFakeServer listening on addr.
func newFakeServerOn(t *testing.T, addr string, step int, answer func(node string) (string, bool)) *fakeServer {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	s := &fakeServer{ln: ln, answer: answer, step: step, nodes: map[string]int{}, conns: map[net.Conn]bool{}}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				s.serve(c)
			}()
		}
	}()
	t.Cleanup(func() {
		// Its side of every connection too: a test that failed with
		// streams open ends rather than waits for them.
		ln.Close()
		s.mu.Lock()
		for c := range s.conns {
			c.Close()
		}
		s.mu.Unlock()
		s.wg.Wait()
	})
	return s
}

func (s *fakeServer) base() string { return "http://" + s.ln.Addr().String() }

func (s *fakeServer) serve(c net.Conn) {
	s.mu.Lock()
	s.open++
	s.conns[c] = true
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.open--
		delete(s.conns, c)
		s.mu.Unlock()
	}()
	defer c.Close() // before the count falls
	br := bufio.NewReader(c)
	line, err := br.ReadString('\n')
	if err != nil {
		return
	}
	var head []string
	for {
		h, err := br.ReadString('\n')
		if err != nil {
			return
		}
		if h == "\r\n" {
			break
		}
		head = append(head, strings.TrimSuffix(h, "\r\n"))
	}
	target := strings.Fields(line)[1]
	u, _ := url.Parse(target)
	node := u.Query().Get("node_id")
	s.mu.Lock()
	s.nodes[node]++
	if s.head == nil {
		s.head = head
	}
	s.mu.Unlock()
	a, hold := s.answer(node)
	for i := 0; i < len(a); i += s.step {
		if _, err := c.Write([]byte(a[i:min(i+s.step, len(a))])); err != nil {
			return
		}
	}
	if !hold {
		return
	}
	// Held until the client closes it: a read sees its end.
	_, _ = br.ReadByte()
}

func (s *fakeServer) openConns() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.open
}

// clientFDs counts this process's descriptors of sockets connected to the
// fake server s (its own accepted ones, in this process too, are not).
func (s *fakeServer) clientFDs(t *testing.T) int {
	t.Helper()
	port := s.ln.Addr().(*net.TCPAddr).Port
	toServer := map[string]bool{}
	for _, f := range []string{"/proc/self/net/tcp", "/proc/self/net/tcp6"} {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			// sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
			fields := strings.Fields(line)
			if len(fields) < 10 {
				continue
			}
			_, rport, _ := strings.Cut(fields[2], ":")
			if p, err := strconv.ParseUint(rport, 16, 16); err == nil && int(p) == port {
				toServer[fields[9]] = true
			}
		}
	}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		link, err := os.Readlink("/proc/self/fd/" + e.Name())
		if inode, ok := strings.CutPrefix(link, "socket:["); err == nil && ok && toServer[strings.TrimSuffix(inode, "]")] {
			n++
		}
	}
	return n
}

// fds counts this process's open descriptors.
func fds(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

func nodeName(i int) string { return "n-" + strconv.Itoa(i) }

// TestOpenIdle: OpenIdle opens every node's stream once, each read up to
// its subscribed event however the answer arrives in pieces (a ping before
// it included), sends the token, and Close closes them all.
func TestOpenIdle(t *testing.T) {
	const n = 200
	for _, step := range []int{1, 7, 1 << 20} {
		t.Run(fmt.Sprintf("pieces of %d", step), func(t *testing.T) {
			s := newFakeServer(t, step, func(node string) (string, bool) {
				return serverHead + ": ping\n\nid: 1\nevent: subscribed\ndata: {\"node_id\":\"" + node + "\"}\n\n", true
			})
			idle, err := Dialer{Token: "s3cret"}.OpenIdle(context.Background(), s.base(), n, 16, nodeName)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(idle.Close) // before the server's, which waits for it
			if got := s.clientFDs(t); idle.Len() != n || got != n {
				t.Fatalf("%d streams, %d sockets to the server; want %d", idle.Len(), got, n)
			}
			s.mu.Lock()
			asked, head := len(s.nodes), s.head
			for node, k := range s.nodes {
				if k != 1 {
					t.Errorf("%s asked for %d times", node, k)
				}
			}
			s.mu.Unlock()
			if asked != n {
				t.Fatalf("the server was asked for %d nodes, want %d", asked, n)
			}
			if !contains(head, "Authorization: Bearer s3cret") || !contains(head, "Host: "+s.ln.Addr().String()) {
				t.Fatalf("request header %q: want the token and the host", head)
			}
			if open := s.openConns(); open != n {
				t.Fatalf("%d connections open at the server, want %d", open, n)
			}
			idle.Close()
			if got := s.clientFDs(t); got != 0 {
				t.Fatalf("%d sockets to the server open after Close", got)
			}
		})
	}
}

func contains(l []string, s string) bool {
	for _, x := range l {
		if x == s {
			return true
		}
	}
	return false
}

// TestOpenIdleErrors: a stream that is refused, ends early or never
// subscribes is OpenIdle's error, with the reason, and every stream it had
// opened is closed.
func TestOpenIdleErrors(t *testing.T) {
	const n = 50
	bad := nodeName(37)
	for _, c := range []struct {
		name, answer, want string
	}{
		{"refused", "HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}", "401 Unauthorized"},
		{"ended", serverHead + "id: 1\nevent: subs", "closed the connection before the subscribed event"},
		{"framed", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", "framed"},
		{"no event", serverHead + strings.Repeat(": ping\n\n", 600), "no subscribed event"},
		{"not an event stream", serverHead + "hello\n\n", "unexpected event stream line"},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := newFakeServer(t, 5, func(node string) (string, bool) {
				if node == bad {
					return c.answer, false
				}
				return serverHead + "event: subscribed\ndata: {}\n\n", true
			})
			idle, err := Dialer{}.OpenIdle(context.Background(), s.base(), n, 8, nodeName)
			if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), bad) {
				t.Fatalf("OpenIdle: %v (%v); want an error of %s saying %q", err, idle, bad, c.want)
			}
			if idle != nil {
				idle.Close()
				t.Fatalf("OpenIdle returned streams with its error")
			}
			if got := s.clientFDs(t); got != 0 {
				t.Fatalf("%d sockets to the server left open after the error", got)
			}
		})
	}
}

// TestOpenIdleNoServer: a connection refused is an error, and an
// https:// base is ErrNotPlain (Subscribe opens those).
func TestOpenIdleNoServer(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	before := fds(t)
	if _, err := (Dialer{}).OpenIdle(context.Background(), "http://"+addr, 3, 2, nodeName); err == nil || !strings.Contains(err.Error(), "refused") {
		t.Fatalf("OpenIdle to a closed port: %v, want connection refused", err)
	}
	if fds(t) != before {
		t.Fatalf("%d descriptors left open", fds(t)-before)
	}
	if _, err := (Dialer{}).OpenIdle(context.Background(), "https://"+addr, 3, 2, nodeName); !errors.Is(err, ErrNotPlain) {
		t.Fatalf("OpenIdle to https: %v, want ErrNotPlain", err)
	}
}

// TestOpenIdleCanceled: a server that never answers holds OpenIdle only
// until its context ends, and nothing stays open.
func TestOpenIdleCanceled(t *testing.T) {
	s := newFakeServer(t, 1, func(string) (string, bool) { return "", true })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := Dialer{}.OpenIdle(ctx, s.base(), 10, 4, nodeName)
		done <- err
	}()
	// Every opening the concurrency allows reached the server: OpenIdle
	// waits on its answers.
	for {
		s.mu.Lock()
		k := len(s.nodes)
		s.mu.Unlock()
		if k == 4 {
			break
		}
		runtime.Gosched()
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("OpenIdle: %v, want context.Canceled", err)
	}
	if got := s.clientFDs(t); got != 0 {
		t.Fatalf("%d sockets to the server left open", got)
	}
}

// TestOpenIdleLongAnswers: what comes past the first 4 KiB is read for
// what it says: a subscribed event whole with more behind it in the same
// burst is a stream open, and a long error answer its status.
func TestOpenIdleLongAnswers(t *testing.T) {
	s := newFakeServer(t, 1<<20, func(node string) (string, bool) {
		if node == nodeName(1) {
			return "HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/html\r\nContent-Length: 5000\r\n\r\n" + strings.Repeat("x", 5000), true
		}
		return serverHead + "id: 1\nevent: subscribed\ndata: {}\n\n" + strings.Repeat(": ping\n\n", 600), true
	})
	idle, err := Dialer{}.OpenIdle(context.Background(), s.base(), 1, 1, nodeName)
	if err != nil || idle.Len() != 1 {
		t.Fatalf("OpenIdle of a stream with 4.8 KB after its event: %v", err)
	}
	idle.Close()
	if _, err := (Dialer{}).OpenIdle(context.Background(), s.base(), 2, 1, nodeName); err == nil || !strings.Contains(err.Error(), "502") {
		t.Fatalf("OpenIdle of a long 502: %v, want the 502", err)
	}
}

// TestOpenIdleIPv6: streams open to an IPv6 loopback server; none asked
// for is none opened, and a negative count is an error.
func TestOpenIdleIPv6(t *testing.T) {
	ln, err := net.Listen("tcp", "[::1]:0")
	if err != nil {
		t.Skipf("SKIPPED LOUDLY: no IPv6 loopback here: %v", err)
	}
	ln.Close()
	s := newFakeServerOn(t, "[::1]:0", 1<<20, func(string) (string, bool) {
		return serverHead + "event: subscribed\ndata: {}\n\n", true
	})
	idle, err := Dialer{}.OpenIdle(context.Background(), s.base(), 5, 10, nodeName)
	if err != nil || idle.Len() != 5 {
		t.Fatalf("OpenIdle over IPv6: %v", err)
	}
	idle.Close()
	if idle, err := (Dialer{}).OpenIdle(context.Background(), s.base(), 0, 10, nodeName); err != nil || idle.Len() != 0 {
		t.Fatalf("OpenIdle of none: %v", err)
	}
	if _, err := (Dialer{}).OpenIdle(context.Background(), s.base(), -1, 10, nodeName); err == nil {
		t.Fatal("OpenIdle of -1 streams: no error")
	}
}

// TestOpenIdlePatience: a server that takes the connections and never
// answers is an error once openPatience has passed, naming the stream, and
// nothing stays open.
func TestOpenIdlePatience(t *testing.T) {
	defer func(p time.Duration) { openPatience = p }(openPatience)
	openPatience = 300 * time.Millisecond
	s := newFakeServer(t, 1, func(string) (string, bool) { return "", true })
	_, err := Dialer{}.OpenIdle(context.Background(), s.base(), 3, 3, nodeName)
	if err == nil || !strings.Contains(err.Error(), "no subscribed event within") {
		t.Fatalf("OpenIdle of a server that never answers: %v, want its patience's error", err)
	}
	if got := s.clientFDs(t); got != 0 {
		t.Fatalf("%d sockets to the server left open", got)
	}
}
