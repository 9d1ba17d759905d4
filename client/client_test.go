package client

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/server"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// testServer is a real dlock server on 127.0.0.1 that a test can restart on
// the same address and whose event streams it can block.
type testServer struct {
	t          testing.TB
	addr       string
	cfg        func(*lock.Config)
	m          *lock.Memory
	srv        *server.Server
	hs         *http.Server
	done       chan struct{}
	noStreams  atomic.Bool
	mu         sync.Mutex
	conns      map[net.Conn]struct{}
	streamHits atomic.Int64
}

func startServer(t testing.TB, cfg func(*lock.Config)) *testServer {
	ts := &testServer{t: t, cfg: cfg}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ts.addr = ln.Addr().String()
	ts.serve(ln)
	t.Cleanup(ts.stop)
	return ts
}

func (ts *testServer) url() string { return "http://" + ts.addr }

func (ts *testServer) serve(ln net.Listener) {
	c := lock.DefaultConfig()
	if ts.cfg != nil {
		ts.cfg(&c)
	}
	m, err := lock.NewMemory(context.Background(), c)
	if err != nil {
		ts.t.Fatal(err)
	}
	srv := server.New(m, server.Options{PingInterval: 100 * time.Millisecond})
	ts.mu.Lock()
	ts.conns = map[net.Conn]struct{}{}
	ts.mu.Unlock()
	ts.m, ts.srv = m, srv
	ts.hs = &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/subscribe" {
				ts.streamHits.Add(1)
				if ts.noStreams.Load() {
					http.Error(w, `{"error":"no streams today","code":"unavailable","message":"no streams today"}`, http.StatusServiceUnavailable)
					return
				}
			}
			srv.ServeHTTP(w, r)
		}),
		ConnState: func(c net.Conn, s http.ConnState) {
			ts.mu.Lock()
			defer ts.mu.Unlock()
			// Hijacked connections (event streams) stay: killConns
			// must break them too.
			if s == http.StateNew {
				ts.conns[c] = struct{}{}
			} else if s == http.StateClosed {
				delete(ts.conns, c)
			}
		},
	}
	ts.done = make(chan struct{})
	go func() {
		defer close(ts.done)
		ts.hs.Serve(ln)
	}()
}

// killConns drops every connection: open streams break mid-wait.
func (ts *testServer) killConns() {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	for c := range ts.conns {
		c.Close()
	}
}

func (ts *testServer) stop() {
	if ts.m == nil {
		return
	}
	ts.srv.Drain()
	ts.hs.Close()
	<-ts.done
	ts.m.Close()
	ts.m = nil
}

