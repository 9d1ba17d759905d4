package server

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/internal/rawhttp"
	"github.com/dlock/dlock/lock/etcd"
)

// cluster is several dlock servers on one etcd data set, each with its own
// etcd client, etcd.Backend and Server on 127.0.0.1: one lock service
// (docs/DESIGN.md, "An etcd backend"). The tests talk to it over HTTP only.
type cluster struct {
	t     testing.TB
	etcd  *etcdtest.Server
	cfg   etcd.Config
	epoch string // the data set's, answered by every server
	// members are in start order; a restarted server is a new member.
	members []*member
	// prep, when set, is called with each member's Server before it serves.
	prep func(*Server)
}

// member is one dlock server of a cluster.
type member struct {
	c     *cluster
	cli   *clientv3.Client
	b     *etcd.Backend
	srv   *Server
	hs    *http.Server
	raw   net.Listener
	url   string
	hooks kit.Hooks
	done  chan struct{} // Serve returned
	// trap, when set, kills the server when it reads an /unlock request
	// (before the backend sees it) or when it writes the answer to one
	// (after the backend made the change): see killOn.
	trap   atomic.Int32
	killed atomic.Bool
	once   sync.Once
}

const (
	trapNone int32 = iota
	trapUnlockRequest
	trapUnlockAnswer
)

// newCluster starts n servers on a fresh data set of the test binary's
// shared embedded etcd; mod changes etcd.DefaultConfig, the same for every
// server (etcd.New).
func newCluster(t testing.TB, n int, mod func(*etcd.Config)) *cluster {
	t.Helper()
	return newClusterPrep(t, n, mod, nil)
}

// newClusterPrep is newCluster, with prep called on each member's Server
// before it serves.
func newClusterPrep(t testing.TB, n int, mod func(*etcd.Config), prep func(*Server)) *cluster {
	t.Helper()
	cfg := etcd.DefaultConfig()
	if mod != nil {
		mod(&cfg)
	}
	cfg.Prefix = etcdtest.Prefix(t)
	c := &cluster{t: t, etcd: etcdtest.Shared(t), cfg: cfg, prep: prep}
	for range n {
		c.start()
	}
	return c
}

// start starts one more server on the cluster's data set: a new server, or
// one restarted.
func (c *cluster) start() *member {
	t := c.t
	t.Helper()
	m := &member{c: c, cli: c.etcd.Client(t), done: make(chan struct{})}
	ctx, cancel := context.WithTimeout(context.Background(), kit.Patience)
	defer cancel()
	b, err := etcd.New(ctx, m.cli, c.cfg)
	if err != nil {
		t.Fatal(err)
	}
	m.b = b
	if c.epoch == "" {
		c.epoch = b.Info().Epoch
	}
	// No event loop: the etcd backend's calls wait on etcd
	// (Options.EventLoop).
	m.srv = New(b, Options{PingInterval: 50 * time.Millisecond})
	if c.prep != nil {
		c.prep(m.srv)
	}
	m.raw, err = net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Close()
		t.Fatal(err)
	}
	m.url = "http://" + m.raw.Addr().String()
	m.hs = &http.Server{Handler: m.srv}
	ln := m.hooks.Listen(&trapListener{Listener: m.raw, m: m})
	go func() { defer close(m.done); m.srv.Serve(ln, m.hs) }()
	t.Cleanup(m.stop) // before the client's own cleanup, which runs after
	c.members = append(c.members, m)
	return m
}

// stop stops the server as dlock serve does (a killed one, what is left of
// it); later calls do nothing.
func (m *member) stop() {
	m.once.Do(func() {
		m.srv.Drain()
		m.srv.Close()
		m.hs.Close()
		<-m.done
		m.b.Close()
	})
}

// kill is the in-process stand-in for a server's SIGKILL: its listener,
// every connection it has open, its backend and its etcd client close at
// once, with no drain: its streams break, its requests get no answer, and
// nothing it kept alive in etcd is kept any longer. Nothing is revoked: the
// leases it kept run out, as they would. Safe to call from one of its own
// connections' goroutines.
func (m *member) kill() {
	if m.killed.Swap(true) {
		return
	}
	m.raw.Close()
	m.hooks.KillAll()
	m.b.Close()
	m.cli.Close()
}

// killOn arms the member's trap (trapUnlockRequest or trapUnlockAnswer).
func (m *member) killOn(trap int32) { m.trap.Store(trap) }

type trapListener struct {
	net.Listener
	m *member
}

