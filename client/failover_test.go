package client

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/dlock/dlock/internal/dlocktest"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/lock"
)

// deadServer is the URL of a port nobody listens on any more: a
// connection to it is refused.
func deadServer(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	url := "http://" + ln.Addr().String()
	ln.Close()
	return url
}

// newFailoverClient is a client of several servers over real TCP, with the
// default transports (each server's own HTTPClient dials only it).
func newFailoverClient(t *testing.T, node string, servers ...string) *Client {
	c := &Client{Servers: servers, Node: node,
		RetryInterval: 20 * time.Millisecond, PollInterval: 50 * time.Millisecond, RenewInterval: 100 * time.Millisecond}
	t.Cleanup(func() { c.Close() })
	return c
}

// asked is the server the client asks now.
func asked(c *Client) string {
	_, u := c.server()
	return u.String()
}

// TestFailoverRequests: a request whose first servers are dead is answered
// by the next live one, and the client stays there.
func TestFailoverRequests(t *testing.T) {
	srv := startServer(t, nil)
	for _, servers := range [][]string{
		{deadServer(t), srv.URL()},
		{deadServer(t), deadServer(t), srv.URL()},
	} {
		c := newFailoverClient(t, "a", servers...)
		if _, err := c.Status(t.Context(), lock.Pull, "r"); err != nil {
			t.Fatalf("%d servers, the last live: %v", len(servers), err)
		}
		if got := asked(c); got != srv.URL() {
			t.Fatalf("the client asks %s after the live server answered, want %s", got, srv.URL())
		}
		res, err := c.Lock(t.Context(), pull)
		if err != nil || !res.Acquired {
			t.Fatalf("lock: %+v %v", res, err)
		}
		if err := c.Unlock(t.Context(), pull, nil); err != nil {
			t.Fatal(err)
		}
	}
}

// TestFailoverConnect: the first connection of the session stream tries
// the servers in turn, so that Connect finds the live one at once, and the
// requests that follow go there.
func TestFailoverConnect(t *testing.T) {
	srv := startServer(t, nil)
	c := newFailoverClient(t, "a", deadServer(t), deadServer(t), srv.URL())
	c.MaxRetries = -1
	if err := c.Connect(t.Context()); err != nil {
		t.Fatal(err)
	}
	if got := asked(c); got != srv.URL() {
		t.Fatalf("the client asks %s after its stream connected, want %s", got, srv.URL())
	}
	if _, err := c.Status(t.Context(), lock.Pull, "r"); err != nil {
		t.Fatalf("a single attempt after Connect: %v", err)
	}
}

// TestFailoverNotRetried: a client that never retries (MaxRetries < 0)
// still does not retry with several servers, but its next request goes to
// the next server.
func TestFailoverNotRetried(t *testing.T) {
	srv := startServer(t, nil)
	c := newFailoverClient(t, "a", deadServer(t), srv.URL())
	c.MaxRetries = -1
	if _, err := c.Status(t.Context(), lock.Pull, "r"); err == nil {
		t.Fatal("a request to a dead server succeeded without a retry")
	}
	if _, err := c.Status(t.Context(), lock.Pull, "r"); err != nil {
		t.Fatalf("the request after the failure: %v", err)
	}
}

// fakeServers serves each handler inside the current synctest bubble as
// http://s0, http://s1, … and returns a client of them all.
func fakeServers(t *testing.T, cfg func(*Client), handlers ...http.HandlerFunc) *Client {
	lns := map[string]*kit.PipeListener{}
	var servers []string
	var wg sync.WaitGroup
	var hss []*http.Server
	for i, h := range handlers {
		name := "s" + string(rune('0'+i))
		l := kit.NewPipeListener()
		lns[name+":80"] = l
		servers = append(servers, "http://"+name)
		hs := &http.Server{Handler: h}
		hss = append(hss, hs)
		wg.Go(func() { hs.Serve(l) })
	}
	tr := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		return lns[addr].Dial(ctx, network, addr)
	}}
	c := &Client{Servers: servers, Node: "a", ShortClient: &http.Client{Transport: tr}, LongClient: &http.Client{Transport: tr}}
	if cfg != nil {
		cfg(c)
	}
	t.Cleanup(func() {
		c.Close()
		tr.CloseIdleConnections()
		for _, hs := range hss {
			hs.Close()
		}
		wg.Wait()
	})
	return c
}

// hit records the requests each fake server answered, with their time.
type hit struct {
	server string
	at     time.Time
}

type hits struct {
	mu   sync.Mutex
	list []hit
}

func (h *hits) add(server string) {
	h.mu.Lock()
	h.list = append(h.list, hit{server, time.Now()})
	h.mu.Unlock()
}

func (h *hits) servers() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var s []string
	for _, x := range h.list {
		s = append(s, x.server)
	}
	return strings.Join(s, " ")
}

