package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/dlock/dlock/api"
)

// The model of one key for porcupine, after lock/locktest/linearizability.go,
// with what a test over the network adds: a request whose answer never came
// (the server was killed, etcd did not answer in time: a network error or a
// 5xx) may or may not have been applied, so its outcome is unknown, and a
// grant whose answer was lost has a token nobody saw. token is then a strict
// lower bound of the holder's token, learnt at the next answer that names it.
type hState struct {
	holder    int8 // -1: free
	token     uint64
	tokKnown  bool
	recNode   int8
	recToken  uint64
	recKnown  bool
	recOK     bool
	recUnlock bool
}

type hIn struct {
	key     int
	unlock  bool
	node    int8
	token   uint64
	success bool
}

type hOut struct {
	unknown  bool
	code     string // "" for 200, else the error code
	acquired bool
	token    uint64
	holder   int8
	replayed bool
}

func hStep(s hState, in hIn, out hOut) []hState {
	var next []hState
	if !in.unlock {
		switch {
		case s.holder == -1:
			if out.unknown {
				g := s
				g.holder, g.tokKnown = in.node, false // token stays the bound
				next = append(next, s, g)
			} else if out.code == "" && out.acquired && out.token > s.token {
				s.holder, s.token, s.tokKnown = in.node, out.token, true
				next = append(next, s)
			}
		case s.holder == in.node:
			switch {
			case out.unknown:
				next = append(next, s)
			case out.code == "" && out.acquired && s.tokKnown && out.token == s.token:
				next = append(next, s)
			case out.code == "" && out.acquired && !s.tokKnown && out.token > s.token:
				s.token, s.tokKnown = out.token, true
				next = append(next, s)
			}
		default:
			if out.unknown || (out.code == "lock_held" && out.holder == s.holder) {
				next = append(next, s)
			}
		}
		return next
	}
	release := func(s hState, token uint64, known bool) hState {
		s.holder, s.recNode, s.recToken, s.recKnown, s.recOK, s.recUnlock = -1, in.node, token, known, in.success, true
		return s
	}
	switch {
	case s.holder == in.node:
		// A stale token is refused; the right one, or none, releases.
		stale := in.token != 0 && (!s.tokKnown || in.token != s.token)
		right := in.token == 0 || !s.tokKnown || in.token == s.token
		if out.unknown || (stale && out.code == "stale_token") {
			next = append(next, s)
		}
		if right && (out.unknown || (out.code == "" && !out.replayed)) {
			if in.token != 0 && !s.tokKnown {
				next = append(next, release(s, in.token, true))
			} else {
				next = append(next, release(s, s.token, s.tokKnown))
			}
		}
	case s.recUnlock && s.recNode == in.node && s.recOK == in.success && (in.token == 0 || !s.recKnown || in.token == s.recToken):
		if out.unknown || (out.code == "" && out.replayed) {
			next = append(next, s)
		}
	default:
		if out.unknown || out.code == "not_holder" {
			next = append(next, s)
		}
	}
	return next
}

var haModel = porcupine.NondeterministicModel{
	Partition: func(h []porcupine.Operation) [][]porcupine.Operation {
		by := map[int][]porcupine.Operation{}
		for _, op := range h {
			k := op.Input.(hIn).key
			by[k] = append(by[k], op)
		}
		var out [][]porcupine.Operation
		for _, ops := range by {
			out = append(out, ops)
		}
		return out
	},
	Init: func() []any { return []any{hState{holder: -1, recNode: -1}} },
	Step: func(state, input, output any) []any {
		var out []any
		for _, s := range hStep(state.(hState), input.(hIn), output.(hOut)) {
			out = append(out, s)
		}
		return out
	},
	Equal: func(a, b any) bool { return a.(hState) == b.(hState) },
	DescribeOperation: func(input, output any) string {
		return fmt.Sprintf("%+v -> %+v", input, output)
	},
}