func (l *trapListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &trapConn{Conn: c, m: l.m}, nil
}

// trapConn kills its member at the moment its trap names.
type trapConn struct {
	net.Conn
	m      *member
	unlock atomic.Bool // the last request read was an /unlock
}

func (c *trapConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 && bytes.Contains(p[:n], []byte("POST /unlock ")) {
		if c.m.trap.Load() == trapUnlockRequest {
			c.m.kill()
			return 0, net.ErrClosed
		}
		c.unlock.Store(true)
	}
	return n, err
}

func (c *trapConn) Write(p []byte) (int, error) {
	if c.unlock.Swap(false) && c.m.trap.Load() == trapUnlockAnswer {
		c.m.kill()
		return 0, net.ErrClosed
	}
	return c.Conn.Write(p)
}

func (c *trapConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// send sends one request and decodes its JSON answer; safe from any
// goroutine.
func send(method, url, body string) (int, map[string]any, http.Header, error) {
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		return 0, nil, nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, nil, nil, err
	}
	var out map[string]any
	if err := json.Unmarshal(data, &out); err != nil {
		return 0, nil, nil, fmt.Errorf("%s %s: body %q is not JSON: %v", method, url, data, err)
	}
	return resp.StatusCode, out, resp.Header, nil
}

// call sends a request to m and checks that the answer carries the data
// set's epoch.
func (m *member) call(t testing.TB, method, path, body string) (int, map[string]any) {
	t.Helper()
	status, out, h, err := send(method, m.url+path, body)
	if err != nil {
		t.Fatal(err)
	}
	if got := h.Get(api.EpochHeader); got != m.c.epoch {
		t.Fatalf("%s %s%s: epoch %q, want the data set's %q", method, m.url, path, got, m.c.epoch)
	}
	return status, out
}

// must is call for a request that must answer 200, with want's fields.
func (m *member) must(t testing.TB, method, path, body string, want map[string]any) map[string]any {
	t.Helper()
	status, got := m.call(t, method, path, body)
	if status != 200 {
		t.Fatalf("%s %s on %s: %d %v, want 200", method, path, m.url, status, got)
	}
	for k, v := range want {
		if got[k] != v {
			t.Fatalf("%s %s %s on %s: %s = %#v, want %#v (%v)", method, path, body, m.url, k, got[k], v, got)
		}
	}
	return got
}

func (m *member) subscribe(t testing.TB, query, lastID string) *kit.Stream {
	t.Helper()
	return kit.OpenStream(t, m.url+"/subscribe?"+query, lastID)
}

// expect reads s's next event and checks its name and data fields.
func expect(t testing.TB, s *kit.Stream, event string, want map[string]any) kit.Frame {
	t.Helper()
	f := s.Next(t)
	if f.Event != event {
		t.Fatalf("got %v, want %s %v", f, event, want)
	}
	d := f.JSON(t)
	for k, v := range want {
		if d[k] != v {
			t.Fatalf("got %v: %s = %#v, want %#v", f, k, d[k], v)
		}
	}
	return f
}

func lockBody(typ, res, node string, extra ...string) string {
	s := fmt.Sprintf(`{"type":%q,"resource_id":%q,"node_id":%q`, typ, res, node)
	for _, e := range extra {
		s += "," + e
	}
	return s + "}"
}

func tokenOf(t testing.TB, v any) uint64 {
	t.Helper()
	f, ok := v.(float64)
	if !ok || f <= 0 {
		t.Fatalf("token %#v", v)
	}
	return uint64(f)
}

