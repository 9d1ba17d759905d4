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
	"testing/synctest"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/internal/dlocktest"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/netfault"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/memory"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// startServer runs a real dlock server on 127.0.0.1 for the test.
func startServer(t testing.TB, cfg func(*memory.Config)) *dlocktest.Server {
	return dlocktest.Start(t, dlocktest.Options{Config: cfg})
}

// startInMemory runs one on in-memory connections, inside the test's
// synctest bubble: for the tests whose outcome depends on the client's
// timing (deadlines, leases, polls), which then run in fake time.
func startInMemory(t testing.TB, cfg func(*memory.Config)) *dlocktest.Server {
	return dlocktest.Start(t, dlocktest.Options{Config: cfg, InMemory: true})
}

func newClient(t testing.TB, srv *dlocktest.Server, node string) *Client {
	hc := srv.HTTPClient()
	c := &Client{Server: srv.URL(), Node: node, ShortClient: hc, LongClient: hc,
		RetryInterval: 20 * time.Millisecond, PollInterval: 50 * time.Millisecond, RenewInterval: 100 * time.Millisecond}
	t.Cleanup(func() { c.Close() })
	return c
}

var pull = Request{Type: lock.Pull, Resource: "sha256:layer"}

// heldWork keeps the work of a Do waiting until the test opens it. Open it at the
// latest when the test ends (defer): a test that fails must not leave
// the work waiting.
func heldWork() (wait <-chan struct{}, open func()) {
	ch := make(chan struct{})
	return ch, sync.OnceFunc(func() { close(ch) })
}

// TestEightNodesOneLayer: eight nodes want one layer at once. Exactly one
// downloads; when it succeeds the others skip. The download lasts until
// every other node is queued (a barrier on the server's state), so no node
// can come late and find the key free, however loaded the machine.
func TestEightNodesOneLayer(t *testing.T) {
	srv := startServer(t, nil)
	var runs atomic.Int64
	var wg sync.WaitGroup
	defer wg.Wait()
	work, done := heldWork()
	defer done()
	skipped := make([]bool, 8)
	for i := range 8 {
		c := newClient(t, srv, fmt.Sprint("node-", i))
		wg.Go(func() {
			s, err := c.Do(t.Context(), pull, func(ctx context.Context) error {
				runs.Add(1)
				<-work
				return nil
			})
			if err != nil {
				t.Error(err)
			}
			skipped[i] = s
		})
	}
	srv.WaitQueued(t, pull.key(), 7) // every other node asked before the work is done
	done()
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

// TestFailureTakenOver: the first download fails once every other node is
// queued; the next in line takes over, succeeds, and the rest skip. Also
// for a type besides the three, as the original design's content layer
// locks its layers: its events reach the waiters as pull's do.
func TestFailureTakenOver(t *testing.T) {
	layer, err := lock.ParseType("image-layer")
	if err != nil {
		t.Fatal(err)
	}
	for _, req := range []Request{pull, {Type: layer, Resource: pull.Resource}} {
		t.Run(req.Type.String(), func(t *testing.T) { testFailureTakenOver(t, req) })
	}
}

func testFailureTakenOver(t *testing.T, pull Request) {
	srv := startServer(t, nil)
	var runs atomic.Int64
	var wg sync.WaitGroup
	defer wg.Wait()
	work, done := heldWork()
	defer done()
	// The waiters learn what happened from their streams alone: they do
	// not poll within the test, which a lost event would make time out.
	ctx, cancel := context.WithTimeout(t.Context(), kit.Patience)
	defer cancel()
	for i := range 8 {
		c := newClient(t, srv, fmt.Sprint("node-", i))
		c.PollInterval = time.Hour
		wg.Go(func() {
			_, err := c.Do(ctx, pull, func(ctx context.Context) error {
				if runs.Add(1) == 1 {
					<-work
					return errors.New("registry said 500")
				}
				return nil
			})
			if err != nil && err.Error() != "registry said 500" {
				t.Error(err)
			}
		})
	}
	srv.WaitQueued(t, pull.key(), 7)
	done()
	wg.Wait()
	if runs.Load() != 2 {
		t.Fatalf("%d runs, want 2 (one failure, one takeover)", runs.Load())
	}
}

// TestCancelWaiter: a waiter whose deadline passes leaves the queue. In
// fake time: the deadline comes when b has been queued and waits, never
// while its /lock is on the way.
func TestCancelWaiter(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := startInMemory(t, nil)
		a, b := newClient(t, srv, "a"), newClient(t, srv, "b")
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
	})
}

