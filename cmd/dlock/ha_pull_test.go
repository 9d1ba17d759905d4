package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
)

// haRunners is how many `dlock run` processes race in TestHAPullOnce.
const haRunners = 24

// haRace is one race of `dlock run` processes for one resource across the
// servers of h, while a dlock server is SIGKILLed and an etcd member is
// killed and restarted.
type haRace struct {
	h        *haCluster
	failover bool
	res      string
	dir      string
	goFile   string // the commands wait for it: the test's barrier
	statuses []int
	stderrs  []string
	nodes    []string
}

// runHARace starts haRunners processes, runner i on server i first (or
// only, without client fail-over), each running script(wait) under a pull
// lock of res; wait is shell that returns once the test lets the commands
// go on, and dir is the race's directory. Once one holds the lock and
// every other one is queued, it kills the etcd member that leads (a new
// election while everything waits on etcd) and restarts it, then SIGKILLs
// the dlock server the holder's process reached first (its session stream
// must move, or come back, within the grace); then it lets the commands go
// on, and waits for every process.
func runHARace(t *testing.T, h *haCluster, failover bool, script func(dir, wait string) string) *haRace {
	r := &haRace{h: h, failover: failover, res: "sha256:ha-layer", dir: t.TempDir()}
	r.goFile = filepath.Join(r.dir, "go")
	wait := "until [ -e " + r.goFile + " ]; do sleep 0.01; done"
	r.statuses, r.stderrs, r.nodes = make([]int, haRunners), make([]string, haRunners), make([]string, haRunners)
	var wg sync.WaitGroup
	release := sync.OnceFunc(func() {
		if err := os.WriteFile(r.goFile, nil, 0o600); err != nil {
			t.Error(err)
		}
	})
	var cmds []*exec.Cmd
	defer func() {
		release() // a failed wait must not leave the scripts waiting
		if t.Failed() {
			for _, c := range cmds {
				c.Process.Kill()
			}
		}
		wg.Wait()
	}()
	for i := range haRunners {
		r.nodes[i] = fmt.Sprintf("runner%02d", i)
		cmd := exec.Command(dlockBinary(t), "run", "--server", h.serverArg(i, failover), "--node", r.nodes[i],
			"--resource", r.res, "--", "sh", "-c", script(r.dir, wait))
		cmd.Env = os.Environ()
		// Killed with the test binary, should that die first (Linux).
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		var errb bytes.Buffer
		cmd.Stderr = &errb
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		cmds = append(cmds, cmd)
		wg.Go(func() {
			cmd.Wait()
			r.statuses[i], r.stderrs[i] = cmd.ProcessState.ExitCode(), errb.String()
		})
	}
	// Every process is in the race: one holds the lock, the others wait.
	var holder string
	kit.Await(t, fmt.Sprintf("one holder and %d waiters", haRunners-1), func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		st, err := h.status(ctx, h.servers[0].URL(), "pull", r.res)
		if err != nil {
			return err
		}
		if st.State != "held" || st.QueueLength != haRunners-1 {
			return fmt.Errorf("state %s, holder %s, %d waiting", st.State, st.Holder, st.QueueLength)
		}
		holder = st.Holder
		return nil
	})
	var hi int
	if _, err := fmt.Sscanf(holder, "runner%d", &hi); err != nil {
		t.Fatalf("holder %q: %v", holder, err)
	}
	victim := h.servers[hi%len(h.servers)]
	member := h.etcdLeader(t)
	t.Logf("holder %s (first server %s); killing and restarting etcd member %d, then killing %s", holder, victim.name, member, victim.name)
	// One after the other: an election on this loaded machine can take
	// longer than the grace, during which no server can move a session.
	h.etcd.Kill(member)
	h.etcd.Restart(member)
	victim.Kill()
	if !failover {
		victim.Restart(h.hc)
	}
	release()
	wg.Wait()
	if failover {
		victim.Restart(h.hc)
	}
	return r
}

// runs counts the lines of the commands' shared file that start with what.
func (r *haRace) runs(t *testing.T, what string) int {
	data, err := os.ReadFile(filepath.Join(r.dir, "runs"))
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	n := 0
	for l := range strings.Lines(string(data)) {
		if strings.HasPrefix(l, what) {
			n++
		}
	}
	return n
}

// TestHAPullOnce: 24 `dlock run` processes spread over 3 dlock servers on a
// 3-member etcd cluster race for one pull while the etcd leader is killed
// and restarted and the dlock server of the holder's stream is SIGKILLed:
// the command runs exactly once, and every process exits 0, having run it
// or been told it was done (docs/DESIGN.md, "Concepts": a pull done once is
// done for everyone).
func TestHAPullOnce(t *testing.T) {
	failover := clientFailover(t)
	h := startHA(t, 3, "--session-grace", haGrace(failover))
	r := runHARace(t, h, failover, func(dir, wait string) string {
		return `echo run >> ` + filepath.Join(dir, "runs") + `; ` + wait + `; sleep 0.2`
	})
	if n := r.runs(t, "run"); n != 1 {
		t.Errorf("the command ran %d times, want 1", n)
	}
	skips := 0
	for i, st := range r.statuses {
		if st != 0 {
			t.Errorf("%s exited %d: %s", r.nodes[i], st, r.stderrs[i])
		}
		if strings.Contains(r.stderrs[i], "skipped: done by ") {
			skips++
		}
	}
	if skips != haRunners-1 {
		t.Errorf("%d processes said they skipped, want %d", skips, haRunners-1)
	}
}

// TestHAPullOnceAfterFailure: the same race, where the first command to
// run fails (exit 1): the next in line takes over, and exactly one run
// succeeds in all (docs/DESIGN.md, "Unlock": a failure hands the key to
// the first waiter).
func TestHAPullOnceAfterFailure(t *testing.T) {
	failover := clientFailover(t)
	h := startHA(t, 3, "--session-grace", haGrace(failover))
	r := runHARace(t, h, failover, func(dir, wait string) string {
		log := filepath.Join(dir, "runs")
		return `if mkdir ` + filepath.Join(dir, "failed") + ` 2>/dev/null; then echo fail >> ` + log + `; ` + wait + `; exit 1; fi; echo run >> ` + log + `; sleep 0.2`
	})
	if f, ok := r.runs(t, "fail"), r.runs(t, "run"); f != 1 || ok != 1 {
		t.Errorf("%d failed runs and %d successful ones, want 1 and 1", f, ok)
	}
	ones := 0
	for i, st := range r.statuses {
		switch st {
		case 0:
		case 1:
			ones++
		default:
			t.Errorf("%s exited %d: %s", r.nodes[i], st, r.stderrs[i])
		}
	}
	if ones != 1 {
		for i := range r.statuses {
			t.Logf("%s exited %d: %s", r.nodes[i], r.statuses[i], r.stderrs[i])
		}
		t.Errorf("%d processes exited 1, want 1 (the failed run)", ones)
	}
}

// haGrace is the servers' --session-grace: 6 s when a process moves to
// another server at once; without client fail-over it waits for its own
// server to come back, which with an etcd member down can take longer.
func haGrace(failover bool) string {
	if failover {
		// Long enough for the holder's client-side lease to outlive an
		// etcd election on this loaded machine: no server can confirm a
		// hold while etcd has no leader (docs/DESIGN.md, "Leases").
		return "6s"
	}
	return "8s"
}
