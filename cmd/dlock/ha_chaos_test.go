package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/rawhttp"
)

// TestHAChaosKills runs the shape of a fleet through server deaths: three
// dlock servers on one etcd, 16 nodes, each with its session stream and its
// requests on one server (node i on server i mod 3), each looping lock,
// unlock (success or failure) and cancel over 4 keys; one server is
// SIGKILLed about every 3 s and started again 1 s later. A node whose server
// dies moves to the next one and reopens its stream there with
// Last-Event-ID, within the grace (docs/DESIGN.md, "An etcd backend").
// Several short runs, each with its own kill schedule.
//
// It checks what a node can see:
//   - a server that was not killed answers every request it accepted:
//     a connection it closes without an answer is a fault (docs/DESIGN.md,
//     "Connections");
//   - a token names one holder: the grants answered and the lock_assigned
//     events received never give one token to two nodes;
//   - a stream, resumed or not, delivers each event once: no id twice, ids
//     increasing, and no lock_assigned of one grant twice.
//
// DLOCK_CHAOS_RUNS sets the number of runs (3).
func TestHAChaosKills(t *testing.T) {
	runs := 3
	if v := os.Getenv("DLOCK_CHAOS_RUNS"); v != "" {
		var err error
		if runs, err = strconv.Atoi(v); err != nil {
			t.Fatalf("DLOCK_CHAOS_RUNS=%q: %v", v, err)
		}
	}
	for run := range runs {
		seed := uint64(time.Now().UnixNano()) + uint64(run)
		t.Run(fmt.Sprint("seed=", seed), func(t *testing.T) { chaosRun(t, seed) })
	}
}

func chaosRun(t *testing.T, seed uint64) {
	const (
		nodes  = 16
		keys   = 4
		runFor = 9 * time.Second
		grace  = 2 * time.Second
	)
	h := startHA(t, 3, "--session-grace", grace.String())
	// lives[i] is even while server i is up and odd from just before its
	// SIGKILL until it answers again: a request that saw the same even
	// value before and after it went to a server that lived through it.
	lives := make([]atomic.Int64, len(h.servers))
	c := &chaos{t: t, h: h, lives: lives, grants: map[string]string{}}

	stop := make(chan struct{})
	var killer sync.WaitGroup
	killer.Go(func() {
		rng := rand.New(rand.NewPCG(seed, 1<<40))
		for {
			select {
			case <-stop:
				return
			case <-time.After(time.Duration(2000+rng.IntN(1000)) * time.Millisecond):
			}
			i := rng.IntN(len(h.servers))
			lives[i].Add(1)
			h.servers[i].Kill()
			select {
			case <-stop:
			case <-time.After(time.Second):
			}
			h.servers[i].Restart(h.hc)
			lives[i].Add(1)
		}
	})

	var wg sync.WaitGroup
	ns := make([]*chaosNode, nodes)
	for i := range ns {
		ns[i] = &chaosNode{c: c, name: fmt.Sprintf("n%d", i), srv: i % len(h.servers), rng: rand.New(rand.NewPCG(seed, uint64(i)))}
	}
	deadline := time.Now().Add(runFor)
	for _, n := range ns {
		wg.Go(func() { n.loop(deadline, keys) })
	}
	wg.Wait()
	close(stop)
	killer.Wait()
	for _, n := range ns {
		n.closeStream()
	}
	var ops, moves, gaps int
	var slowest time.Duration
	for _, n := range ns {
		ops += n.ops
		moves += n.moves
		gaps += n.gaps
		slowest = max(slowest, n.slowest)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	t.Logf("seed %d: %d requests, %d moves to another server (%d with events missed), %d grants, slowest request %v", seed, ops, moves, gaps, len(c.grants), slowest.Round(time.Millisecond))
	for _, f := range c.faults {
		t.Error(f)
	}
}

// chaos is one run's shared record.
type chaos struct {
	t     *testing.T
	h     *haCluster
	lives []atomic.Int64 // each server's lives (chaosRun)

	mu     sync.Mutex
	grants map[string]string // "key/token" → the node it was granted to
	faults []string
}

func (c *chaos) fault(format string, args ...any) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.faults) < 20 {
		c.faults = append(c.faults, fmt.Sprintf(format, args...))
	}
}

// granted records that res's token went to node, by an answer or an event
// (from says which), and reports a token given to two nodes.
func (c *chaos) granted(res string, token uint64, node, from string) {
	k := res + "/" + strconv.FormatUint(token, 10)
	c.mu.Lock()
	prev, ok := c.grants[k]
	if !ok {
		c.grants[k] = node
	}
	c.mu.Unlock()
	if ok && prev != node {
		c.fault("%s token %d granted to %s and (%s) to %s: a double grant", res, token, prev, from, node)
	}
}

