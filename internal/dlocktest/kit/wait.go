// Package kit is the part of dlock's test harness that does not import the
// server, so that the server's own tests use it too: WaitFor, the hooks
// that kill a connection or stall a node's session stream, an in-memory
// listener for servers inside a testing/synctest bubble, and the tests'
// reader of event streams. Package dlocktest builds a whole server on it.
package kit

import (
	"errors"
	"testing"
	"time"
)

// Patience bounds every wait of the harness. It does not order anything: a
// wait ends as soon as its condition holds. It is long enough for a machine
// loaded by other tests, and short enough that a broken run fails with a
// message naming what it waited for rather than at go test's timeout.
const Patience = 30 * time.Second

var errNotYet = errors.New("not yet")

// WaitFor polls cond until it holds, and fails the test if it does not
// within Patience. It calls t.Fatalf: call it from the test's goroutine.
// Inside a synctest bubble it polls in fake time, each poll after every
// other goroutine of the bubble is blocked.
func WaitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	Await(t, what, func() error {
		if cond() {
			return nil
		}
		return errNotYet
	})
}

// Await is WaitFor for a check that says what it saw: it polls check until
// it returns nil, and a timeout reports check's last error with what.
func Await(t testing.TB, what string, check func() error) {
	t.Helper()
	deadline := time.Now().Add(Patience)
	pause := time.Millisecond
	for {
		err := check()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s: %v", Patience, what, err)
		}
		time.Sleep(pause)
		// Polls back off so that a long wait on a loaded machine does
		// not take the CPU from what it waits for.
		pause = min(2*pause, 50*time.Millisecond)
	}
}
