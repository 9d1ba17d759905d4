package main

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/internal/dlocktest/kit"
)

// TestHATokensForward: a key's tokens strictly increase across a dlock
// server's SIGKILL and restart, an etcd leader's kill and restart, all the
// dlock servers killed and restarted together, and the key's record being
// dropped once its completion is past retention (docs/DESIGN.md, "Fencing
// tokens", "An etcd backend": tokens are above the revision they were read
// at, so a record made again starts above every earlier one).
func TestHATokensForward(t *testing.T) {
	h := startHA(t, 3, "--completed-retention", "300ms")
	const res = "sha256:tokens"
	var last uint64
	grant := func(step string, srv int) {
		t.Helper()
		base := h.servers[srv].URL()
		var lr api.LockResponse
		kit.Await(t, step+": /lock", func() error {
			code, data, err := h.post(context.Background(), base, "/lock", api.LockRequest{Type: "pull", ResourceID: res, NodeID: "n", Lease: "ttl"})
			if err != nil || code != 200 {
				return &httpErr{code, string(data), err}
			}
			return json.Unmarshal(data, &lr)
		})
		if !lr.Acquired || lr.Token <= last {
			t.Fatalf("%s: %+v after token %d: a token went backwards", step, lr, last)
		}
		last = lr.Token
		ok := true
		code, data, err := h.post(context.Background(), base, "/unlock", api.UnlockRequest{Type: "pull", ResourceID: res, NodeID: "n", Success: &ok, Token: last})
		if err != nil || code != 200 {
			t.Fatalf("%s: /unlock: %d %s %v", step, code, data, err)
		}
	}
	grant("first", 0)
	grant("again", 1)
	h.servers[0].Kill()
	h.servers[0].Restart(h.hc)
	grant("after a dlock server's restart", 0)
	leader := h.etcdLeader(t)
	h.etcd.Kill(leader)
	grant("with the etcd leader down", 2)
	h.etcd.Restart(leader)
	grant("after the etcd member's restart", 1)
	for _, s := range h.servers {
		s.Kill()
	}
	for _, s := range h.servers {
		s.Restart(h.hc)
	}
	grant("after every dlock server's restart", 2)
	kit.WaitFor(t, "the key's record to be dropped", func() bool {
		st, err := h.status(context.Background(), h.servers[0].URL(), "pull", res)
		return err == nil && st.Token == 0 && st.LastCompleted == nil
	})
	grant("after the record was dropped", 0)
	h.servers[1].Kill()
	h.servers[1].Restart(h.hc)
	grant("after the drop and a restart", 1)
}

type httpErr struct {
	code int
	body string
	err  error
}

func (e *httpErr) Error() string {
	if e.err != nil {
		return e.err.Error()
	}
	return e.body
}