// TestClusterHandOff: a key acquired on one server, queued for on the
// others, is handed across: the waiter's stream on another server gets
// lock_assigned, and a pull's success tells every waiter, on whichever
// server its stream is; an observer on a third server sees it all, with
// the ids the waiters' streams saw (docs/API.md, "GET /subscribe").
func TestClusterHandOff(t *testing.T) {
	c := newCluster(t, 3, nil)
	a, b, cc := c.members[0], c.members[1], c.members[2]
	obs := cc.subscribe(t, "type=pull&resource_id=r", "")
	expect(t, obs, "subscribed", nil)
	w1 := b.subscribe(t, "node_id=w1", "")
	expect(t, w1, "subscribed", map[string]any{"node_id": "w1", "epoch": c.epoch})
	w2 := cc.subscribe(t, "node_id=w2", "")
	expect(t, w2, "subscribed", map[string]any{"node_id": "w2", "epoch": c.epoch})

	got := a.must(t, "POST", "/lock", lockBody("pull", "r", "h"), map[string]any{"acquired": true, "holder": "h"})
	t1 := tokenOf(t, got["token"])
	b.must(t, "POST", "/lock", lockBody("pull", "r", "w1"), map[string]any{"queued": true, "holder": "h", "position": 1.0})
	cc.must(t, "POST", "/lock", lockBody("pull", "r", "w2"), map[string]any{"queued": true, "holder": "h", "position": 2.0})
	a.must(t, "GET", "/status?type=pull&resource_id=r&node_id=w2", "", map[string]any{"state": "held", "holder": "h", "queue_length": 2.0, "position": 2.0})

	// A failure on A hands the key to w1, whose stream is on B.
	a.must(t, "POST", "/unlock", lockBody("pull", "r", "h", `"error":"boom"`), map[string]any{"released": true, "next_holder": "w1"})
	as := expect(t, w1, "lock_assigned", map[string]any{"node_id": "w1", "resource_id": "r"})
	t2 := tokenOf(t, as.JSON(t)["token"])
	if t2 <= t1 {
		t.Fatalf("hand-off token %d after %d", t2, t1)
	}
	o1 := expect(t, obs, "lock_assigned", map[string]any{"node_id": "h", "token": float64(t1)})
	o2 := expect(t, obs, "lock_assigned", map[string]any{"node_id": "w1", "token": float64(t2)})
	o3 := expect(t, obs, "operation_completed", map[string]any{"node_id": "h", "success": false, "error": "boom", "next_holder": "w1"})
	if o2.ID != as.ID || o2.Data != as.Data {
		t.Fatalf("the observer on C saw %v, w1's stream on B %v: one event, one id", o2, as)
	}
	if !(idOf(t, o1) < idOf(t, o2) && idOf(t, o2) < idOf(t, o3)) {
		t.Fatalf("ids do not increase: %v %v %v", o1, o2, o3)
	}
	// w1 confirms the hand-off on C: the same grant.
	cc.must(t, "POST", "/lock", lockBody("pull", "r", "w1"), map[string]any{"acquired": true, "token": float64(t2)})

	// A success on B tells w2, whose stream is on C, and the observer.
	b.must(t, "POST", "/unlock", lockBody("pull", "r", "w1", `"success":true`, fmt.Sprintf(`"token":%d`, t2)), map[string]any{"released": true, "next_holder": ""})
	done := expect(t, w2, "operation_completed", map[string]any{"node_id": "w1", "success": true, "resource_id": "r"})
	o4 := expect(t, obs, "operation_completed", map[string]any{"node_id": "w1", "success": true})
	if o4.ID != done.ID || o4.Data != done.Data {
		t.Fatalf("the observer saw %v, w2 %v", o4, done)
	}
	for _, m := range c.members {
		m.must(t, "GET", "/status?type=pull&resource_id=r", "", map[string]any{"state": "free", "token": float64(t2), "queue_length": 0.0})
	}
	// w1's own success was not sent to it; its next event is its next
	// grant, on A.
	a.must(t, "POST", "/lock", lockBody("pull", "r2", "w1"), map[string]any{"acquired": true})
	expect(t, w1, "lock_assigned", map[string]any{"resource_id": "r2"})

	// The etcd engine's own counters are exported beside the backend's:
	// A's calls read its cache first (docs/DESIGN.md, "One round trip for
	// a warm call").
	resp, err := http.Get(a.url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	metrics, _ := io.ReadAll(resp.Body)
	if !regexp.MustCompile(`(?m)^dlock_etcd_cache_reads_total\{result="hit"\} [1-9]`).Match(metrics) {
		t.Fatalf("/metrics has no cache hits of the etcd engine:\n%s", metrics)
	}
}

func idOf(t testing.TB, f kit.Frame) uint64 {
	t.Helper()
	var id uint64
	if _, err := fmt.Sscan(f.ID, &id); err != nil || f.ID == "" {
		t.Fatalf("frame %v: id %q", f, f.ID)
	}
	return id
}

// TestClusterReplayElsewhere: a node's stream on A breaks, events of the
// node happen meanwhile (made on every server), and the node reconnects to
// B with Last-Event-ID: `subscribed` carries that id and the stream replays
// exactly the missed events, with the ids a stream of the same node on C
// saw live (docs/API.md, "GET /subscribe": ids increase, replay within the
// grace).
func TestClusterReplayElsewhere(t *testing.T) {
	c := newCluster(t, 3, nil)
	a, b, cc := c.members[0], c.members[1], c.members[2]
	s1 := a.subscribe(t, "node_id=n", "")
	expect(t, s1, "subscribed", nil)
	// The witness: n's second stream, on C, sees every event of n live,
	// and keeps the session while s1 is away.
	s2 := cc.subscribe(t, "node_id=n", "")
	expect(t, s2, "subscribed", nil)

	// handOff makes x hold res, n queue for it, and x end it: a failure
	// hands the key to n (lock_assigned), a success tells n to skip
	// (operation_completed). Each request goes to another server.
	handOff := func(res string, success bool) {
		t.Helper()
		a.must(t, "POST", "/lock", lockBody("pull", res, "x"), map[string]any{"acquired": true})
		b.must(t, "POST", "/lock", lockBody("pull", res, "n"), map[string]any{"queued": true})
		cc.must(t, "POST", "/unlock", lockBody("pull", res, "x", fmt.Sprintf(`"success":%v`, success)), nil)
	}
	handOff("r1", false)
	last := expect(t, s1, "lock_assigned", map[string]any{"node_id": "n", "resource_id": "r1"})
	if w := expect(t, s2, "lock_assigned", nil); w.ID != last.ID || w.Data != last.Data {
		t.Fatalf("n's streams on A and C: %v and %v", last, w)
	}

	s1.Close()
	b.must(t, "POST", "/unlock", lockBody("pull", "r1", "n", `"success":true`), map[string]any{"released": true})
	handOff("r2", true)
	handOff("r3", false)
	missed := []kit.Frame{
		expect(t, s2, "operation_completed", map[string]any{"resource_id": "r2", "node_id": "x", "success": true}),
		expect(t, s2, "lock_assigned", map[string]any{"resource_id": "r3", "node_id": "n"}),
	}

	s3 := b.subscribe(t, "node_id=n", last.ID)
	if f := expect(t, s3, "subscribed", map[string]any{"node_id": "n", "epoch": c.epoch}); f.ID != last.ID {
		t.Fatalf("subscribed %v, want the id %s of Last-Event-ID", f, last.ID)
	}
	for _, want := range missed {
		if f := s3.Next(t); f != want {
			t.Fatalf("replayed %v, want %v as n's stream on C saw it", f, want)
		}
	}
	// Nothing else was replayed: the next event on the new stream is the
	// next one of n.
	handOff("r4", false)
	next := expect(t, s2, "lock_assigned", map[string]any{"resource_id": "r4"})
	if f := s3.Next(t); f != next {
		t.Fatalf("after the replay got %v, want %v", f, next)
	}
}

// TestClusterSessionMoves: a node's stream moves from A to B within the
// session grace; its session, and the holds leased to it, outlive the
// grace that began on A, because B keeps the session now (docs/DESIGN.md,
// "Leases": a session lives while any stream of the node is open, on any
// server).
func TestClusterSessionMoves(t *testing.T) {
	c := newCluster(t, 2, func(cfg *etcd.Config) { cfg.SessionGrace = time.Second })
	a, b := c.members[0], c.members[1]
	sa := a.subscribe(t, "node_id=n", "")
	expect(t, sa, "subscribed", nil)
	got := a.must(t, "POST", "/lock", lockBody("pull", "r", "n"), map[string]any{"acquired": true}) // a session lease: n has a stream
	tok := tokenOf(t, got["token"])
	expect(t, sa, "lock_assigned", map[string]any{"resource_id": "r"})

	sa.Close()
	sb := b.subscribe(t, "node_id=n", "")
	expect(t, sb, "subscribed", nil)

	// The witness w starts its session on A after n's stream there closed,
	// takes a session lease, and leaves. Once its hold is gone for
	// "session lost", a grace has passed since n's stream left A: n's
	// session would have ended too had B not kept it.
	sw := a.subscribe(t, "node_id=w", "")
	expect(t, sw, "subscribed", nil)
	a.must(t, "POST", "/lock", lockBody("pull", "wr", "w", `"lease":"session"`), map[string]any{"acquired": true})
	sw.Close()
	kit.Await(t, "w's session lost", func() error {
		_, st := b.call(t, "GET", "/status?type=pull&resource_id=wr", "")
		if lc, _ := st["last_completed"].(map[string]any); st["state"] != "free" || lc["error"] != "session lost" {
			return fmt.Errorf("status %v", st)
		}
		return nil
	})
	for _, m := range c.members {
		m.must(t, "GET", "/status?type=pull&resource_id=r", "", map[string]any{"state": "held", "holder": "n", "token": float64(tok), "last_completed": nil})
	}
	// The hold is n's still: its unlock, on A, hands nothing on and ends it.
	a.must(t, "POST", "/unlock", lockBody("pull", "r", "n", `"success":true`, fmt.Sprintf(`"token":%d`, tok)), map[string]any{"released": true, "replayed": nil})
	// And n's session goes on: its next grant's lock_assigned arrives on B.
	a.must(t, "POST", "/lock", lockBody("pull", "r5", "n"), map[string]any{"acquired": true})
	expect(t, sb, "lock_assigned", map[string]any{"resource_id": "r5"})
}

// TestClusterKilledMidHandOff: the server that is handing a key on dies
// abruptly (kill: no drain, its connections and etcd client cut), either
// after the hand-off reached etcd and before it answered, or before the
// unlock reached its backend. The other servers keep serving, the waiter,
// whose stream is on another server, gets the key once, and no one else
// does (docs/DESIGN.md, "An etcd backend": state is etcd's, not a
// server's).
func TestClusterKilledMidHandOff(t *testing.T) {
	t.Run("answer lost", func(t *testing.T) {
		c := newCluster(t, 3, nil)
		a, b, cc := c.members[0], c.members[1], c.members[2]
		obs := cc.subscribe(t, "type=pull&resource_id=r", "")
		expect(t, obs, "subscribed", nil)
		w := b.subscribe(t, "node_id=w", "")
		expect(t, w, "subscribed", nil)
		t1 := tokenOf(t, a.must(t, "POST", "/lock", lockBody("pull", "r", "h"), map[string]any{"acquired": true})["token"])
		b.must(t, "POST", "/lock", lockBody("pull", "r", "w"), map[string]any{"queued": true})

		a.killOn(trapUnlockAnswer)
		if status, got, _, err := send("POST", a.url+"/unlock", lockBody("pull", "r", "h", `"error":"boom"`)); err == nil {
			t.Fatalf("the killed server answered %d %v", status, got)
		}
		// The hand-off was made: w's stream on B gets it, from etcd.
		t2 := tokenOf(t, expect(t, w, "lock_assigned", map[string]any{"node_id": "w", "resource_id": "r"}).JSON(t)["token"])
		if t2 <= t1 {
			t.Fatalf("token %d after %d", t2, t1)
		}
		// h's client tries its unlock again, on C: the answer it lost.
		cc.must(t, "POST", "/unlock", lockBody("pull", "r", "h", `"error":"boom"`), map[string]any{"released": true, "next_holder": "w", "replayed": true})
		checkOneHandOff(t, c, obs, "h", "w", t1, t2, "boom")
	})
	t.Run("request lost", func(t *testing.T) {
		c := newCluster(t, 3, func(cfg *etcd.Config) { cfg.SessionGrace = time.Second })
		a, b, cc := c.members[0], c.members[1], c.members[2]
		obs := cc.subscribe(t, "type=pull&resource_id=r", "")
		expect(t, obs, "subscribed", nil)
		h := a.subscribe(t, "node_id=h", "") // h's session is kept by A alone
		expect(t, h, "subscribed", nil)
		w := b.subscribe(t, "node_id=w", "")
		expect(t, w, "subscribed", nil)
		t1 := tokenOf(t, a.must(t, "POST", "/lock", lockBody("pull", "r", "h"), map[string]any{"acquired": true})["token"])
		b.must(t, "POST", "/lock", lockBody("pull", "r", "w"), map[string]any{"queued": true})

		a.killOn(trapUnlockRequest)
		if status, got, _, err := send("POST", a.url+"/unlock", lockBody("pull", "r", "h", `"error":"boom"`)); err == nil {
			t.Fatalf("the killed server answered %d %v", status, got)
		}
		// Nothing was handed on by A. h's session, which A kept alive,
		// runs out; B or C, whichever claims it first, hands the key on.
		t2 := tokenOf(t, expect(t, w, "lock_assigned", map[string]any{"node_id": "w", "resource_id": "r"}).JSON(t)["token"])
		if t2 <= t1 {
			t.Fatalf("token %d after %d", t2, t1)
		}
		checkOneHandOff(t, c, obs, "h", "w", t1, t2, "session lost")
	})
}

// checkOneHandOff checks, after a killed server, that the key r went from
// holder to next once: the observer saw exactly that, the live servers
// agree, and they keep serving.
func checkOneHandOff(t *testing.T, c *cluster, obs *kit.Stream, holder, next string, t1, t2 uint64, reason string) {
	t.Helper()
	expect(t, obs, "lock_assigned", map[string]any{"node_id": holder, "token": float64(t1)})
	expect(t, obs, "lock_assigned", map[string]any{"node_id": next, "token": float64(t2)})
	expect(t, obs, "operation_completed", map[string]any{"node_id": holder, "success": false, "error": reason, "next_holder": next})
	var live []*member
	for _, m := range c.members {
		if !m.killed.Load() {
			live = append(live, m)
		}
	}
	for _, m := range live {
		m.must(t, "GET", "/status?type=pull&resource_id=r", "", map[string]any{"state": "held", "holder": next, "token": float64(t2), "queue_length": 0.0})
	}
	// The next event of the key is next's own unlock: no second grant came
	// between.
	live[0].must(t, "POST", "/unlock", lockBody("pull", "r", next, `"success":true`, fmt.Sprintf(`"token":%d`, t2)), map[string]any{"released": true})
	expect(t, obs, "operation_completed", map[string]any{"node_id": next, "success": true})
	for _, m := range live {
		tok := tokenOf(t, m.must(t, "POST", "/lock", lockBody("pull", "after-"+m.url, "z"), map[string]any{"acquired": true})["token"])
		m.must(t, "POST", "/unlock", lockBody("pull", "after-"+m.url, "z", fmt.Sprintf(`"token":%d`, tok)), map[string]any{"released": true})
	}
	if _, _, _, err := send("GET", c.members[0].url+"/healthz", ""); err == nil {
		t.Fatal("the killed server still answers")
	}
}

// TestClusterRestart: a server stopped and started again (a new backend on
// the same data set) answers the same epoch, finds the holds and queues as
// they were, and its grants' tokens go on upward; so does a server started
// after every other one stopped (docs/DESIGN.md, "An etcd backend": the
// epoch is the data set's; "Fencing tokens").
func TestClusterRestart(t *testing.T) {
	c := newCluster(t, 2, nil)
	a, b := c.members[0], c.members[1]
	w := b.subscribe(t, "node_id=w", "")
	expect(t, w, "subscribed", nil)
	t1 := tokenOf(t, a.must(t, "POST", "/lock", lockBody("pull", "r", "h", `"lease":"ttl"`), map[string]any{"acquired": true})["token"])
	// ttl leases: nothing here depends on how long the test takes.
	a.must(t, "POST", "/lock", lockBody("pull", "r", "w", `"lease":"ttl"`), map[string]any{"queued": true, "position": 1.0})
	a.must(t, "POST", "/lock", lockBody("pull", "r", "v", `"lease":"ttl"`), map[string]any{"queued": true, "position": 2.0})

	a.stop()
	a2 := c.start() // the check of the epoch header is in call
	a2.must(t, "GET", "/status?type=pull&resource_id=r&node_id=v", "", map[string]any{"state": "held", "holder": "h", "token": float64(t1), "queue_length": 2.0, "position": 2.0})
	a2.must(t, "POST", "/unlock", lockBody("pull", "r", "h", `"error":"boom"`, fmt.Sprintf(`"token":%d`, t1)), map[string]any{"released": true, "next_holder": "w"})
	t2 := tokenOf(t, expect(t, w, "lock_assigned", map[string]any{"resource_id": "r", "node_id": "w"}).JSON(t)["token"])
	if t2 <= t1 {
		t.Fatalf("token %d after %d, across a restart", t2, t1)
	}

	// Every server stops; one starts on the data set alone.
	w.Close()
	a2.stop()
	b.stop()
	d := c.start()
	if _, h, err := healthz(d); err != nil || h["epoch"] != c.epoch {
		t.Fatalf("healthz %v %v, want the epoch %s", h, err, c.epoch)
	}
	d.must(t, "GET", "/status?type=pull&resource_id=r&node_id=v", "", map[string]any{"state": "held", "holder": "w", "token": float64(t2), "queue_length": 1.0, "position": 1.0})
	d.must(t, "POST", "/unlock", lockBody("pull", "r", "w", `"error":"again"`), map[string]any{"released": true, "next_holder": "v"})
	t3 := tokenOf(t, d.must(t, "POST", "/lock", lockBody("pull", "r", "v"), map[string]any{"acquired": true})["token"])
	if t3 <= t2 {
		t.Fatalf("token %d after %d, across a restart of every server", t3, t2)
	}
}

func healthz(m *member) (int, map[string]any, error) {
	status, out, _, err := send("GET", m.url+"/healthz", "")
	return status, out, err
}

// TestClusterTokensUnderLoad: nodes race for a few keys with every request
// sent to a server picked at random. No key is ever granted to two nodes at
// once, each key's tokens strictly increase in the order of its grants, and
// the observers of a key on every server see the same events with the same
// ids, the tokens the nodes got in that order (docs/DESIGN.md, "Fencing
// tokens" and "An etcd backend").
func TestClusterTokensUnderLoad(t *testing.T) {
	const (
		nodes  = 6
		rounds = 12
	)
	keys := []string{"k0", "k1", "k2"}
	c := newCluster(t, 3, nil)
	type observed struct {
		frames []kit.Frame
		err    error
	}
	results := make(map[string][]chan observed)
	for _, k := range keys {
		for _, m := range c.members {
			s := m.subscribe(t, "type=pull&resource_id="+k, "")
			expect(t, s, "subscribed", nil)
			ch := make(chan observed, 1)
			results[k] = append(results[k], ch)
			go func() {
				// Until the last event: "end"'s failure.
				var o observed
				var ev rawhttp.Event
				for {
					if o.err = rawhttp.ReadEvent(s.R, &ev); o.err != nil {
						break
					}
					f := kit.Frame{ID: ev.ID, Event: ev.Name, Data: string(ev.Data)}
					o.frames = append(o.frames, f)
					if f.Event == "operation_completed" && strings.Contains(f.Data, `"node_id":"end"`) {
						break
					}
				}
				ch <- o
			}()
		}
	}

	var (
		mu     sync.Mutex
		last   = map[string]uint64{}
		got    = map[string][]uint64{}
		inside = map[string]*atomic.Bool{}
	)
	for _, k := range keys {
		inside[k] = new(atomic.Bool)
	}
	pick := func() *member { return c.members[rand.IntN(len(c.members))] }
	var wg sync.WaitGroup
	for n := range nodes {
		node := fmt.Sprintf("n%d", n)
		wg.Go(func() {
			for range rounds {
				k := keys[rand.IntN(len(keys))]
				var tok uint64
				pause := time.Millisecond
				for tok == 0 {
					m := pick()
					status, out, _, err := send("POST", m.url+"/lock", lockBody("pull", k, node, `"lease":"ttl"`))
					if err != nil || status != 200 {
						t.Errorf("%s: lock %s on %s: %d %v %v", node, k, m.url, status, out, err)
						return
					}
					if out["acquired"] == true {
						tok = uint64(out["token"].(float64))
						break
					}
					// Queued: ask again, as a client that keeps no
					// stream does; a hand-off is confirmed by it.
					time.Sleep(pause)
					pause = min(2*pause, 20*time.Millisecond)
				}
				if !inside[k].CompareAndSwap(false, true) {
					t.Errorf("%s granted %s (token %d) while another node holds it", node, k, tok)
					return
				}
				mu.Lock()
				if tok <= last[k] {
					t.Errorf("%s granted %s with token %d after %d", node, k, tok, last[k])
				}
				last[k] = tok
				got[k] = append(got[k], tok)
				mu.Unlock()
				inside[k].Store(false)
				m := pick()
				success := rand.IntN(3) == 0 // a success tells the waiters to skip; a failure hands on
				status, out, _, err := send("POST", m.url+"/unlock", lockBody("pull", k, node, fmt.Sprintf(`"success":%v,"token":%d`, success, tok)))
				if err != nil || status != 200 || out["released"] != true {
					t.Errorf("%s: unlock %s on %s: %d %v %v", node, k, m.url, status, out, err)
					return
				}
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	for _, k := range keys {
		c.members[0].must(t, "POST", "/lock", lockBody("pull", k, "end"), map[string]any{"acquired": true})
		c.members[1].must(t, "POST", "/unlock", lockBody("pull", k, "end", `"error":"end"`), map[string]any{"released": true, "next_holder": ""})
	}
	total := 0
	for _, k := range keys {
		var first []kit.Frame
		for i, ch := range results[k] {
			o := <-ch
			if o.err != nil {
				t.Fatalf("%s: observer on %s: %v", k, c.members[i].url, o.err)
			}
			if i == 0 {
				first = o.frames
				continue
			}
			if fmt.Sprint(o.frames) != fmt.Sprint(first) {
				t.Fatalf("%s: the observers on %s and %s saw\n%v\nand\n%v", k, c.members[0].url, c.members[i].url, first, o.frames)
			}
		}
		var prevID, prevTok uint64
		var toks []uint64
		for _, f := range first {
			if id := idOf(t, f); id <= prevID {
				t.Fatalf("%s: id %d after %d", k, id, prevID)
			} else {
				prevID = id
			}
			if f.Event != "lock_assigned" {
				continue
			}
			d := f.JSON(t)
			tok := tokenOf(t, d["token"])
			if tok <= prevTok {
				t.Fatalf("%s: lock_assigned %v after token %d", k, f, prevTok)
			}
			prevTok = tok
			if d["node_id"] != "end" {
				toks = append(toks, tok)
			}
		}
		if fmt.Sprint(toks) != fmt.Sprint(got[k]) {
			t.Fatalf("%s: the observers saw the grants %v, the nodes got %v", k, toks, got[k])
		}
		total += len(toks)
	}
	if total != nodes*rounds {
		t.Fatalf("%d grants, want %d", total, nodes*rounds)
	}
}

// TestClusterRefCount: server-side reference counts kept in etcd
// (etcd.Config.RefCounting) are one set for every server: a delete or an
// update is refused on one server while a pull is held on another, a
// pull's success on one adds its holder and waiters for all, a held delete
// refuses pulls and references everywhere (docs/API.md, "Reference
// counting").
func TestClusterRefCount(t *testing.T) {
	c := newCluster(t, 3, func(cfg *etcd.Config) {
		cfg.RefCounting = true
		cfg.UpdateRequiresNoRef = true
	})
	a, b, cc := c.members[0], c.members[1], c.members[2]
	w := cc.subscribe(t, "node_id=w", "")
	expect(t, w, "subscribed", nil)
	refused := func(m *member, method, path, body, code string) {
		t.Helper()
		if status, got := m.call(t, method, path, body); status != 409 || got["code"] != code {
			t.Fatalf("%s %s %s on %s: %d %v, want 409 %s", method, path, body, m.url, status, got, code)
		}
	}
	a.must(t, "POST", "/lock", lockBody("pull", "r", "h"), map[string]any{"acquired": true})
	refused(b, "POST", "/lock", lockBody("delete", "r", "d"), "in_use")
	refused(cc, "POST", "/lock", lockBody("update", "r", "u"), "in_use")
	b.must(t, "POST", "/lock", lockBody("pull", "r", "w"), map[string]any{"queued": true})
	a.must(t, "POST", "/unlock", lockBody("pull", "r", "h", `"success":true`), map[string]any{"released": true})
	expect(t, w, "operation_completed", map[string]any{"node_id": "h", "success": true, "resource_id": "r"})
	got := b.must(t, "GET", "/refcount?resource_id=r", "", map[string]any{"count": 2.0})
	if fmt.Sprint(got["nodes"]) != "[h w]" {
		t.Fatalf("refcount %v, want h and w", got)
	}
	refused(cc, "POST", "/lock", lockBody("delete", "r", "d"), "in_use")
	a.must(t, "POST", "/refcount/release", `{"resource_id":"r","node_id":"h"}`, map[string]any{"count": 1.0})
	cc.must(t, "POST", "/refcount/release", `{"node_id":"w"}`, map[string]any{"node_id": "w", "released": 1.0})
	b.must(t, "GET", "/refcount?resource_id=r", "", map[string]any{"count": 0.0})

	a.must(t, "POST", "/lock", lockBody("delete", "r", "d"), map[string]any{"acquired": true})
	refused(b, "POST", "/lock", lockBody("pull", "r", "p"), "deleting")
	refused(cc, "POST", "/refcount/add", `{"resource_id":"r","node_id":"p"}`, "deleting")
	refused(b, "POST", "/lock", lockBody("update", "r", "u"), "deleting")
	cc.must(t, "POST", "/lock", lockBody("delete", "r", "w"), map[string]any{"queued": true})
	b.must(t, "POST", "/unlock", lockBody("delete", "r", "d", `"success":true`), map[string]any{"released": true, "next_holder": ""})
	expect(t, w, "operation_completed", map[string]any{"type": "delete", "node_id": "d", "success": true})
	cc.must(t, "POST", "/refcount/add", `{"resource_id":"r","node_id":"p"}`, map[string]any{"count": 1.0})
	refused(a, "POST", "/lock", lockBody("delete", "r", "d"), "in_use")
	refused(b, "POST", "/lock", lockBody("update", "r", "u"), "in_use")
}
