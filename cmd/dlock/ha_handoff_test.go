package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/rawhttp"
)

// haNode is a node whose session stream the test holds on one server of
// its choice and moves by hand, with Last-Event-ID, when that server dies.
type haNode struct {
	h    *haCluster
	name string
	srv  int // the server its stream and requests go to

	mu     sync.Mutex
	events []api.Event
	lastID string
	body   interface{ Close() error }
}

// subscribe opens the node's stream on server srv, resuming after the last
// event received, and returns the subscribed event's id.
func (n *haNode) subscribe(t *testing.T, srv int) string {
	t.Helper()
	n.mu.Lock()
	last := n.lastID
	if n.body != nil {
		n.body.Close()
	}
	n.mu.Unlock()
	req, err := http.NewRequest(http.MethodGet, n.h.servers[srv].URL()+"/subscribe?node_id="+n.name, nil)
	if err != nil {
		t.Fatal(err)
	}
	if last != "" {
		req.Header.Set("Last-Event-ID", last)
	}
	resp, err := n.h.streams.Do(req)
	if err != nil {
		t.Fatalf("%s: subscribe on %s: %v", n.name, n.h.servers[srv].name, err)
	}
	if resp.StatusCode != http.StatusOK {
		resp.Body.Close()
		t.Fatalf("%s: subscribe on %s: %d", n.name, n.h.servers[srv].name, resp.StatusCode)
	}
	t.Cleanup(func() { resp.Body.Close() })
	r := bufio.NewReaderSize(resp.Body, 64<<10)
	var ev rawhttp.Event
	if err := rawhttp.ReadEvent(r, &ev); err != nil || ev.Name != "subscribed" {
		resp.Body.Close()
		t.Fatalf("%s: the first event on %s: %q, %v", n.name, n.h.servers[srv].name, ev.Name, err)
	}
	n.mu.Lock()
	n.srv, n.body = srv, resp.Body
	if n.lastID == "" {
		n.lastID = ev.ID // resume from here, if nothing comes before
	}
	n.mu.Unlock()
	go func() {
		var ev rawhttp.Event
		for rawhttp.ReadEvent(r, &ev) == nil {
			var e api.Event
			if json.Unmarshal(ev.Data, &e) != nil {
				continue
			}
			n.mu.Lock()
			n.events = append(n.events, e)
			n.lastID = ev.ID
			n.mu.Unlock()
		}
	}()
	return ev.ID
}

// assigned waits for a lock_assigned of res to this node with a token above
// after (an earlier grant's event may be in the log) and returns its token.
func (n *haNode) assigned(t *testing.T, res string, after uint64) uint64 {
	t.Helper()
	var tok uint64
	kit.WaitFor(t, n.name+" to be assigned "+res, func() bool {
		n.mu.Lock()
		defer n.mu.Unlock()
		for _, e := range n.events {
			if e.Event == "lock_assigned" && e.ResourceID == res && e.NodeID == n.name && e.Token > max(tok, after) {
				tok = e.Token
			}
		}
		return tok != 0
	})
	return tok
}

func (n *haNode) url() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.h.servers[n.srv].URL()
}

// lock sends /lock through the node's server, retrying answers that say
// the server or etcd is busy (5xx, network errors: /lock is idempotent).
func (n *haNode) lock(t *testing.T, res string) api.LockResponse {
	t.Helper()
	var lr api.LockResponse
	kit.Await(t, n.name+" /lock "+res, func() error {
		code, body, err := n.h.post(context.Background(), n.url(), "/lock", api.LockRequest{Type: "pull", ResourceID: res, NodeID: n.name})
		if err != nil || code >= 500 {
			return fmt.Errorf("%d %s %v", code, body, err)
		}
		if code != http.StatusOK {
			t.Fatalf("%s /lock %s: %d %s", n.name, res, code, body)
		}
		return json.Unmarshal(body, &lr)
	})
	return lr
}

