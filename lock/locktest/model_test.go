package locktest

import (
	"testing"

	"github.com/anishathalye/porcupine"
	"go.uber.org/goleak"

	"github.com/dlock/dlock/lock"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestModel checks the linearizability model itself on short sequential
// histories: it must accept what the rules allow and refuse what they
// forbid, or the suite's porcupine check proves nothing.
func TestModel(t *testing.T) {
	type step struct {
		in  pIn
		out pOut
	}
	lockBy := func(node int8, token uint64) step {
		return step{pIn{op: opLock, node: node}, pOut{acquired: true, token: token, holder: -1}}
	}
	heldBy := func(node, holder int8) step {
		return step{pIn{op: opLock, node: node}, pOut{err: lock.ErrLockHeld, holder: holder}}
	}
	unlockBy := func(node int8, token uint64, success bool) step {
		return step{pIn{op: opUnlock, node: node, token: token, success: success}, pOut{}}
	}
	replayBy := func(node int8, success bool) step {
		return step{pIn{op: opUnlock, node: node, success: success}, pOut{replayed: true}}
	}
	notHolder := func(node int8) step {
		return step{pIn{op: opUnlock, node: node}, pOut{err: lock.ErrNotHolder}}
	}
	stale := func(node int8, token uint64) step {
		return step{pIn{op: opUnlock, node: node, token: token}, pOut{err: lock.ErrStaleToken}}
	}
	drop := func(node int8) step { return step{pIn{op: opDrop, node: node}, pOut{}} }
	for _, c := range []struct {
		name  string
		steps []step
		ok    bool
	}{
		{"grant, unlock, grant", []step{lockBy(0, 5), unlockBy(0, 5, true), lockBy(1, 6)}, true},
		{"re-lock by the holder", []step{lockBy(0, 5), lockBy(0, 5), heldBy(1, 0)}, true},
		{"stale token, then the right one", []step{lockBy(0, 5), stale(0, 4), unlockBy(0, 5, false)}, true},
		{"replayed unlock", []step{lockBy(0, 5), unlockBy(0, 5, false), replayBy(0, false), notHolder(1)}, true},
		{"a dropped holder's hold may vanish", []step{lockBy(1, 5), drop(1), lockBy(0, 6)}, true},
		{"two holders", []step{lockBy(0, 5), lockBy(1, 6)}, false},
		{"token goes back", []step{lockBy(0, 5), unlockBy(0, 5, true), lockBy(1, 5)}, false},
		{"re-lock with another token", []step{lockBy(0, 5), lockBy(0, 6)}, false},
		{"refused while free", []step{heldBy(1, 0)}, false},
		{"replay with another outcome", []step{lockBy(0, 5), unlockBy(0, 5, false), replayBy(0, true)}, false},
		{"replay after a release the server made", []step{lockBy(1, 5), drop(1), lockBy(0, 6), unlockBy(0, 6, true), replayBy(1, false)}, false},
		{"a live holder's hold vanishes", []step{lockBy(1, 5), lockBy(0, 6)}, false},
	} {
		var h []porcupine.Operation
		for i, s := range c.steps {
			h = append(h, porcupine.Operation{ClientId: 0, Input: s.in, Output: s.out, Call: int64(2 * i), Return: int64(2*i + 1)})
		}
		if got := porcupine.CheckOperations(lockModel.ToModel(), h); got != c.ok {
			t.Errorf("%s: linearizable=%v, want %v", c.name, got, c.ok)
		}
	}
}
