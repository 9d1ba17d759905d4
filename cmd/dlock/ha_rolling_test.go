package main

import (
	"context"
	"fmt"
	"testing"
)

// TestHARollingRestart is the upgrade of docs/HA.md: the
// three servers of one data set stopped (SIGTERM) and started again one at
// a time, while nodes hold keys and wait in a queue. Each node whose server
// stops reopens its stream on the next server with Last-Event-ID, within
// the grace. Afterwards: every session is the same etcd lease, every
// stream resumed with nothing missed, every hold is where it was with its
// token, and the queue hands the key on to every waiter in its order: no
// hold lost, no waiter lost.
func TestHARollingRestart(t *testing.T) {
	h := startHA(t, 3, "--session-grace", "10s")
	const holders = 6
	var nodes []*haNode
	tokens := map[string]uint64{}
	for i := range holders {
		n := &haNode{h: h, name: fmt.Sprintf("h%d", i)}
		n.subscribe(t, i%3)
		res := fmt.Sprintf("roll-%d", i)
		lr := n.lock(t, res)
		if !lr.Acquired {
			t.Fatalf("%s /lock %s: %+v", n.name, res, lr)
		}
		tokens[res] = lr.Token
		nodes = append(nodes, n)
	}
	// One key with a holder and four waiters, each on its own server.
	var queue []*haNode
	for i := range 5 {
		n := &haNode{h: h, name: fmt.Sprintf("q%d", i)}
		n.subscribe(t, i%3)
		lr := n.lock(t, "roll-q")
		if i == 0 && !lr.Acquired || i > 0 && (!lr.Queued || lr.Position != i) {
			t.Fatalf("%s /lock roll-q: %+v", n.name, lr)
		}
		if i == 0 {
			tokens["roll-q"] = lr.Token
		}
		queue = append(queue, n)
		nodes = append(nodes, n)
	}
	leases := map[string]int64{}
	for _, n := range nodes {
		if leases[n.name] = h.sessionLease(t, n.name); leases[n.name] == 0 {
			t.Fatalf("%s has no session", n.name)
		}
	}

	for s := range h.servers {
		h.servers[s].Stop()
		next := (s + 1) % len(h.servers)
		for _, n := range nodes {
			n.mu.Lock()
			on, last := n.srv, n.lastID
			n.mu.Unlock()
			if on != s {
				continue
			}
			if id := n.subscribe(t, next); id != last {
				t.Fatalf("%s resumed after %s on %s, told %s: events missed in the restart of %s", n.name, last, h.servers[next].name, id, h.servers[s].name)
			}
		}
		h.servers[s].Start(h.hc)
	}

	for _, n := range nodes {
		if l := h.sessionLease(t, n.name); l != leases[n.name] {
			t.Fatalf("%s's session lease is %d, was %d: the session did not outlive the restarts", n.name, l, leases[n.name])
		}
	}
	ctx := context.Background()
	for res, tok := range tokens {
		want := "h" + res[len("roll-"):]
		if res == "roll-q" {
			want = "q0"
		}
		for _, u := range h.URLs() {
			st, err := h.status(ctx, u, "pull", res)
			if err != nil {
				t.Fatal(err)
			}
			if st.State != "held" || st.Holder != want || st.Token != tok {
				t.Fatalf("%s on %s after the restarts: %+v; want held by %s with token %d", res, u, st, want, tok)
			}
			if res == "roll-q" && st.QueueLength != 4 {
				t.Fatalf("roll-q's queue after the restarts: %d waiters, want 4", st.QueueLength)
			}
		}
	}
	// The queue hands on in its order.
	tok := tokens["roll-q"]
	for i, n := range queue {
		if i > 0 {
			tok = n.assigned(t, "roll-q", tok)
		}
		ur := n.unlock(t, "roll-q", tok)
		if i+1 < len(queue) && ur.NextHolder != queue[i+1].name {
			t.Fatalf("%s's unlock handed roll-q to %q, want %s", n.name, ur.NextHolder, queue[i+1].name)
		}
	}
}
