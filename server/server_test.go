package server

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/etcd"
	"github.com/dlock/dlock/lock/memory"
	"github.com/dlock/dlock/refcount"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	// net/http lingers 500 ms after answering a request it closes the
	// connection for (a 413, say) before it lets the goroutine go.
	// etcdtest.M stops the embedded etcd that the tests on an etcd data
	// set share (cluster_test.go).
	goleak.VerifyTestMain(etcdtest.M(m), append(etcdtest.GoleakOptions(), goleak.IgnoreAnyFunction("net/http.(*conn).closeWriteAndWait"))...)
}

type env struct {
	t   testing.TB
	m   *memory.Backend // nil on etcd (newPairEnv)
	srv *Server
	ts  *httptest.Server // nil with two servers

	// With two servers on one etcd data set (newPairEnv): call and
	// subscribe each take the servers in turn, subscribe starting on the
	// other one than call, so that a stream and the requests that make its
	// events are on different servers.
	c           *cluster
	calls, subs int
}

// newPairEnv runs two dlock servers on one fresh etcd data set, as two
// `dlock serve --backend etcd` of one lock service (docs/DESIGN.md, "An
// etcd backend"): the env of the backend-agnostic tests, with requests
// spread over both. srv is the first server.
func newPairEnv(t testing.TB, mod func(*etcd.Config)) *env {
	t.Helper()
	c := newCluster(t, 2, mod)
	return &env{t: t, srv: c.members[0].srv, c: c, subs: 1}
}

// onBackends runs a test of rules that do not depend on the backend on
// memory.Backend behind one server (as dlock serve runs it), and on two
// servers sharing one etcd data set with requests alternating between them.
func onBackends(t *testing.T, mod func(*lock.Rules), test func(*testing.T, *env)) {
	t.Run("memory", func(t *testing.T) {
		test(t, newEnv(t, func(c *memory.Config) {
			if mod != nil {
				mod(&c.Rules)
			}
		}))
	})
	t.Run("etcd, two servers", func(t *testing.T) {
		test(t, newPairEnv(t, func(c *etcd.Config) {
			if mod != nil {
				mod(&c.Rules)
			}
		}))
	})
}

// backend is the lock state behind the env (with two servers, the
// first's).
func (e *env) backend() lock.Backend {
	if e.c != nil {
		return e.c.members[0].b
	}
	return e.m
}

// base is the URL of the server the next call (or stream) goes to.
func (e *env) base(turn *int) string {
	if e.c == nil {
		return e.ts.URL
	}
	m := e.c.members[*turn%len(e.c.members)]
	*turn++
	return m.url
}

// settled checks the backend's gauges. With two servers each one's are as
// its watch of etcd has seen the changes, which the other server's changes
// reach a moment later: it waits until every server's satisfy ok.
func (e *env) settled(what string, ok func(lock.Stats) bool) {
	e.t.Helper()
	if e.c == nil {
		if st := e.backend().Stats(); !ok(st) {
			e.t.Fatalf("%s: stats %+v", what, st)
		}
		return
	}
	kit.Await(e.t, what, func() error {
		for _, m := range e.c.members {
			if st := m.b.Stats(); !ok(st) {
				return fmt.Errorf("%s: stats %+v", m.url, st)
			}
		}
		return nil
	})
}

// newEnv runs a server as dlock serve does: the event loop and the lean
// loop in front of net/http (Serve).
func newEnv(t testing.TB, mod func(*memory.Config)) *env { return newEnvMode(t, mod, true) }

// newEnvMode with lean=false serves through net/http alone (httptest).
func newEnvMode(t testing.TB, mod func(*memory.Config), lean bool) *env {
	return newEnvWith(t, envConfig{mod: mod, serial: !lean})
}

