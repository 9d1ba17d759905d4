package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/bench"
	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/internal/netfault"
)

// The cut-off tests prove with real faults that a node cut off from the
// lock service stops before its lock moves on, and that the lock moves on
// within its bound (docs/DESIGN.md, "The holder stops first"): real `dlock
// serve` processes (memory, or three on a three-member etcd cluster), two
// real `dlock run` processes on one key whose commands write timestamped
// lines to one file, and faults made with iptables (as root; elsewhere the
// tests skip saying NOT TESTED), SIGSTOP and black-holing proxies.
// internal/bench/cutoff.go runs a round, which `dlock bench --scenario
// cutoff` runs too; these tests check its outcome:
//
//   - no overlap: every line of the waiter's command comes after the last
//     line of the holder's, in the file's order and by the lines' times;
//   - the holder either stopped, exiting 75 (ExitLockLost) and saying the
//     lock was lost, and the waiter ran within the bound (grace + ping +
//     dead-peer timeout + 10 s of slack, a bound on liveness, not a
//     measure of speed), or, where a server it can reach vouches for its
//     hold (a server frozen, a server cut off from etcd), it kept the hold
//     and finished first;
//   - every fault undone: no iptables rule of this process is left.

// cutoff runs one round of the scenario and checks it.
func cutoff(t *testing.T, name string) {
	netfault.NeedRoot(t)
	env := bench.CutoffEnv{Bin: dlockBinary(t), Dir: t.TempDir(), LostStatus: ExitLockLost}
	if bench.CutoffEtcd(name) {
		env.Etcd = etcdtest.StartCluster(t, 3).Endpoints()
	}
	o, err := bench.RunCutoff(t.Context(), env, name)
	if left, rerr := netfault.Remaining(); rerr != nil || len(left) > 0 {
		t.Errorf("faults not undone: rules left %q (%v)", left, rerr)
	}
	if err != nil {
		logTails(t, o.Dir)
		t.Fatal(err)
	}
	if o.Kept {
		t.Logf("%s: the holder kept its hold (it moved to a server that vouched for it), and finished; the waiter ran %v after the cut; overlap %v",
			name, o.Next.Round(time.Millisecond), o.Overlap)
	} else {
		t.Logf("%s: cut → holder's last line %v, cut → waiter's first line %v (bound %v), overlap %v",
			name, o.Stopped.Round(time.Millisecond), o.Next.Round(time.Millisecond), o.Bound, o.Overlap)
	}
	for _, p := range o.Problems {
		t.Error(p)
	}
	if t.Failed() {
		t.Logf("holder: status %d\n%s", o.HolderStatus, o.HolderStderr)
		t.Logf("waiter: status %d\n%s", o.WaiterStatus, o.WaiterStderr)
		logTails(t, o.Dir)
	}
}

// logTails logs the end of every log of a round.
func logTails(t *testing.T, dir string) {
	if dir == "" {
		return
	}
	logs, _ := filepath.Glob(filepath.Join(dir, "*.log"))
	for _, l := range logs {
		data, _ := os.ReadFile(l)
		if len(data) > 6000 {
			data = data[len(data)-6000:]
		}
		t.Logf("--- %s:\n%s", filepath.Base(l), strings.TrimSpace(string(data)))
	}
}

// TestCutoffMemory: on the memory engine (--session-grace 3s), the holder's
// address dropped both ways: it hears nothing and is heard by no one.
func TestCutoffMemory(t *testing.T) { cutoff(t, bench.CutoffMemoryCut) }

// TestCutoffMemoryToHolder: only the server's packets to the holder are
// dropped: its requests arrive, no answer comes back, and the server's
// pings are never acknowledged.
func TestCutoffMemoryToHolder(t *testing.T) { cutoff(t, bench.CutoffMemoryToHolder) }

// TestCutoffMemoryFromHolder: only the holder's packets to the server are
// dropped: it still hears the server's pings, but no confirmation of its
// hold; pings never extend a lease.
func TestCutoffMemoryFromHolder(t *testing.T) { cutoff(t, bench.CutoffMemoryFromHolder) }

// TestCutoffEtcd: three servers on a three-member etcd; the holder, given
// all three, cut off from every one.
func TestCutoffEtcd(t *testing.T) { cutoff(t, bench.CutoffEtcdCut) }

// TestCutoffEtcdServerFrozen: the server holding the holder's stream is
// frozen (SIGSTOP) and its address dropped; the holder, given all three
// servers, keeps its hold by moving to another within the grace, or stops
// before the waiter starts.
func TestCutoffEtcdServerFrozen(t *testing.T) { cutoff(t, bench.CutoffEtcdFrozen) }

// TestCutoffEtcdServerOffEtcd: the holder's server is cut off from etcd
// (its etcd traffic through black-holed proxies) while the holder reaches
// it: the holder keeps its hold by moving to another server, or stops
// before the waiter starts.
func TestCutoffEtcdServerOffEtcd(t *testing.T) { cutoff(t, bench.CutoffEtcdOffEtcd) }