// TestSameClientSerialized: one Client is one node; two of its callers on
// one key never hold it at once, and the second skips the first's success.
// In fake time, synctest.Wait shows the second caller waiting for good.
func TestSameClientSerialized(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := startInMemory(t, nil)
		c := newClient(t, srv, "a")
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
		synctest.Wait()
		select {
		case r := <-got:
			t.Fatalf("second caller got %+v while the first holds the key", r)
		default:
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
		synctest.Wait() // the second caller waits for the first
		c.Unlock(t.Context(), pull, errors.New("x"))
		if r := <-got; !r.Acquired || r.Token <= r1.Token {
			t.Fatalf("after a failure: %+v", r)
		}
		c.Unlock(t.Context(), pull, nil)
	})
}

// TestStreamKilledMidWait: the stream breaks and cannot be reopened; the
// waiter polls /status and still learns of its grant.
func TestStreamKilledMidWait(t *testing.T) {
	srv := startServer(t, nil)
	a, b := newClient(t, srv, "a"), newClient(t, srv, "b")
	a.Lock(t.Context(), pull)
	got := make(chan Result, 1)
	go func() {
		r, err := b.Lock(t.Context(), pull)
		if err != nil {
			t.Error(err)
		}
		got <- r
	}()
	srv.WaitQueued(t, pull.key(), 1)
	opened := srv.StreamsOpened("b")
	srv.RefuseStreams("b")
	srv.KillAll()
	kit.WaitFor(t, "b's stream refused", func() bool { return srv.StreamsOpened("b") > opened })
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

// TestStreamStalled: b's stream stays open but delivers nothing (a stalled
// network path), so lock_assigned never reaches b; the poll b keeps up as a
// safety net while its stream is up finds the grant. In fake time: the
// poll (ten times PollInterval) comes long before the server's write
// timeout would break the stream.
func TestStreamStalled(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := startInMemory(t, nil)
		a, b := newClient(t, srv, "a"), newClient(t, srv, "b")
		if r, err := a.Lock(t.Context(), pull); err != nil || !r.Acquired {
			t.Fatal(r, err)
		}
		got := make(chan Result, 1)
		go func() {
			r, err := b.Lock(t.Context(), pull)
			if err != nil {
				t.Error(err)
			}
			got <- r
		}()
		srv.WaitQueued(t, pull.key(), 1)
		release := srv.BlockStreams("b")
		defer release()
		start := time.Now()
		if err := a.Unlock(t.Context(), pull, errors.New("failed")); err != nil {
			t.Fatal(err)
		}
		synctest.Wait()
		select {
		case r := <-got:
			t.Fatalf("b got %+v at once, through a stream that delivers nothing", r)
		default:
		}
		r := <-got
		if !r.Acquired {
			t.Fatalf("b got %+v, want the lock found by its poll", r)
		}
		if d := time.Since(start); d > 10*b.PollInterval {
			t.Fatalf("b learned of its grant after %v, want by its poll within %v", d, 10*b.PollInterval)
		}
		st, _ := b.Status(t.Context(), lock.Pull, pull.Resource)
		if st.Holder != "b" || st.Token != r.Token {
			t.Fatalf("status %+v", st)
		}
		if n := srv.StreamsOpened("b"); n != 1 {
			t.Fatalf("b opened %d streams: the grant came by a reconnect, not by the poll", n)
		}
		b.Unlock(t.Context(), pull, nil)
	})
}

// TestServerRestartWhileWaiting: the server restarts while b waits behind
// a. b recovers (the new server forgot a's hold) and a learns its lock is lost.
func TestServerRestartWhileWaiting(t *testing.T) {
	srv := startServer(t, nil)
	a, b := newClient(t, srv, "a"), newClient(t, srv, "b")
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
	srv.WaitQueued(t, pull.key(), 1)
	srv.Restart()
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(kit.Patience):
		t.Fatal("b hangs after the restart")
	}
	select {
	case <-ra.Lost:
	case <-time.After(kit.Patience):
		t.Fatal("a was never told its lock was lost")
	}
	if err := ra.Err(); !errors.Is(err, ErrLockLost) {
		t.Errorf("Err of a lost hold: %v, want ErrLockLost", err)
	}
	if err := a.Unlock(t.Context(), pull, nil); !errors.Is(err, ErrNotHolder) {
		t.Fatalf("unlock of a lost lock: %v, want ErrNotHolder", err)
	}
	if err := ra.Err(); !errors.Is(err, ErrLockLost) {
		t.Errorf("Err of a lost hold after a refused Unlock: %v, want ErrLockLost still", err)
	}
}