// chaosNode is one node: its stream and its requests on server srv.
type chaosNode struct {
	c       *chaos
	name    string
	rng     *rand.Rand
	ops     int
	moves   int
	gaps    int
	slowest time.Duration // the longest request

	mu       sync.Mutex
	srv      int
	stream   *rawhttp.Stream
	broken   bool   // the stream ended
	lastID   string // the last event id received, for Last-Event-ID
	lastNum  uint64
	assigned map[string]bool // "key/token" of every lock_assigned received
	waiting  map[string]chan api.Event
}

// loop runs the node's requests until deadline.
func (n *chaosNode) loop(deadline time.Time, keys int) {
	n.assigned = map[string]bool{}
	n.waiting = map[string]chan api.Event{}
	for !n.subscribe() {
		if time.Now().After(deadline) {
			return
		}
	}
	for time.Now().Before(deadline) {
		n.mu.Lock()
		broken := n.broken
		n.mu.Unlock()
		if broken {
			n.move(deadline)
			continue
		}
		res := fmt.Sprint("sha256:k", n.rng.IntN(keys))
		ch := make(chan api.Event, 16)
		n.mu.Lock()
		n.waiting[res] = ch
		n.mu.Unlock()
		var lr api.LockResponse
		if !n.post("/lock", api.LockRequest{Type: "pull", ResourceID: res, NodeID: n.name}, &lr) {
			n.stopWaiting(res)
			n.move(deadline)
			continue
		}
		token := lr.Token
		if lr.Acquired {
			n.c.granted(res, token, n.name, "answer")
		}
		if lr.Queued {
			token = n.await(res, ch, 300*time.Millisecond)
		}
		n.stopWaiting(res)
		if token == 0 {
			if lr.Queued {
				n.post("/cancel", api.KeyRequest{Type: "pull", ResourceID: res, NodeID: n.name}, nil)
			}
			continue
		}
		switch n.rng.IntN(4) {
		case 0:
			n.post("/cancel", api.KeyRequest{Type: "pull", ResourceID: res, NodeID: n.name}, nil)
		default:
			ok := n.rng.IntN(2) == 0
			errText := ""
			if !ok {
				errText = "chaos"
			}
			n.post("/unlock", api.UnlockRequest{Type: "pull", ResourceID: res, NodeID: n.name, Success: &ok, Error: errText, Token: token}, nil)
		}
	}
}

// await waits for the node's queued wait on res to end: the token of its
// lock_assigned, or 0 when it was told to skip or the wait timed out.
func (n *chaosNode) await(res string, ch chan api.Event, d time.Duration) uint64 {
	tm := time.NewTimer(d)
	defer tm.Stop()
	for {
		select {
		case e := <-ch:
			switch {
			case e.Event == "lock_assigned" && e.NodeID == n.name:
				return e.Token
			case e.Event == "operation_completed":
				return 0
			}
		case <-tm.C:
			return 0
		}
	}
}

func (n *chaosNode) stopWaiting(res string) {
	n.mu.Lock()
	delete(n.waiting, res)
	n.mu.Unlock()
}

// post sends one request to the node's server and decodes a 200 answer into
// out. It returns false when the server is gone (refused, or the request
// failed while the server was being killed): the node must move. A
// request that fails on a server that lived through it is a fault.
func (n *chaosNode) post(path string, body, out any) bool {
	n.ops++
	n.mu.Lock()
	srv := n.srv
	n.mu.Unlock()
	life := &n.c.lives[srv]
	before := life.Load()
	// Longer than any bound of the etcd backend's own (lock/etcd: 10 s a
	// call): a live server answers within it, 503 at worst.
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	sent := time.Now()
	code, data, err := n.c.h.post(ctx, n.c.h.servers[srv].URL(), path, body)
	after := life.Load()
	n.slowest = max(n.slowest, time.Since(sent))
	if err != nil {
		if before == after && before%2 == 0 && !errors.Is(err, syscall.ECONNREFUSED) {
			n.c.fault("%s %s on %s (up throughout, life %d): no answer after %v: %v", n.name, path, n.c.h.servers[srv].name, before, time.Since(sent).Round(time.Millisecond), err)
		}
		return false
	}
	if code >= 500 {
		return true // etcd or the server busy: the loop goes on
	}
	if code == http.StatusOK && out != nil {
		if err := json.Unmarshal(data, out); err != nil {
			n.c.fault("%s %s: %d %s: %v", n.name, path, code, data, err)
		}
	}
	return true
}

// move takes the node to the next server and reopens its stream there.
func (n *chaosNode) move(deadline time.Time) {
	n.moves++
	n.closeStream()
	for time.Now().Before(deadline) {
		n.mu.Lock()
		n.srv = (n.srv + 1) % len(n.c.h.servers)
		n.mu.Unlock()
		if n.subscribe() {
			return
		}
	}
}

func (n *chaosNode) closeStream() {
	n.mu.Lock()
	s := n.stream
	n.stream = nil
	n.mu.Unlock()
	if s != nil {
		s.Close()
	}
}

