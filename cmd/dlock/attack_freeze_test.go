package main

import (
	"context"
	"testing"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/netfault"
	"github.com/dlock/dlock/lock"
)

// TestAttackFreezeServerMidHold: a holder's client holds a session lock
// through server 0 of three `dlock serve --backend etcd` on a 3-member
// etcd, while a second client waits through server 1. Server 0 is frozen
// (SIGSTOP: it neither keeps its sessions alive nor answers, and its
// sockets stay open). With a 2 s session grace the holder's session runs
// out before its stream, silent for 2×ping+1 s = 3 s, moves to another
// server, so the key is handed on. The holder's Lost must close before
// the waiter is granted, by at least half the margin the grant announced
// (dlock run's SIGKILL comes then): the gap is logged. The waiter's grant
// is observed when its Lock returns, after the server granted it, so a
// gap this test reports too small is certainly too small.
func TestAttackFreezeServerMidHold(t *testing.T) {
	h := startHA(t, 3, "--session-grace", "2s")
	urls := h.URLs()
	key := client.Request{Type: lock.Pull, Resource: "sha256:frozen"}
	a := &client.Client{Servers: urls, Node: "holder"}
	b := &client.Client{Servers: append(urls[1:], urls[0]), Node: "waiter"}
	defer a.Close()
	defer b.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*kit.Patience)
	defer cancel()

	ra, err := a.Lock(ctx, key)
	if err != nil || !ra.Acquired {
		t.Fatalf("holder: %+v %v", ra, err)
	}
	lost := lostAt(ra.Lost)
	t.Logf("holder granted token %d, margin %v", ra.Token, ra.Margin)
	granted := lockLater(ctx, b, key)
	awaitQueued(t, "holder", func() (api.StatusResponse, error) { return h.status(ctx, urls[1], "pull", key.Resource) })

	h.servers[0].mu.Lock()
	pid := h.servers[0].cmd.Process.Pid
	h.servers[0].mu.Unlock()
	netfault.Freeze(t, pid)
	frozen := time.Now()

	var g grant
	select {
	case g = <-granted:
	case <-time.After(kit.Patience):
		t.Fatal("the waiter was never granted the key after the holder's server froze")
	}
	if g.err != nil || !g.r.Acquired {
		t.Fatalf("waiter: %+v %v", g.r, g.err)
	}
	stoppedFirst(t, "freeze", frozen, g, lost, ra.Margin)
	if g.r.Token <= ra.Token {
		t.Errorf("the waiter's token %d is not above the holder's %d", g.r.Token, ra.Token)
	}
	// The liveness bound: grace + ping + dead-peer, + small; a frozen
	// server is noticed by its silence (the client moves) and the lease.
	if d := g.at.Sub(frozen); d > 2*time.Second+time.Second+3*time.Second+2*time.Second {
		t.Errorf("the key moved on %v after the freeze; want within grace+ping+dead-peer (6 s) and a little", d)
	}

	// The frozen server wakes: it must not give the key back to the
	// holder, and the holder's unlock (its token) must be refused.
	if err := netfault.Thaw(pid); err != nil {
		t.Fatal(err)
	}
	uctx, ucancel := context.WithTimeout(ctx, 10*time.Second)
	defer ucancel()
	if err := a.Unlock(uctx, key, nil); err == nil {
		t.Errorf("the holder's unlock after its hold was handed on succeeded")
	}
	for _, u := range urls {
		st, err := h.status(ctx, u, "pull", key.Resource)
		if err != nil {
			t.Fatalf("%s: %v", u, err)
		}
		if st.Holder != "waiter" || st.Token != g.r.Token {
			t.Errorf("%s after the thaw: %+v, want the waiter's hold, token %d", u, st, g.r.Token)
		}
	}
	b.Unlock(ctx, key, nil)
}