// TestResultErr: Lost closes on Unlock and Close too, and Err says which
// of the ways closed it; a Result that is no grant has none.
func TestResultErr(t *testing.T) {
	srv := startServer(t, nil)
	a := newClient(t, srv, "a")
	ra, err := a.Lock(t.Context(), pull)
	if err != nil {
		t.Fatal(err)
	}
	if err := ra.Err(); err != nil {
		t.Fatalf("Err of a hold that stands: %v", err)
	}
	if err := a.Unlock(t.Context(), pull, nil); err != nil {
		t.Fatal(err)
	}
	<-ra.Lost
	if err := ra.Err(); !errors.Is(err, ErrReleased) {
		t.Errorf("Err after Unlock: %v, want ErrReleased", err)
	}
	rc, err := a.Lock(t.Context(), pull)
	if err != nil {
		t.Fatal(err)
	}
	a.Close()
	<-rc.Lost
	if err := rc.Err(); !errors.Is(err, ErrClosed) {
		t.Errorf("Err after Close: %v, want ErrClosed", err)
	}
	if err := (Result{Skipped: true}).Err(); err != nil {
		t.Errorf("Err of a skip: %v", err)
	}
}

// TestDoLockLost: when the lock is lost while fn runs, fn's context ends
// with ErrLockLost, and strictly before the server may hand it on: the
// client-side lease ends a margin before the max hold (docs/DESIGN.md,
// "Leases"). The hold runs out in fake time.
func TestDoLockLost(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := startInMemory(t, func(c *memory.Config) { c.MaxHold = 300 * time.Millisecond })
		a := newClient(t, srv, "a")
		start := time.Now()
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
		// The margin is LeaseMargin, at most a quarter of the guarantee.
		if d, margin := time.Since(start), 300*time.Millisecond/4; d > 300*time.Millisecond-margin || d < 300*time.Millisecond-2*margin {
			t.Fatalf("the lock was lost after %v; its max hold is 300ms and the margin %v: want it lost at %v", d, margin, 300*time.Millisecond-margin)
		}
	})
}

// TestLeaseEnds: Result.LeaseEnds has the client-side lease's end at the
// grant, and again each time a confirmation moves it (later, always), and
// Lost closes at the last end it gave: what dlock run's watchdog is told
// is the moment the client itself would act. A max hold caps the lease, in
// fake time.
func TestLeaseEnds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := startInMemory(t, func(c *memory.Config) { c.SessionGrace = 300 * time.Millisecond; c.MaxHold = time.Second })
		a := newClient(t, srv, "a")
		start := time.Now()
		res, err := a.Lock(t.Context(), pull)
		if err != nil || !res.Acquired || res.LeaseEnds == nil {
			t.Fatalf("Lock: %+v %v", res, err)
		}
		var last time.Time
		select {
		case last = <-res.LeaseEnds:
		default:
			t.Fatal("no lease end at the grant")
		}
		// The grace less the margin, a quarter of it.
		if d := last.Sub(start); d != 300*time.Millisecond-75*time.Millisecond {
			t.Fatalf("the first lease ends %v after the grant, want 225ms", d)
		}
		moves := 0
		for {
			select {
			case end := <-res.LeaseEnds:
				if !end.After(last) {
					t.Fatalf("a lease end %v after %v: not later", end.Sub(start), last.Sub(start))
				}
				last, moves = end, moves+1
				continue
			case <-res.Lost:
			}
			break
		}
		if moves < 2 {
			t.Fatalf("the lease end moved %d times in a second of confirmations every 100ms", moves)
		}
		if d := time.Since(last); d != 0 {
			t.Fatalf("Lost closed %v after the last lease end given", d)
		}
		// The max hold less the margin.
		if d := last.Sub(start); d != time.Second-75*time.Millisecond {
			t.Fatalf("the last lease end is %v after the grant, want 925ms", d)
		}
	})
}