// subscribe opens the node's stream on its server, resuming after the
// last event it received.
func (n *chaosNode) subscribe() bool {
	n.mu.Lock()
	base, last := n.c.h.servers[n.srv].URL(), n.lastID
	n.mu.Unlock()
	var d rawhttp.Dialer
	var s *rawhttp.Stream
	var err error
	if last == "" {
		s, err = d.Subscribe(base, n.name)
	} else {
		s, err = d.Resume(base, n.name, last)
	}
	if err != nil {
		return false
	}
	n.mu.Lock()
	n.stream, n.broken = s, false
	// A subscribed id above the last event received says events were
	// missed (docs/DESIGN.md, "Event ids and replay"): the session ended
	// while the node moved; the stream goes on from there.
	if id, _ := strconv.ParseUint(s.ID(), 10, 64); id > n.lastNum {
		if n.lastID != "" {
			n.gaps++
		}
		n.lastNum, n.lastID = id, s.ID()
	}
	n.mu.Unlock()
	go n.read(s)
	return true
}

// read follows one stream until it ends.
func (n *chaosNode) read(s *rawhttp.Stream) {
	defer func() {
		n.mu.Lock()
		if n.stream == s {
			n.broken = true
		}
		n.mu.Unlock()
	}()
	for {
		name, data, err := s.Next()
		if err != nil {
			return
		}
		if name == "ping" || name == "" {
			continue
		}
		id, _ := strconv.ParseUint(s.ID(), 10, 64)
		var e api.Event
		if json.Unmarshal(data, &e) != nil {
			n.c.fault("%s: event %q: %s", n.name, name, data)
			continue
		}
		n.mu.Lock()
		if id <= n.lastNum {
			n.c.fault("%s: event id %d after %d (%s %s)", n.name, id, n.lastNum, name, data)
		}
		n.lastNum, n.lastID = id, s.ID()
		dup := false
		if e.Event == "lock_assigned" {
			k := e.ResourceID + "/" + strconv.FormatUint(e.Token, 10)
			dup = n.assigned[k]
			n.assigned[k] = true
		}
		ch := n.waiting[e.ResourceID]
		n.mu.Unlock()
		if dup {
			n.c.fault("%s: lock_assigned of %s token %d twice (id %d)", n.name, e.ResourceID, e.Token, id)
		}
		if e.Event == "lock_assigned" {
			n.c.granted(e.ResourceID, e.Token, e.NodeID, "event")
		}
		if ch != nil {
			select {
			case ch <- e:
			default:
			}
		}
	}
}

// TestHAEtcdGoneAnswered: a dlock server whose etcd loses its quorum still
// answers every request, 503 unavailable once its bound on etcd runs out
// (lock/etcd: 10 s), on the lean loop (POST /lock) and on net/http
// (GET /status): it never closes the connection without an answer, though
// the wait is longer than its write timeout (docs/DESIGN.md, "When a
// server closes a connection").
//
// Its /readyz turns 503 unavailable meanwhile, and 200 again once etcd is
// back, while /healthz (the process lives) answers 200 throughout.
func TestHAEtcdGoneAnswered(t *testing.T) {
	h := startHA(t, 1)
	h.hc.Timeout = time.Minute
	probe := func(path string) (int, string) {
		resp, err := h.hc.Get(h.servers[0].URL() + path)
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	if code, body := probe("/readyz"); code != http.StatusOK {
		t.Fatalf("/readyz with etcd up: %d %s", code, body)
	}
	// Two of three members gone: the third answers nothing that needs
	// a quorum.
	for i := range 2 {
		h.etcd.Kill(i)
	}
	defer func() {
		for i := range 2 {
			h.etcd.Restart(i)
		}
		kit.WaitFor(t, "/readyz to answer 200 with etcd back", func() bool {
			code, _ := probe("/readyz")
			return code == http.StatusOK
		})
	}()
	kit.WaitFor(t, "/readyz to answer 503 with etcd gone", func() bool {
		code, body := probe("/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(body, `"code":"unavailable"`)
	})
	if code, body := probe("/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz with etcd gone: %d %s; the process lives", code, body)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	wg.Go(func() {
		code, body, err := h.post(ctx, h.servers[0].URL(), "/lock", api.LockRequest{Type: "pull", ResourceID: "sha256:gone", NodeID: "n1"})
		if err != nil || code != http.StatusServiceUnavailable || !strings.Contains(string(body), `"code":"unavailable"`) {
			t.Errorf("/lock with etcd gone: %d %s %v; want 503 unavailable", code, body, err)
		}
	})
	wg.Go(func() {
		_, err := h.status(ctx, h.servers[0].URL(), "pull", "sha256:gone")
		if err == nil || !strings.Contains(err.Error(), "503") {
			t.Errorf("/status with etcd gone: %v; want 503", err)
		}
	})
	wg.Wait()
}