// envConfig is a test server's setup; the zero value is newEnv's.
type envConfig struct {
	mod        func(*memory.Config)
	serial     bool                            // net/http alone, without the lean loop
	goroutines bool                            // the lean loop without the event loop
	opts       Options                         // PingInterval defaults to 50 ms
	prep       func(*Server)                   // called before serving
	wrap       func(net.Listener) net.Listener // wraps the listener Serve gets
	goAccept   bool                            // net.Listen's listener: Go's Accept, not the raw accept loop
	deadPeer   time.Duration                   // Listen's; DefaultDeadPeer if zero
	idle       time.Duration                   // the http.Server's IdleTimeout
}

// loops are the two ways the lean loop runs, for the tests that hold both
// to the same rules: a goroutine a connection, and the event loop, which
// hands a connection to a goroutine of its own whenever it has to wait.
var loops = []struct {
	name       string
	goroutines bool
}{{"event loop", false}, {"goroutines", true}}

func newEnvWith(t testing.TB, ec envConfig) *env {
	t.Helper()
	cfg := memory.DefaultConfig()
	if ec.mod != nil {
		ec.mod(&cfg)
	}
	m, err := memory.New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	opts := ec.opts
	if opts.PingInterval == 0 {
		opts.PingInterval = 50 * time.Millisecond
	}
	if !ec.goroutines {
		opts.EventLoop = true // as dlock serve sets it
	}
	srv := New(m, opts)
	if ec.prep != nil {
		ec.prep(srv)
	}
	ts := httptest.NewUnstartedServer(srv)
	ts.Config.IdleTimeout = ec.idle
	if !ec.serial {
		if !ec.goAccept {
			// As dlock serve listens: the raw accept loop (accept.go)
			// takes it.
			ts.Listener.Close()
			deadPeer := DefaultDeadPeer
			if ec.deadPeer > 0 {
				deadPeer = ec.deadPeer
			}
			l, err := Listen(context.Background(), "127.0.0.1:0", DefaultPingInterval, deadPeer)
			if err != nil {
				t.Fatal(err)
			}
			ts.Listener = l
		}
		ln := ts.Listener
		if ec.wrap != nil {
			ln = ec.wrap(ln)
		}
		done := make(chan struct{})
		go func() { defer close(done); srv.Serve(ln, ts.Config) }()
		ts.URL = "http://" + ts.Listener.Addr().String()
		t.Cleanup(func() {
			srv.Drain()
			srv.Close()
			ts.Config.Close()
			<-done
			m.Close()
		})
	} else {
		ts.Start()
		t.Cleanup(func() {
			srv.Drain()
			ts.Close()
			m.Close()
		})
	}
	return &env{t: t, m: m, srv: srv, ts: ts}
}

// call sends a request and decodes the JSON answer into a map.
func (e *env) call(method, path, body string) (int, map[string]any) {
	e.t.Helper()
	req, _ := http.NewRequest(method, e.base(&e.calls)+path, strings.NewReader(body))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.Header.Get(api.EpochHeader) != e.backend().Info().Epoch {
		e.t.Fatalf("%s %s: epoch header %q, want %q", method, path, resp.Header.Get(api.EpochHeader), e.backend().Info().Epoch)
	}
	var out map[string]any
	data, _ := io.ReadAll(resp.Body)
	if err := json.Unmarshal(data, &out); err != nil && path != "/metrics" {
		e.t.Fatalf("%s %s: body %q is not JSON: %v", method, path, data, err)
	}
	return resp.StatusCode, out
}

func TestHTTPRules(t *testing.T) {
	for _, lean := range []bool{true, false} {
		t.Run(fmt.Sprint("lean=", lean), func(t *testing.T) { testHTTPRules(t, newEnvMode(t, nil, lean)) })
	}
	t.Run("etcd, two servers", func(t *testing.T) { testHTTPRules(t, newPairEnv(t, nil)) })
}