// TestTryAcquireLost: a TryAcquire grant is watched as Lock's are: its
// lost channel closes when the server takes the hold back, and a Release
// with its token ends the watch. A refused TryAcquire has no channel.
func TestTryAcquireLost(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := startInMemory(t, func(c *memory.Config) { c.MaxHold = 300 * time.Millisecond })
		a, b := newClient(t, srv, "a"), newClient(t, srv, "b")
		res, lost, err := a.TryAcquire(t.Context(), pull)
		if err != nil || !res.Acquired || lost == nil {
			t.Fatalf("TryAcquire of a free key: %+v %v %v", res, lost, err)
		}
		again, lost2, err := a.TryAcquire(t.Context(), pull)
		if err != nil || again.Token != res.Token || lost2 != lost {
			t.Fatalf("a asks again: %+v %v, want the same grant and channel", again, err)
		}
		if queued, lostB, err := b.TryAcquire(t.Context(), pull); err != nil || queued.Acquired || lostB != nil {
			t.Fatalf("TryAcquire of a held key: %+v %v %v", queued, lostB, err)
		}
		select {
		case <-lost:
			t.Fatal("lost closed while the lock is held")
		default:
		}
		start := time.Now()
		<-lost // the client-side lease ends a margin before the max hold
		if d, margin := time.Since(start), 300*time.Millisecond/4; d != 300*time.Millisecond-margin {
			t.Fatalf("lost after %v, want %v: the 300ms max hold less the margin", d, 300*time.Millisecond-margin)
		}
		b.Cancel(t.Context(), pull)

		res, lost, err = a.TryAcquire(t.Context(), pull)
		if err != nil || !res.Acquired {
			t.Fatalf("TryAcquire after the hand-off: %+v %v", res, err)
		}
		if _, err := a.Release(t.Context(), pull, res.Token, nil); err != nil {
			t.Fatal(err)
		}
		select {
		case <-lost:
		default:
			t.Fatal("lost still open after the Release")
		}
		a.mu.Lock()
		n := len(a.held)
		a.mu.Unlock()
		if n != 0 {
			t.Fatalf("%d holds watched after the Release", n)
		}
	})
}

func TestErrorClasses(t *testing.T) {
	srv := startServer(t, func(c *memory.Config) { c.AllowMultiNodeDownload = false })
	a, b := newClient(t, srv, "a"), newClient(t, srv, "b")
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
	bad := &Client{Server: srv.URL()}
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
	srv := startServer(t, func(c *memory.Config) { c.RefStore = &memStore{} })
	a, b := newClient(t, srv, "a"), newClient(t, srv, "b")
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
	recs map[string]memory.RefRecord
}

func (s *memStore) Load(context.Context) (map[string]memory.RefRecord, uint64, error) {
	return nil, 0, nil
}

func (s *memStore) Save(_ context.Context, res string, rec memory.RefRecord) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.recs == nil {
		s.recs = map[string]memory.RefRecord{}
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

// TestLocalAddr: with LocalAddr, every connection of the default clients,
// the session stream's and the requests', leaves from that address, so
// that dropping it cuts off this node alone (dlock --source-addr).
func TestLocalAddr(t *testing.T) {
	local := netfault.LoopbackAddr(t)
	var mu sync.Mutex
	seen := map[string]string{} // path → the client's address
	srv := dlocktest.Start(t, dlocktest.Options{Wrap: func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			host, _, _ := net.SplitHostPort(r.RemoteAddr)
			mu.Lock()
			seen[r.URL.Path] = host
			mu.Unlock()
			next.ServeHTTP(w, r)
		})
	}})
	c := &Client{Server: srv.URL(), Node: "n", LocalAddr: &net.TCPAddr{IP: net.ParseIP(local)}}
	defer c.Close()
	ctx := t.Context()
	if _, err := c.Lock(ctx, pull); err != nil {
		t.Fatal(err)
	}
	if err := c.Unlock(ctx, pull, nil); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, p := range []string{"/subscribe", "/lock", "/unlock"} {
		if seen[p] != local {
			t.Errorf("%s came from %q, want %s (LocalAddr): %v", p, seen[p], local, seen)
		}
	}
}

// TestResultErrUnlockOfALostHold: an Unlock that the server refuses because
// the lock moved on before this client noticed (another process of the
// node released it, another node took it) ends the hold as lost, not as
// released: Err must not tell a holder that checks it afterwards that it
// let the lock go itself.
func TestResultErrUnlockOfALostHold(t *testing.T) {
	srv := startServer(t, nil)
	a := newClient(t, srv, "a")
	a.RenewInterval = time.Hour // the refused Unlock, not the watch, learns of the loss
	ra, err := a.Lock(t.Context(), pull)
	if err != nil {
		t.Fatal(err)
	}
	other := newClient(t, srv, "a") // another process of node a
	if _, err := other.Release(t.Context(), pull, 0, errors.New("given up")); err != nil {
		t.Fatal(err)
	}
	b := newClient(t, srv, "b")
	if res, err := b.TryLock(t.Context(), pull); err != nil || !res.Acquired {
		t.Fatalf("b's lock after a's release: %+v, %v", res, err)
	}
	err = a.Unlock(t.Context(), pull, nil)
	if !errors.Is(err, ErrNotHolder) && !errors.Is(err, ErrStaleToken) {
		t.Fatalf("Unlock of a lock b holds now: %v, want ErrNotHolder or ErrStaleToken", err)
	}
	<-ra.Lost
	if err := ra.Err(); !errors.Is(err, ErrLockLost) {
		t.Errorf("Err after an Unlock refused for another holder: %v, want ErrLockLost", err)
	}
}