// TestFailoverRules, in fake time: what moves to the next server and when
// the retry pauses.
func TestFailoverRules(t *testing.T) {
	t.Run("503 moves at once", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			var h hits
			c := fakeServers(t, nil,
				func(w http.ResponseWriter, r *http.Request) { h.add("s0"); refuse(w, ErrUnavailable, "1") },
				func(w http.ResponseWriter, r *http.Request) { h.add("s1"); okStatus(w) })
			start := time.Now()
			for range 2 {
				if _, err := c.Status(t.Context(), lock.Pull, "r"); err != nil {
					t.Fatal(err)
				}
			}
			if got := h.servers(); got != "s0 s1 s1" {
				t.Fatalf("servers asked: %s, want s0 s1 s1 (moved on, then stayed)", got)
			}
			if d := time.Since(start); d != 0 {
				t.Fatalf("the retry on the next server came after %v, want at once", d)
			}
		})
	})
	t.Run("429 stays", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			var h hits
			var n atomic.Int64
			c := fakeServers(t, nil,
				func(w http.ResponseWriter, r *http.Request) {
					h.add("s0")
					if n.Add(1) == 1 {
						refuse(w, lock.ErrQueueFull, "1")
						return
					}
					okStatus(w)
				},
				func(w http.ResponseWriter, r *http.Request) { h.add("s1"); okStatus(w) })
			if _, err := c.Status(t.Context(), lock.Pull, "r"); err != nil {
				t.Fatal(err)
			}
			if got := h.servers(); got != "s0 s0" {
				t.Fatalf("servers asked: %s, want s0 s0: a 429 is the lock service's answer, the same on every server", got)
			}
			if d := h.list[1].at.Sub(h.list[0].at); d < time.Second {
				t.Fatalf("the retry after a 429 came after %v, before its Retry-After", d)
			}
		})
	})
	t.Run("a round, then a pause", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			var h hits
			bad := func(name string) http.HandlerFunc {
				return func(w http.ResponseWriter, r *http.Request) { h.add(name); w.WriteHeader(http.StatusBadGateway) }
			}
			c := fakeServers(t, func(c *Client) { c.RetryInterval = 100 * time.Millisecond; c.MaxRetries = 5 },
				bad("s0"), bad("s1"), bad("s2"))
			if _, err := c.Status(t.Context(), lock.Pull, "r"); err == nil {
				t.Fatal("every server answered 502, and the request succeeded")
			}
			if got := h.servers(); got != "s0 s1 s2 s0 s1 s2" {
				t.Fatalf("servers asked: %s, want two rounds of three", got)
			}
			for i := 1; i < len(h.list); i++ {
				d := h.list[i].at.Sub(h.list[i-1].at)
				switch {
				case i == 3 && (d < 80*time.Millisecond || d > 120*time.Millisecond):
					t.Errorf("pause after the first round: %v, want RetryInterval ± 20%%", d)
				case i != 3 && d != 0:
					t.Errorf("pause before request %d, inside a round: %v, want none", i, d)
				}
			}
		})
	})
	t.Run("4xx stays and is not retried", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			var h hits
			c := fakeServers(t, nil,
				func(w http.ResponseWriter, r *http.Request) { h.add("s0"); refuse(w, lock.ErrNotHolder, "") },
				func(w http.ResponseWriter, r *http.Request) { h.add("s1"); okStatus(w) })
			for range 2 {
				if _, err := c.Status(t.Context(), lock.Pull, "r"); !errors.Is(err, ErrNotHolder) {
					t.Fatalf("%v, want ErrNotHolder", err)
				}
			}
			if got := h.servers(); got != "s0 s0" {
				t.Fatalf("servers asked: %s, want s0 s0", got)
			}
		})
	})
}

// TestFailoverConfig: the servers' rules, as for one server.
func TestFailoverConfig(t *testing.T) {
	for _, tc := range []struct {
		c    *Client
		want string
	}{
		{&Client{Server: "http://a", Servers: []string{"http://b"}, Node: "n"}, "not both"},
		{&Client{Servers: []string{"http://a", "https://b"}, Node: "n"}, "all servers are http:// or all https://"},
		{&Client{Servers: []string{"http://a", ""}, Node: "n"}, "not an http(s) URL"},
		{&Client{Servers: []string{"http://a", "http://b"}, TLSConfig: &tls.Config{}, Node: "n"}, ErrNotHTTPS.Error()},
	} {
		_, err := tc.c.Status(t.Context(), lock.Pull, "r")
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("servers %q (Server %q): %v, want %q", tc.c.Servers, tc.c.Server, err, tc.want)
		}
	}
	if got := SplitServers(" http://a:1, http://b:2/"); len(got) != 2 || got[0] != "http://a:1" || got[1] != "http://b:2/" {
		t.Fatalf("SplitServers: %q", got)
	}
	if _, _, err := (CredentialFiles{CA: "ca.pem"}).Load("http://a", "http://b"); !errors.Is(err, ErrNotHTTPS) {
		t.Fatalf("a CA for http:// servers: %v", err)
	}
	if _, _, err := (CredentialFiles{}).Load("https://a", "http://b"); err == nil {
		t.Fatal("credentials for https:// and http:// servers at once")
	}
}