func testHTTPRules(t *testing.T, e *env) {
	big := `{"type":"pull","resource_id":"` + strings.Repeat("x", 70<<10) + `","node_id":"a"}`
	steps := []struct {
		method, path, body string
		status             int
		want               map[string]any
	}{
		{"POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"a"}`, 200, map[string]any{"acquired": true, "queued": false, "skip": false, "holder": "a", "position": 0.0}},
		{"POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"b"}`, 200, map[string]any{"acquired": false, "queued": true, "holder": "a", "position": 1.0, "token": 0.0}},
		{"POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"c"}`, 200, map[string]any{"queued": true, "position": 2.0}},
		{"POST", "/unlock", `{"type":"pull","resource_id":"r","node_id":"b"}`, 403, map[string]any{"code": "not_holder"}},
		{"POST", "/unlock", `{"type":"pull","resource_id":"r","node_id":"a","token":1}`, 409, map[string]any{"code": "stale_token"}},
		{"POST", "/unlock", `{"type":"pull","resource_id":"r","node_id":"a","error":"disk full"}`, 200, map[string]any{"released": true, "next_holder": "b"}},
		{"POST", "/unlock", `{"type":"pull","resource_id":"r","node_id":"a","error":"disk full"}`, 200, map[string]any{"released": true, "next_holder": "b", "replayed": true}},
		{"GET", "/status?type=pull&resource_id=r&node_id=c", "", 200, map[string]any{"state": "held", "holder": "b", "queue_length": 1.0, "position": 1.0}},
		{"POST", "/cancel", `{"type":"pull","resource_id":"r","node_id":"c"}`, 200, map[string]any{"dequeued": true, "released": false}},
		{"POST", "/unlock", `{"type":"pull","resource_id":"r","node_id":"b","success":true}`, 200, map[string]any{"released": true, "next_holder": ""}},
		{"GET", "/status?type=pull&resource_id=r", "", 200, map[string]any{"state": "free", "holder": "", "acquired_at": "", "queue_length": 0.0}},
		{"POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"d","skip_recent":true}`, 200, map[string]any{"skip": true, "acquired": false}},
		{"POST", "/cancel", `{"type":"pull","resource_id":"r","node_id":"d"}`, 200, map[string]any{"dequeued": false, "released": false}},
		// Bad input.
		{"POST", "/lock", `{"type":"Fetch","resource_id":"r","node_id":"a"}`, 400, map[string]any{"code": "invalid_request"}},
		{"POST", "/lock", `{"type":"image_layer","resource_id":"r","node_id":"a"}`, 400, map[string]any{"code": "invalid_request"}},
		{"POST", "/lock", `{"type":"pull","node_id":"a"}`, 400, map[string]any{"code": "invalid_request", "error": "invalid request: resource_id is required"}},
		{"POST", "/lock", `{"type":"pull","resource_id":"r","node_id":7}`, 400, map[string]any{"code": "invalid_request", "error": "invalid request: field node_id must be a JSON string"}},
		{"POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"a","lease":"forever"}`, 400, map[string]any{"code": "invalid_request"}},
		{"POST", "/lock", `{"type":"pull"`, 400, map[string]any{"code": "invalid_request"}},
		{"POST", "/lock", ``, 400, map[string]any{"code": "invalid_request"}},
		{"POST", "/lock", big, 413, map[string]any{"code": "too_large"}},
		{"GET", "/lock", "", 405, map[string]any{"code": "method_not_allowed"}},
		{"POST", "/status", "", 405, map[string]any{"code": "method_not_allowed"}},
		{"GET", "/nope", "", 404, map[string]any{"code": "not_found"}},
		{"GET", "/status?type=pull", "", 400, map[string]any{"code": "invalid_request"}},
		{"GET", "/refcount?resource_id=r", "", 404, map[string]any{"code": "not_found"}},
		{"POST", "/refcount/add", `{"resource_id":"r","node_id":"a"}`, 404, map[string]any{"code": "not_found"}},
		{"GET", "/healthz", "", 200, map[string]any{"status": "ok"}},
		{"GET", "/readyz", "", 200, map[string]any{"status": "ready"}},
	}
	for i, s := range steps {
		status, got := e.call(s.method, s.path, s.body)
		if status != s.status {
			t.Fatalf("step %d %s %s: status %d %v, want %d", i, s.method, s.path, status, got, s.status)
		}
		for k, v := range s.want {
			if got[k] != v {
				t.Fatalf("step %d %s %s: %s = %#v, want %#v (body %v)", i, s.method, s.path, k, got[k], v, got)
			}
		}
		if status >= 400 && (got["error"] != got["message"] || got["error"] == "") {
			t.Fatalf("step %d: error body %v must carry error = message", i, got)
		}
	}
	e.settled("no holds or waiters: rejected requests change nothing", func(st lock.Stats) bool { return st.Held == 0 && st.Queued == 0 })
}

func TestHTTPLockHeld(t *testing.T) {
	onBackends(t, func(c *lock.Rules) { c.AllowMultiNodeDownload = false }, testHTTPLockHeld)
}

func testHTTPLockHeld(t *testing.T, e *env) {
	e.call("POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"a"}`)
	status, got := e.call("POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"b"}`)
	if status != 409 || got["code"] != "lock_held" || got["holder"] != "a" {
		t.Fatalf("got %d %v", status, got)
	}
}

func TestHTTPRefCount(t *testing.T) {
	t.Run("memory", func(t *testing.T) {
		store, err := refcount.OpenServerStore(t.TempDir() + "/refs.db")
		if err != nil {
			t.Fatal(err)
		}
		defer store.Close()
		testHTTPRefCount(t, newEnv(t, func(c *memory.Config) { c.RefStore = store; c.UpdateRequiresNoRef = true }))
	})
	t.Run("etcd, two servers", func(t *testing.T) {
		testHTTPRefCount(t, newPairEnv(t, func(c *etcd.Config) { c.RefCounting = true; c.UpdateRequiresNoRef = true }))
	})
}

func testHTTPRefCount(t *testing.T, e *env) {
	steps := []struct {
		method, path, body string
		status             int
		want               map[string]any
	}{
		{"POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"a"}`, 200, map[string]any{"acquired": true}},
		{"POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"b"}`, 200, map[string]any{"queued": true}},
		{"POST", "/lock", `{"type":"delete","resource_id":"r","node_id":"d"}`, 409, map[string]any{"code": "in_use"}},
		{"POST", "/lock", `{"type":"update","resource_id":"r","node_id":"u"}`, 409, map[string]any{"code": "in_use"}},
		{"POST", "/unlock", `{"type":"pull","resource_id":"r","node_id":"a","success":true}`, 200, nil},
		{"GET", "/refcount?resource_id=r", "", 200, map[string]any{"resource_id": "r", "count": 2.0}},
		{"POST", "/lock", `{"type":"delete","resource_id":"r","node_id":"d"}`, 409, map[string]any{"code": "in_use"}},
		{"POST", "/refcount/release", `{"resource_id":"r","node_id":"a"}`, 200, map[string]any{"count": 1.0}},
		{"POST", "/refcount/release", `{"node_id":"b"}`, 200, map[string]any{"node_id": "b", "released": 1.0}},
		{"POST", "/lock", `{"type":"update","resource_id":"r","node_id":"u"}`, 200, map[string]any{"acquired": true}},
		{"POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"p"}`, 409, map[string]any{"code": "updating"}},
		{"POST", "/refcount/add", `{"resource_id":"r","node_id":"p"}`, 409, map[string]any{"code": "updating"}},
		{"POST", "/unlock", `{"type":"update","resource_id":"r","node_id":"u"}`, 200, nil},
		{"POST", "/lock", `{"type":"delete","resource_id":"r","node_id":"d"}`, 200, map[string]any{"acquired": true}},
		{"POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"p"}`, 409, map[string]any{"code": "deleting"}},
		{"POST", "/refcount/add", `{"resource_id":"r","node_id":"p"}`, 409, map[string]any{"code": "deleting"}},
		{"POST", "/unlock", `{"type":"delete","resource_id":"r","node_id":"d"}`, 200, nil},
		{"POST", "/refcount/add", `{"resource_id":"r","node_id":"p"}`, 200, map[string]any{"count": 1.0}},
		{"POST", "/refcount/add", `{"resource_id":"r","node_id":"p"}`, 200, map[string]any{"count": 1.0}},
		{"POST", "/refcount/add", `{"node_id":"p"}`, 400, map[string]any{"code": "invalid_request"}},
	}
	for i, s := range steps {
		status, got := e.call(s.method, s.path, s.body)
		if status != s.status {
			t.Fatalf("step %d %s %s: status %d %v, want %d", i, s.method, s.path, status, got, s.status)
		}
		for k, v := range s.want {
			if got[k] != v {
				t.Fatalf("step %d %s %s: %s = %#v, want %#v (body %v)", i, s.method, s.path, k, got[k], v, got)
			}
		}
	}
}

// subscribe opens an event stream of /subscribe with query, with a
// Last-Event-ID header unless lastID is "".
func (e *env) subscribe(query string, lastID string) *kit.Stream {
	e.t.Helper()
	return kit.OpenStream(e.t, e.base(&e.subs)+"/subscribe?"+query, lastID)
}

func TestSSE(t *testing.T) { onBackends(t, nil, testSSE) }

func testSSE(t *testing.T, e *env) {
	// With two servers, streams are opened on each in turn: b's stream is
	// on the other server than the observer, and b's reconnection below
	// on the other server than its first stream.
	obs := e.subscribe("type=pull&resource_id=r", "")
	obs.Next(t)
	b := e.subscribe("node_id=b", "")
	sub := b.Next(t)
	if sub.Event != "subscribed" || sub.ID == "" {
		t.Fatalf("first frame %+v", sub)
	}
	if d := sub.JSON(t); len(d) != 3 || d["node_id"] != "b" || d["epoch"] != e.backend().Info().Epoch {
		t.Fatalf("subscribed data %v: exactly event, node_id and epoch", d)
	}
	e.call("POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"a"}`)
	e.call("POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"b"}`)
	e.call("POST", "/unlock", `{"type":"pull","resource_id":"r","node_id":"a","error":"boom"}`)
	got := b.Next(t)
	d := got.JSON(t)
	if got.Event != "lock_assigned" || d["node_id"] != "b" || d["type"] != "pull" || d["resource_id"] != "r" || d["token"] == nil {
		t.Fatalf("b got %+v", got)
	}
	var order []string
	for range 3 {
		f := obs.Next(t)
		order = append(order, f.Event+":"+f.JSON(t)["node_id"].(string))
	}
	if want := "lock_assigned:a lock_assigned:b operation_completed:a"; strings.Join(order, " ") != want {
		t.Fatalf("observer order %v, want %s", order, want)
	}
	// b's stream breaks; while it is away the lock is handed back and forth.
	b.Close()
	e.call("POST", "/lock", `{"type":"pull","resource_id":"s","node_id":"a"}`)
	e.call("POST", "/lock", `{"type":"pull","resource_id":"s","node_id":"b"}`)
	e.call("POST", "/unlock", `{"type":"pull","resource_id":"s","node_id":"a","success":true}`)
	b2 := e.subscribe("node_id=b", got.ID)
	if f := b2.Next(t); f.Event != "subscribed" || f.ID != got.ID {
		t.Fatalf("reconnect: first frame %+v, want subscribed with id %s", f, got.ID)
	}
	missed := b2.Next(t)
	if md := missed.JSON(t); missed.Event != "operation_completed" || md["success"] != true || md["node_id"] != "a" || md["resource_id"] != "s" {
		t.Fatalf("replayed %+v", missed)
	}
}

func TestSSEBadRequests(t *testing.T) { onBackends(t, nil, testSSEBadRequests) }

func testSSEBadRequests(t *testing.T, e *env) {
	for _, q := range []string{"", "type=pull", "type=Get&resource_id=r", "type=get%2Fx&resource_id=r", "node_id=%00"} {
		if status, got := e.call("GET", "/subscribe?"+q, ""); status != 400 || got["code"] != "invalid_request" {
			t.Fatalf("subscribe?%s: %d %v", q, status, got)
		}
	}
}

// TestDrain is of one server's shutdown, not of a backend's rules: it runs
// on memory.Backend alone.
func TestDrain(t *testing.T) {
	e := newEnv(t, nil)
	s := e.subscribe("node_id=a", "")
	s.Next(t)
	e.srv.Drain() // returns once every stream has ended
	ended := make(chan error, 1)
	go func() {
		_, err := io.ReadAll(s.R) // pings may still be in flight
		ended <- err
	}()
	select {
	case err := <-ended:
		if err != nil {
			t.Fatalf("stream ended with %v, want a clean end", err)
		}
	case <-time.After(10 * time.Second):
		s.Close()
		t.Fatal("Drain returned but the event stream did not end")
	}
	if status, got := e.call("GET", "/healthz", ""); status != 503 || got["code"] != "unavailable" {
		t.Fatalf("healthz while draining: %d %v", status, got)
	}
	if status, got := e.call("GET", "/readyz", ""); status != 503 || got["code"] != "unavailable" {
		t.Fatalf("readyz while draining: %d %v", status, got)
	}
}

// TestMetrics runs on memory.Backend alone: the counters it reads are one
// server's (a pair's are split between them), and the gauges of a server on
// etcd are as its watch has seen the other's changes, a moment later.
func TestMetrics(t *testing.T) {
	e := newEnv(t, nil)
	e.call("POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"a"}`)
	resp, err := http.Get(e.ts.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	for _, want := range []string{"dlock_locks_held 1", "dlock_grants_total 1", `dlock_http_request_duration_seconds_count{endpoint="/lock"} 1`, "dlock_sessions 0"} {
		if !strings.Contains(string(body), want) {
			t.Errorf("metrics lack %q", want)
		}
	}
}

// TestSessionLostOverHTTP: closing a session stream is noticed through the
// request context, and after the grace the node's hold passes on.
// On etcd the grace is the session lease's TTL, in whole seconds and at
// least etcd's minimum (docs/DESIGN.md, "An etcd backend"): there it takes
// a second or two.
func TestSessionLostOverHTTP(t *testing.T) {
	onBackends(t, func(c *lock.Rules) { c.SessionGrace = 100 * time.Millisecond }, testSessionLostOverHTTP)
}

func testSessionLostOverHTTP(t *testing.T, e *env) {
	a := e.subscribe("node_id=a", "")
	a.Next(t)
	b := e.subscribe("node_id=b", "")
	b.Next(t)
	e.call("POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"a"}`)
	e.call("POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"b"}`)
	a.Close()
	if f := b.Next(t); f.Event != "lock_assigned" {
		t.Fatalf("b got %+v, want lock_assigned after a's session was lost", f)
	}
	_, st := e.call("GET", "/status?type=pull&resource_id=r", "")
	if lc := st["last_completed"].(map[string]any); st["holder"] != "b" || lc["error"] != "session lost" || lc["node_id"] != "a" {
		t.Fatalf("status %v", st)
	}
	e.settled("one session left", func(st lock.Stats) bool { return st.Sessions == 1 })
}

func TestPing(t *testing.T) { onBackends(t, nil, testPing) }

func testPing(t *testing.T, e *env) { // PingInterval 50ms
	s := e.subscribe("node_id=a", "")
	s.Next(t)
	if line := s.Line(t); line != ": ping\n" {
		t.Fatalf("after a silent interval got %q, want a ping comment", line)
	}
}