// TestAcquireWaits: Acquire waits in line and returns what the holder's
// outcome leaves it: a skip after a success, a grant, with its lost
// channel, after a failure; a caller that gives up leaves the queue. The
// waiters hear it from their streams alone (no polls in the test's time).
func TestAcquireWaits(t *testing.T) {
	srv := startServer(t, nil)
	a, b := newClient(t, srv, "a"), newClient(t, srv, "b")
	b.PollInterval = time.Hour
	ctx, cancel := context.WithTimeout(t.Context(), kit.Patience)
	defer cancel()
	type outcome struct {
		res  api.LockResponse
		lost <-chan struct{}
		err  error
	}
	wait := func() <-chan outcome {
		out := make(chan outcome, 1)
		go func() {
			res, lost, err := b.Acquire(ctx, pull)
			out <- outcome{res, lost, err}
		}()
		srv.WaitQueued(t, pull.key(), 1)
		return out
	}

	held, _, err := a.TryAcquire(ctx, pull)
	if err != nil || !held.Acquired {
		t.Fatal(held, err)
	}
	out := wait()
	if _, err := a.Release(ctx, pull, held.Token, nil); err != nil {
		t.Fatal(err)
	}
	if o := <-out; o.err != nil || !o.res.Skip || o.res.Acquired || o.lost != nil {
		t.Fatalf("Acquire behind a success: %+v, want a skip", o)
	}

	if held, _, err = a.TryAcquire(ctx, pull); err != nil || !held.Acquired {
		t.Fatal(held, err)
	}
	out = wait()
	if _, err := a.Release(ctx, pull, held.Token, errors.New("registry said 500")); err != nil {
		t.Fatal(err)
	}
	o := <-out
	if o.err != nil || !o.res.Acquired || o.lost == nil || o.res.Token <= held.Token {
		t.Fatalf("Acquire behind a failure: %+v, want a grant with a newer token than %d", o, held.Token)
	}
	if !b.Held(pull) {
		t.Fatal("b does not hold its grant")
	}
	if _, err := b.Release(ctx, pull, o.res.Token, errors.New("gave up")); err != nil {
		t.Fatal(err)
	}
	select {
	case <-o.lost:
	default:
		t.Fatal("lost still open after the Release")
	}

	if held, _, err = a.TryAcquire(ctx, pull); err != nil || !held.Acquired {
		t.Fatal(held, err)
	}
	gone, giveUp := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { _, _, err := b.Acquire(gone, pull); done <- err }()
	srv.WaitQueued(t, pull.key(), 1)
	giveUp()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Acquire whose caller gave up: %v", err)
	}
	if st, _ := a.Status(ctx, lock.Pull, pull.Resource); st.QueueLength != 0 {
		t.Fatalf("the caller that gave up is still queued: %+v", st)
	}
}

// TestAwaitKeepsThePlace: Await whose caller gives up leaves the node in
// line, for the caller to leave or to ask again; a grant that came
// meanwhile is found by the next Await.
func TestAwaitKeepsThePlace(t *testing.T) {
	srv := startServer(t, nil)
	a, b := newClient(t, srv, "a"), newClient(t, srv, "b")
	b.PollInterval = time.Hour
	ctx, cancel := context.WithTimeout(t.Context(), kit.Patience)
	defer cancel()
	held, _, err := a.TryAcquire(ctx, pull)
	if err != nil || !held.Acquired {
		t.Fatal(held, err)
	}
	gone, giveUp := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { _, _, err := b.Await(gone, pull); done <- err }()
	srv.WaitQueued(t, pull.key(), 1)
	giveUp()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Await whose caller gave up: %v", err)
	}
	if st, _ := b.Status(ctx, lock.Pull, pull.Resource); st.QueueLength != 1 {
		t.Fatalf("b left the line: %+v", st)
	}
	if _, err := a.Release(ctx, pull, held.Token, errors.New("failed")); err != nil {
		t.Fatal(err)
	}
	res, lost, err := b.Await(ctx, pull)
	if err != nil || !res.Acquired || lost == nil {
		t.Fatalf("Await after the hand-off: %+v %v", res, err)
	}
	if _, err := b.Cancel(ctx, pull); err != nil {
		t.Fatal(err)
	}
	if st, _ := b.Status(ctx, lock.Pull, pull.Resource); st.Holder != "" || st.QueueLength != 0 {
		t.Fatalf("after b's Cancel: %+v", st)
	}
}