// TestFailoverStreamNewEpoch: the stream of a server that stops is
// reopened on the next. Two servers of their own state are two epochs:
// the hold taken on the first is reported lost.
func TestFailoverStreamNewEpoch(t *testing.T) {
	a, b := startServer(t, nil), startServer(t, nil)
	c := newFailoverClient(t, "n", a.URL(), b.URL())
	res, err := c.Lock(t.Context(), pull)
	if err != nil || !res.Acquired {
		t.Fatalf("lock: %+v %v", res, err)
	}
	epoch := c.Epoch()
	a.Stop()
	kit.WaitFor(t, "the stream on the second server", func() bool { return b.StreamsOpened("n") > 0 })
	select {
	case <-res.Lost:
	case <-time.After(kit.Patience):
		t.Fatal("the hold of the first server's epoch was not reported lost")
	}
	if c.Epoch() == epoch {
		t.Fatalf("epoch %s still, after the second server's answer", epoch)
	}
	kit.WaitFor(t, "the stream up on the second server", func() bool {
		up, _ := c.sess.state()
		return up
	})
}

// TestFailoverSharedBackend: servers of one lock service. A node holds a
// lock through the first server, which then stops; its stream moves to the
// second within the session grace, and the hold is kept: /status through
// the second names it, and its unlock there hands the key on to a waiter
// whose stream also moved, then to a waiter that only ever knew the second.
func TestFailoverSharedBackend(t *testing.T) {
	for _, n := range []int{2, 3} {
		t.Run(string(rune('0'+n))+" servers", func(t *testing.T) {
			first := startServer(t, nil)
			srvs := []*dlocktest.Server{first}
			for range n - 1 {
				srvs = append(srvs, dlocktest.Start(t, dlocktest.Options{Share: first}))
			}
			urls := make([]string, n)
			for i, s := range srvs {
				urls[i] = s.URL()
			}
			last := srvs[n-1]
			// a and b begin on the first server; c knows only the last.
			// The waiters poll too seldom to matter: they learn through
			// their streams.
			a, b := newFailoverClient(t, "a", urls...), newFailoverClient(t, "b", urls...)
			c := newFailoverClient(t, "c", last.URL())
			b.PollInterval, c.PollInterval = time.Hour, time.Hour
			res, err := a.Lock(t.Context(), pull)
			if err != nil || !res.Acquired {
				t.Fatalf("lock: %+v %v", res, err)
			}
			got := make(chan Result, 2)
			for _, w := range []*Client{b, c} {
				go func() {
					r, err := w.Lock(t.Context(), pull)
					if err != nil {
						t.Error(err)
					}
					got <- r
				}()
				last.WaitQueued(t, pull.key(), map[*Client]int{b: 1, c: 2}[w])
			}
			// Every server but the last stops in turn; the streams of
			// a and b move on to the next one each time.
			for i, s := range srvs[:n-1] {
				s.Stop()
				next := srvs[i+1]
				kit.WaitFor(t, "a's and b's streams on the next server", func() bool {
					return next.StreamsOpened("a") > 0 && next.StreamsOpened("b") > 0
				})
			}
			kit.WaitFor(t, "a's and b's streams up", func() bool {
				upA, _ := a.sess.state()
				upB, _ := b.sess.state()
				return upA && upB
			})
			st, err := a.Status(t.Context(), lock.Pull, pull.Resource)
			if err != nil || st.Holder != "a" || st.Token != res.Token || st.QueueLength != 2 {
				t.Fatalf("status through the last server: %+v %v, want a holding token %d, two waiting", st, err, res.Token)
			}
			if got := asked(a); got != last.URL() {
				t.Fatalf("a asks %s, want the last server %s", got, last.URL())
			}
			select {
			case <-res.Lost:
				t.Fatal("the hold was reported lost, though the session moved within its grace")
			default:
			}
			// A failure hands the key to b, told on its moved stream.
			if err := a.Unlock(t.Context(), pull, errors.New("failed")); err != nil {
				t.Fatal(err)
			}
			rb := <-got
			if !rb.Acquired {
				t.Fatalf("b got %+v, want the lock", rb)
			}
			// b's success: c, which waits through the last server, skips.
			if err := b.Unlock(t.Context(), pull, nil); err != nil {
				t.Fatal(err)
			}
			if rc := <-got; !rc.Skipped || rc.SkippedBy != "b" {
				t.Fatalf("c got %+v, want skipped by b", rc)
			}
			// The session stayed one: no server answered a new epoch.
			if a.Epoch() != c.Epoch() {
				t.Fatalf("epochs %s and %s on one lock service", a.Epoch(), c.Epoch())
			}
		})
	}
}
