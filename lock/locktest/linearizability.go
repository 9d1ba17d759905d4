package locktest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/dlock/dlock/lock"
)

// Linearizability: concurrent histories of one backend, checked with
// porcupine against a model of one key.

var linearizableTests = []test{
	{name: "Histories", run: testLinearizable},
}

// The model of one key, for porcupine: who holds it, the last token granted,
// the last completion (for replayed unlocks), and which nodes' sessions were
// dropped — their hold may vanish at any moment after the drop.
type pState struct {
	holder    int8 // -1: free
	token     uint64
	recNode   int8
	recToken  uint64
	recOK     bool
	recUnlock bool
	doomed    uint16
}

const (
	opLock = iota
	opUnlock
	opDrop
)

type pIn struct {
	key     int
	op      int
	node    int8
	token   uint64
	success bool
}

type pOut struct {
	acquired bool
	token    uint64
	holder   int8
	err      error
	replayed bool
}

func pStep(s pState, in pIn, out pOut) []any {
	cands := []pState{s}
	if s.holder >= 0 && s.doomed&(1<<s.holder) != 0 {
		// The session-loss release may have happened before this operation.
		r := s
		r.holder, r.recNode, r.recToken, r.recOK, r.recUnlock = -1, s.holder, s.token, false, false
		cands = append(cands, r)
	}
	var next []any
	for _, c := range cands {
		switch in.op {
		case opDrop:
			c.doomed |= 1 << in.node
			next = append(next, c)
		case opLock:
			switch {
			case c.holder == -1:
				if out.err == nil && out.acquired && out.token > c.token {
					c.holder, c.token = in.node, out.token
					next = append(next, c)
				}
			case c.holder == in.node:
				if out.err == nil && out.acquired && out.token == c.token {
					next = append(next, c)
				}
			default:
				if errors.Is(out.err, lock.ErrLockHeld) && out.holder == c.holder {
					next = append(next, c)
				}
			}
		case opUnlock:
			switch {
			case c.holder == in.node && in.token != 0 && in.token != c.token:
				if errors.Is(out.err, lock.ErrStaleToken) {
					next = append(next, c)
				}
			case c.holder == in.node:
				if out.err == nil && !out.replayed {
					c.holder, c.recNode, c.recToken, c.recOK, c.recUnlock = -1, in.node, c.token, in.success, true
					next = append(next, c)
				}
			case c.recUnlock && c.recNode == in.node && c.recOK == in.success && (in.token == 0 || in.token == c.recToken):
				if out.err == nil && out.replayed {
					next = append(next, c)
				}
			default:
				if errors.Is(out.err, lock.ErrNotHolder) {
					next = append(next, c)
				}
			}
		}
	}
	return next
}

var lockModel = porcupine.NondeterministicModel{
	Partition: func(h []porcupine.Operation) [][]porcupine.Operation {
		by := map[int][]porcupine.Operation{}
		for _, op := range h {
			k := op.Input.(pIn).key
			by[k] = append(by[k], op)
		}
		var out [][]porcupine.Operation
		for _, ops := range by {
			out = append(out, ops)
		}
		return out
	},
	Init: func() []any { return []any{pState{holder: -1, recNode: -1}} },
	Step: func(state, input, output any) []any {
		return pStep(state.(pState), input.(pIn), output.(pOut))
	},
	Equal: func(a, b any) bool { return a.(pState) == b.(pState) },
	DescribeOperation: func(input, output any) string {
		return fmt.Sprintf("%+v -> %+v", input, output)
	},
}

// testLinearizable records concurrent histories of lock, unlock (right,
// stale and repeated) and dropped sessions on a few keys, and checks them
// against the model with porcupine.
func testLinearizable(t *testing.T, s *suite) {
	for run := range 4 {
		t.Run(fmt.Sprint(run), func(t *testing.T) { linearizableRun(t, s, uint64(run)) })
	}
}

func linearizableRun(t *testing.T, s *suite, seed uint64) {
	const nodes, keys, opsPerNode = 6, 2, 150
	m := s.open(t, func(c *Config) {
		c.AllowMultiNodeDownload = false
		c.SessionGrace = time.Millisecond
	})
	ctx := context.Background()
	start := time.Now()
	var mu sync.Mutex
	var history []porcupine.Operation
	record := func(client int, in pIn, call int64, out pOut) {
		mu.Lock()
		history = append(history, porcupine.Operation{ClientId: client, Input: in, Call: call, Output: out, Return: time.Since(start).Nanoseconds()})
		mu.Unlock()
	}
	var wg sync.WaitGroup
	for n := range nodes {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(seed, uint64(n)))
			node := fmt.Sprint("n", n)
			st, _, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: node})
			if err != nil {
				t.Error(err)
				return
			}
			// Closing the stream is a drop: it happens after the history
			// ends, or is recorded as one.
			t.Cleanup(st.Close)
			tokens := map[int]uint64{}
			for range opsPerNode {
				k := rng.IntN(keys)
				res := fmt.Sprint("r", k)
				call := time.Since(start).Nanoseconds()
				switch p := rng.IntN(100); {
				case p < 2 && n > 0: // node 0 never drops, so locks keep flowing
					st.Close()
					record(n, pIn{key: k, op: opDrop, node: int8(n)}, call, pOut{})
					for other := range keys {
						if other != k {
							record(n, pIn{key: other, op: opDrop, node: int8(n)}, call, pOut{})
						}
					}
					return
				case p < 50:
					r, err := m.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: res, Node: node})
					out := pOut{acquired: r.Acquired, token: r.Token, err: err, holder: -1}
					var he *lock.HeldError
					if errors.As(err, &he) {
						fmt.Sscanf(he.Holder, "n%d", &out.holder)
					}
					if r.Acquired {
						tokens[k] = r.Token
					}
					record(n, pIn{key: k, op: opLock, node: int8(n)}, call, out)
				default:
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
					r, err := m.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: res, Node: node, Success: success, Token: tok})
					record(n, pIn{key: k, op: opUnlock, node: int8(n), token: tok, success: success}, call, pOut{err: err, replayed: r.Replayed})
				}
			}
		})
	}
	wg.Wait()
	res, info := porcupine.CheckOperationsVerbose(lockModel.ToModel(), history, 30*time.Second)
	if res != porcupine.Ok {
		// Not t.TempDir: the visualization must outlive the test.
		path := "(none)"
		if f, err := os.CreateTemp("", "locktest-history-*.html"); err == nil {
			path = f.Name()
			_ = porcupine.Visualize(lockModel.ToModel(), info, f)
			_ = f.Close()
		}
		t.Fatalf("history of %d operations is %s (visualization: %s)", len(history), res, path)
	}
}