// unlock sends /unlock as a failure through the node's server, retrying as
// lock does (an unlock whose answer was lost is replayed, docs/DESIGN.md
// "Unlock" step 1).
func (n *haNode) unlock(t *testing.T, res string, token uint64) api.UnlockResponse {
	t.Helper()
	var ur api.UnlockResponse
	ok := false
	kit.Await(t, n.name+" /unlock "+res, func() error {
		code, body, err := n.h.post(context.Background(), n.url(), "/unlock", api.UnlockRequest{Type: "pull", ResourceID: res, NodeID: n.name, Success: &ok, Error: "handed on", Token: token})
		if err != nil || code >= 500 {
			return fmt.Errorf("%d %s %v", code, body, err)
		}
		if code != http.StatusOK {
			t.Fatalf("%s /unlock %s: %d %s", n.name, res, code, body)
		}
		return json.Unmarshal(body, &ur)
	})
	return ur
}

// TestHAKillMidHandoff: a holder on one dlock server hands the key on with
// an /unlock (a failure: the first waiter gets it) and its server is
// SIGKILLed right after the request is sent, so that the hand-off may or
// may not have happened; the waiters' streams are on the other servers.
// Three rounds, each killing the current holder's server. Each time: the
// nodes whose server died reopen their streams on the next server with
// Last-Event-ID within the grace and find their session whole (the
// same etcd lease; the subscribed id is the one they gave, nothing
// missed, on a server that was up throughout), the holder's
// repeated /unlock is applied or replayed with the same next holder, the
// first waiter is assigned the key with a higher token, the other waiter
// keeps its place, a hold that the holder keeps on another key survives,
// and /status, polled on every server throughout, never shows two holders
// of one token or a token going backwards (docs/DESIGN.md, "An etcd
// backend", "Fencing tokens").
func TestHAKillMidHandoff(t *testing.T) {
	const grace = 2 * time.Second
	h := startHA(t, 3, "--session-grace", grace.String())
	const key, kept = "sha256:handoff", "sha256:kept"
	nodes := make([]*haNode, 3)
	for i := range nodes {
		nodes[i] = &haNode{h: h, name: fmt.Sprintf("n%d", i)}
		nodes[i].subscribe(t, i)
	}
	watch := newTokenWatch()
	ctx, stop := context.WithCancel(context.Background())
	var polling sync.WaitGroup
	polling.Go(func() { h.pollTokens(ctx, "pull", key, watch) })
	defer func() { stop(); polling.Wait(); watch.check(t) }()

	if lr := nodes[0].lock(t, kept); !lr.Acquired {
		t.Fatalf("n0 /lock %s: %+v", kept, lr)
	}
	keptToken := nodes[0].lock(t, kept).Token
	lr := nodes[0].lock(t, key)
	if !lr.Acquired {
		t.Fatalf("n0 /lock: %+v", lr)
	}
	token := lr.Token
	for i, n := range nodes[1:] {
		if lr := n.lock(t, key); !lr.Queued || lr.Position != i+1 {
			t.Fatalf("%s /lock: %+v, want queued at %d", n.name, lr, i+1)
		}
	}
	queue := []*haNode{nodes[1], nodes[2]}
	holder := nodes[0]
	var lastKill time.Time
	// A stream resumes on any server, one restarted since too
	// (TestHAResumeOnRestartedServer); the session is checked by its etcd
	// lease as well.
	leases := map[string]int64{}
	for _, n := range nodes {
		leases[n.name] = h.sessionLease(t, n.name)
	}
	for round := range 3 {
		a := holder.srv
		victim := h.servers[a]
		// The hand-off request, then SIGKILL as soon as it is sent.
		conn, err := net.Dial("tcp", victim.addr)
		if err != nil {
			t.Fatal(err)
		}
		body := fmt.Sprintf(`{"type":"pull","resource_id":%q,"node_id":%q,"success":false,"error":"handed on","token":%d}`, key, holder.name, token)
		fmt.Fprintf(conn, "POST /unlock HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", victim.addr, len(body), body)
		victim.Kill()
		conn.Close()
		lastKill = time.Now()
		// Every stream that was there moves to the next server, within
		// the grace, and its session goes on.
		for _, n := range nodes {
			if n.srv != a {
				continue
			}
			n.mu.Lock()
			last := n.lastID
			n.mu.Unlock()
			to := (a + 1) % len(h.servers)
			if id := n.subscribe(t, to); id != last {
				t.Errorf("round %d: %s reopened its stream after %s and was told %s: a gap", round, n.name, last, id)
			}
		}
		next, rest := queue[0], queue[1:]
		if ur := holder.unlock(t, key, token); ur.NextHolder != next.name {
			t.Fatalf("round %d: %s's unlock after the kill: %+v, want next holder %s", round, holder.name, ur, next.name)
		}
		got := next.assigned(t, key, token)
		if got <= token {
			t.Fatalf("round %d: %s assigned token %d after %d", round, next.name, got, token)
		}
		if lr := next.lock(t, key); !lr.Acquired || lr.Token != got {
			t.Fatalf("round %d: %s confirms: %+v, want token %d", round, next.name, lr, got)
		}
		victim.Restart(h.hc)
		for i, n := range rest {
			if lr := n.lock(t, key); !lr.Queued || lr.Position != i+1 {
				t.Fatalf("round %d: %s lost its place: %+v", round, n.name, lr)
			}
		}
		if lr := holder.lock(t, key); !lr.Queued || lr.Position != len(rest)+1 {
			t.Fatalf("round %d: %s queues again: %+v", round, holder.name, lr)
		}
		queue = append(rest, holder)
		holder, token = next, got
	}
	// The kept hold outlives the grace since the last kill: n0's session
	// went on wherever its stream was.
	kit.WaitFor(t, "two graces since the last kill", func() bool { return time.Since(lastKill) > 2*grace })
	for _, n := range nodes {
		if l := h.sessionLease(t, n.name); l != leases[n.name] {
			t.Errorf("%s's session has lease %x, it had %x: the session ended", n.name, l, leases[n.name])
		}
	}
	for _, s := range h.servers {
		st, err := h.status(context.Background(), s.URL(), "pull", kept)
		if err != nil {
			t.Fatal(err)
		}
		if st.State != "held" || st.Holder != "n0" || st.Token != keptToken {
			t.Errorf("%s: %s is %s by %q with token %d; want held by n0 with %d", s.name, kept, st.State, st.Holder, st.Token, keptToken)
		}
		if st, err = h.status(context.Background(), s.URL(), "pull", key); err != nil || st.Holder != holder.name || st.Token != token || st.QueueLength != 2 {
			t.Errorf("%s: %s: %+v %v; want held by %s with %d and 2 waiting", s.name, key, st, err, holder.name, token)
		}
	}
}

// TestHAResumeOnRestartedServer: a session stream resumed with
// Last-Event-ID on a server that was restarted after that event is not
// told of a gap: a starting server reads its replay logs from etcd's
// history (lock/etcd/watch.go, the warm-up).
func TestHAResumeOnRestartedServer(t *testing.T) {
	h := startHA(t, 2, "--session-grace", "5s")
	n := &haNode{h: h, name: "n0"}
	n.subscribe(t, 0)
	if lr := n.lock(t, "r"); !lr.Acquired {
		t.Fatalf("/lock: %+v", lr)
	}
	n.assigned(t, "r", 0)
	n.mu.Lock()
	last := n.lastID
	n.mu.Unlock()
	h.servers[1].Restart(h.hc)
	if id := n.subscribe(t, 1); id != last {
		t.Fatalf("resumed after %s on a restarted server, told %s: a gap reported where none is", last, id)
	}
}