// restart replaces the server by a new one (a new epoch) on the same address.
func (ts *testServer) restart() {
	ts.stop()
	var ln net.Listener
	var err error
	for range 50 {
		if ln, err = net.Listen("tcp", ts.addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		ts.t.Fatal(err)
	}
	ts.serve(ln)
}

func newClient(t testing.TB, ts *testServer, node string) *Client {
	c := &Client{Server: ts.url(), Node: node, RetryInterval: 20 * time.Millisecond, PollInterval: 50 * time.Millisecond, RenewInterval: 100 * time.Millisecond}
	t.Cleanup(func() { c.Close() })
	return c
}

var pull = Request{Type: lock.Pull, Resource: "sha256:layer"}

// waitQueued waits until n nodes wait for pull on the server: a barrier, so
// that no node can come late and find the key free. It runs inside a
// callback, off the test goroutine, so it reports with Error, not Fatal.
func waitQueued(t testing.TB, ts *testServer, n int) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		st, err := ts.m.Status(t.Context(), pull.Type, pull.Resource, "")
		if err == nil && st.QueueLength == n {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("timed out waiting for %d waiters (last: %+v, %v)", n, st, err)
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestEightNodesOneLayer: eight nodes want one layer at once. Exactly one
// downloads; when it succeeds the others skip.
func TestEightNodesOneLayer(t *testing.T) {
	ts := startServer(t, nil)
	var runs atomic.Int64
	var wg sync.WaitGroup
	skipped := make([]bool, 8)
	for i := range 8 {
		c := newClient(t, ts, fmt.Sprint("node-", i))
		wg.Go(func() {
			s, err := c.Do(t.Context(), pull, func(ctx context.Context) error {
				runs.Add(1)
				waitQueued(t, ts, 7) // every other node asked before the work is done
				return nil
			})
			if err != nil {
				t.Error(err)
			}
			skipped[i] = s
		})
	}
	wg.Wait()
	n := 0
	for _, s := range skipped {
		if s {
			n++
		}
	}
	if runs.Load() != 1 || n != 7 {
		t.Fatalf("%d runs and %d skips, want 1 and 7", runs.Load(), n)
	}
}

// TestFailureTakenOver: the first download fails; the next in line takes
// over, succeeds, and the rest skip.
func TestFailureTakenOver(t *testing.T) {
	ts := startServer(t, nil)
	var runs atomic.Int64
	var wg sync.WaitGroup
	for i := range 8 {
		c := newClient(t, ts, fmt.Sprint("node-", i))
		wg.Go(func() {
			_, err := c.Do(t.Context(), pull, func(ctx context.Context) error {
				if runs.Add(1) == 1 {
					waitQueued(t, ts, 7)
					return errors.New("registry said 500")
				}
				return nil
			})
			if err != nil && err.Error() != "registry said 500" {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if runs.Load() != 2 {
		t.Fatalf("%d runs, want 2 (one failure, one takeover)", runs.Load())
	}
}

func TestCancelWaiter(t *testing.T) {
	ts := startServer(t, nil)
	a, b := newClient(t, ts, "a"), newClient(t, ts, "b")
	if r, err := a.Lock(t.Context(), pull); err != nil || !r.Acquired {
		t.Fatal(r, err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	_, err := b.Lock(ctx, pull)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("cancelled wait: %v", err)
	}
	st, _ := a.Status(t.Context(), lock.Pull, pull.Resource)
	if st.QueueLength != 0 {
		t.Fatalf("the cancelled waiter is still queued: %+v", st)
	}
	if err := a.Unlock(t.Context(), pull, errors.New("failed")); err != nil {
		t.Fatal(err)
	}
	if st, _ := a.Status(t.Context(), lock.Pull, pull.Resource); st.State != "free" {
		t.Fatalf("failure with nobody waiting: %+v", st)
	}
}

// TestSameClientSerialized: one Client is one node; two of its callers on
// one key never hold it at once, and the second skips the first's success.
func TestSameClientSerialized(t *testing.T) {
	ts := startServer(t, nil)
	c := newClient(t, ts, "a")
	r1, err := c.Lock(t.Context(), pull)
	if err != nil || !r1.Acquired {
		t.Fatal(r1, err)
	}
	got := make(chan Result, 1)
	go func() {
		r, err := c.Lock(t.Context(), pull)
		if err != nil {
			t.Error(err)
		}
		got <- r
	}()
	select {
	case r := <-got:
		t.Fatalf("second caller got %+v while the first holds the key", r)
	case <-time.After(100 * time.Millisecond):
	}
	if err := c.Unlock(t.Context(), pull, nil); err != nil {
		t.Fatal(err)
	}
	if r := <-got; !r.Skipped || r.SkippedBy != "a" {
		t.Fatalf("second caller after the first's success: %+v", r)
	}
	// After a failure the next caller gets the lock.
	r1, _ = c.Lock(t.Context(), pull)
	go func() {
		r, _ := c.Lock(t.Context(), pull)
		got <- r
	}()
	time.Sleep(50 * time.Millisecond)
	c.Unlock(t.Context(), pull, errors.New("x"))
	if r := <-got; !r.Acquired || r.Token <= r1.Token {
		t.Fatalf("after a failure: %+v", r)
	}
	c.Unlock(t.Context(), pull, nil)
}

// TestStreamKilledMidWait: the stream breaks and cannot be reopened; the
// waiter polls /status and still learns of its grant.
func TestStreamKilledMidWait(t *testing.T) {
	ts := startServer(t, nil)
	a, b := newClient(t, ts, "a"), newClient(t, ts, "b")
	a.Lock(t.Context(), pull)
	got := make(chan Result, 1)
	go func() {
		r, err := b.Lock(t.Context(), pull)
		if err != nil {
			t.Error(err)
		}
		got <- r
	}()
	waitFor(t, "b queued", func() bool {
		st, _ := a.Status(t.Context(), lock.Pull, pull.Resource)
		return st.QueueLength == 1
	})
	ts.noStreams.Store(true)
	ts.killConns()
	hits := ts.streamHits.Load()
	waitFor(t, "b's stream refused", func() bool { return ts.streamHits.Load() > hits })
	a.Unlock(t.Context(), pull, errors.New("failed"))
	r := <-got
	if !r.Acquired {
		t.Fatalf("b got %+v, want the lock by polling", r)
	}
	st, _ := b.Status(t.Context(), lock.Pull, pull.Resource)
	if st.Holder != "b" || st.Token != r.Token {
		t.Fatalf("status %+v", st)
	}
}

// TestServerRestartWhileWaiting: the server restarts while b waits behind
// a. b recovers (the new server forgot a's hold) and a learns its lock is lost.
func TestServerRestartWhileWaiting(t *testing.T) {
	ts := startServer(t, nil)
	a, b := newClient(t, ts, "a"), newClient(t, ts, "b")
	ra, err := a.Lock(t.Context(), pull)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan error, 1)
	go func() {
		r, err := b.Lock(t.Context(), pull)
		if err == nil && !r.Acquired {
			err = fmt.Errorf("got %+v", r)
		}
		got <- err
	}()
	waitFor(t, "b queued", func() bool {
		st, _ := a.Status(t.Context(), lock.Pull, pull.Resource)
		return st.QueueLength == 1
	})
	ts.restart()
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("b hangs after the restart")
	}
	select {
	case <-ra.Lost:
	case <-time.After(20 * time.Second):
		t.Fatal("a was never told its lock was lost")
	}
	if err := a.Unlock(t.Context(), pull, nil); !errors.Is(err, ErrNotHolder) {
		t.Fatalf("unlock of a lost lock: %v, want ErrNotHolder", err)
	}
}

// TestDoLockLost: when the lock is lost while fn runs, fn's context ends
// with ErrLockLost.
func TestDoLockLost(t *testing.T) {
	ts := startServer(t, func(c *lock.Config) { c.MaxHold = 300 * time.Millisecond })
	a := newClient(t, ts, "a")
	_, err := a.Do(t.Context(), pull, func(ctx context.Context) error {
		<-ctx.Done()
		if !errors.Is(context.Cause(ctx), ErrLockLost) {
			t.Errorf("fn's context ended with %v", context.Cause(ctx))
		}
		return ctx.Err()
	})
	if !errors.Is(err, ErrLockLost) {
		t.Fatalf("Do after losing the lock: %v", err)
	}
}

func TestErrorClasses(t *testing.T) {
	ts := startServer(t, func(c *lock.Config) { c.AllowMultiNodeDownload = false })
	a, b := newClient(t, ts, "a"), newClient(t, ts, "b")
	a.Lock(t.Context(), pull)
	_, err := b.Lock(t.Context(), pull)
	var he *lock.HeldError
	if !errors.Is(err, ErrLockHeld) || !errors.As(err, &he) || he.Holder != "a" {
		t.Fatalf("lock of a held key: %v", err)
	}
	if err := b.Unlock(t.Context(), pull, nil); !errors.Is(err, ErrNotHolder) {
		t.Fatalf("unlock by a non-holder: %v", err)
	}
	if _, err := b.RefCount(t.Context(), "x"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("refcount with refcount off: %v", err)
	}
	if _, err := b.Lock(t.Context(), Request{Type: lock.Pull}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("no resource: %v", err)
	}
	bad := &Client{Server: ts.url()}
	if _, err := bad.Lock(t.Context(), pull); !errors.Is(err, ErrInvalid) {
		t.Fatalf("client without a node: %v", err)
	}
}

// TestRetries: a server that is down at first is retried; a 4xx is not.
func TestRetries(t *testing.T) {
	var hits atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if hits.Add(1) <= 2 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusBadRequest)
		w.Write([]byte(`{"error":"invalid request: x","code":"invalid_request","message":"invalid request: x"}`))
	})
	srv := &http.Server{Handler: h}
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	go srv.Serve(ln)
	defer srv.Close()
	c := &Client{Server: "http://" + ln.Addr().String(), Node: "a", RetryInterval: time.Millisecond}
	defer c.Close()
	_, err := c.Status(t.Context(), lock.Pull, "r")
	if !errors.Is(err, ErrInvalid) || hits.Load() != 3 {
		t.Fatalf("err %v after %d requests, want ErrInvalid after 3", err, hits.Load())
	}
}

func TestRefCounts(t *testing.T) {
	ts := startServer(t, func(c *lock.Config) { c.RefStore = &memStore{} })
	a, b := newClient(t, ts, "a"), newClient(t, ts, "b")
	if _, err := a.Do(t.Context(), pull, func(context.Context) error { return nil }); err != nil {
		t.Fatal(err)
	}
	if rc, err := b.AddRef(t.Context(), pull.Resource); err != nil || rc.Count != 2 {
		t.Fatalf("add: %+v %v", rc, err)
	}
	del := Request{Type: lock.Delete, Resource: pull.Resource}
	if _, err := b.Lock(t.Context(), del); !errors.Is(err, ErrInUse) {
		t.Fatalf("delete of a used blob: %v", err)
	}
	b.ReleaseRef(t.Context(), pull.Resource)
	if n, err := a.ReleaseAllRefs(t.Context()); err != nil || n != 1 {
		t.Fatalf("release all: %d %v", n, err)
	}
	if r, err := b.Lock(t.Context(), del); err != nil || !r.Acquired {
		t.Fatalf("delete of an unused blob: %+v %v", r, err)
	}
	b.Unlock(t.Context(), del, nil)
}

type memStore struct {
	mu   sync.Mutex
	recs map[string]lock.RefRecord
}

func (s *memStore) Load(context.Context) (map[string]lock.RefRecord, uint64, error) {
	return nil, 0, nil
}

func (s *memStore) Save(_ context.Context, res string, rec lock.RefRecord) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.recs == nil {
		s.recs = map[string]lock.RefRecord{}
	}
	s.recs[res] = rec
	return nil
}

// TestDependencies: the client must stay light (no etcd, containerd, bbolt,
// Prometheus), like Tailscale's deptest.
func TestDependencies(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, dep := range strings.Fields(string(out)) {
		for _, banned := range []string{"go.etcd.io/", "github.com/containerd/", "github.com/prometheus/", "github.com/dlock/dlock/server", "github.com/dlock/dlock/refcount"} {
			if strings.HasPrefix(dep, banned) {
				t.Errorf("client depends on %s", dep)
			}
		}
	}
}

func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