// TestHALinearizable: six nodes lock and unlock (with the right token, a
// stale one, none, and again after the unlock: a replay) two keys through
// three dlock servers, each request to a server picked at random, while a
// dlock server is SIGKILLed and restarted every second or so and an etcd
// member once; the history, in which a request without an answer has an
// unknown outcome, is linearizable for the model of one key
// (docs/DESIGN.md, "TryLock", "Unlock"; one holder at a time, tokens
// increasing). Queues are off (--allow-multi-node-download=false) so that
// a lock is answered at once.
func TestHALinearizable(t *testing.T) {
	const nodes, keys, maxOps = 6, 2, 250
	const runFor = 15 * time.Second
	h := startHA(t, 3, "--allow-multi-node-download=false")
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	start := time.Now()
	var mu sync.Mutex
	var history []porcupine.Operation
	unknown := 0
	record := func(client int, in hIn, call int64, out hOut) {
		ret := time.Since(start).Nanoseconds()
		mu.Lock()
		defer mu.Unlock()
		if out.unknown {
			ret = 1 << 62 // may take effect at any time after its call
			unknown++
		}
		history = append(history, porcupine.Operation{ClientId: client, Input: in, Call: call, Output: out, Return: ret})
	}
	// do sends one request; refused connections (a dead server) are not
	// recorded: nothing was sent.
	do := func(rng *rand.Rand, path string, body any) (hOut, []byte, bool) {
		base := h.servers[rng.IntN(len(h.servers))].URL()
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		code, data, err := h.post(ctx, base, path, body)
		switch {
		case errors.Is(err, syscall.ECONNREFUSED):
			return hOut{}, nil, false
		case err != nil || code >= 500:
			return hOut{unknown: true}, nil, true
		case code != 200:
			var eb api.ErrorBody
			json.Unmarshal(data, &eb)
			return hOut{code: eb.Code, holder: -1}, data, true
		}
		return hOut{holder: -1}, data, true
	}
	stop := make(chan struct{})
	var chaos sync.WaitGroup
	chaos.Go(func() {
		rng := rand.New(rand.NewPCG(seed, 99))
		for round := 0; ; round++ {
			select {
			case <-stop:
				return
			case <-time.After(time.Duration(500+rng.IntN(1000)) * time.Millisecond):
			}
			if round == 3 {
				m := rng.IntN(3)
				h.etcd.Kill(m)
				h.etcd.Restart(m)
				continue
			}
			h.servers[rng.IntN(len(h.servers))].Restart(h.hc)
		}
	})
	var wg sync.WaitGroup
	for n := range nodes {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(seed, uint64(n)))
			node := fmt.Sprint("n", n)
			tokens := map[int]uint64{}
			for range maxOps {
				if time.Since(start) > runFor {
					return
				}
				k := rng.IntN(keys)
				res := fmt.Sprint("r", k)
				call := time.Since(start).Nanoseconds()
				if rng.IntN(2) == 0 {
					out, data, sent := do(rng, "/lock", api.LockRequest{Type: "pull", ResourceID: res, NodeID: node, Lease: "ttl"})
					if !sent {
						continue
					}
					if data != nil && out.code == "" {
						var lr api.LockResponse
						json.Unmarshal(data, &lr)
						out.acquired, out.token = lr.Acquired, lr.Token
						if lr.Acquired {
							tokens[k] = lr.Token
						}
					} else if out.code == "lock_held" {
						var held struct{ Holder string }
						json.Unmarshal(data, &held)
						fmt.Sscanf(held.Holder, "n%d", &out.holder)
					}
					record(n, hIn{key: k, node: int8(n)}, call, out)
					continue
				}
				tok := tokens[k]
				switch rng.IntN(4) {
				case 0:
					tok = 0
				case 1:
					if tok > 0 {
						tok-- // stale
					}
				}
				success := rng.IntN(2) == 0
				out, data, sent := do(rng, "/unlock", api.UnlockRequest{Type: "pull", ResourceID: res, NodeID: node, Success: &success, Token: tok})
				if !sent {
					continue
				}
				if data != nil && out.code == "" {
					var ur api.UnlockResponse
					json.Unmarshal(data, &ur)
					out.replayed = ur.Replayed
				}
				record(n, hIn{key: k, unlock: true, node: int8(n), token: tok, success: success}, call, out)
			}
		})
	}
	wg.Wait()
	close(stop)
	chaos.Wait()
	t.Logf("%d operations, %d of unknown outcome", len(history), unknown)
	res, info := porcupine.CheckOperationsVerbose(haModel.ToModel(), history, 60*time.Second)
	if res != porcupine.Ok {
		path := "(none)"
		if f, err := os.CreateTemp("", "ha-history-*.html"); err == nil {
			path = f.Name()
			_ = porcupine.Visualize(haModel.ToModel(), info, f)
			_ = f.Close()
		}
		t.Fatalf("history of %d operations is %s (seed %d; visualization: %s)", len(history), res, seed, path)
	}
}
