package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/memory"
)

// startServer runs an in-process dlock server on 127.0.0.1 for the binary.
func startServer(t *testing.T, mod func(*memory.Config)) *dlocktest.Server {
	return dlocktest.Start(t, dlocktest.Options{Config: mod})
}

// dlock runs the binary and returns stdout, stderr and the exit status.
func dlock(t *testing.T, server string, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.Command(dlockBinary(t), args...)
	cmd.Env = append(os.Environ(), "DLOCK_SERVER="+server)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatal(err)
	}
	return out.String(), errb.String(), cmd.ProcessState.ExitCode()
}

// layer is the key the racing processes of raceRun want.
var layer = lock.Key{Type: lock.Pull, Resource: "sha256:layer"}

// raceRun starts n `dlock run` processes at once on one resource. Their
// script, made by script, may wait with the shell it is given; raceRun
// lets that wait end once the other n-1 processes are queued on the
// server, a barrier: however slow the machine is to start them, none comes
// late and finds the key free.
func raceRun(t *testing.T, srv *dlocktest.Server, n int, script func(wait string) string) (statuses []int, stderrs []string) {
	statuses, stderrs = make([]int, n), make([]string, n)
	goFile := filepath.Join(t.TempDir(), "go")
	wait := "until [ -e " + goFile + " ]; do sleep 0.01; done"
	var wg sync.WaitGroup
	defer wg.Wait()
	release := sync.OnceFunc(func() {
		if err := os.WriteFile(goFile, nil, 0o600); err != nil {
			t.Error(err)
		}
	})
	defer release() // a failed wait must not leave the scripts waiting
	for i := range n {
		wg.Go(func() {
			_, stderrs[i], statuses[i] = dlock(t, srv.URL(), "run", "--resource", layer.Resource, "--", "sh", "-c", script(wait))
		})
	}
	srv.WaitQueued(t, layer, n-1)
	release()
	wg.Wait()
	return statuses, stderrs
}

func lines(t *testing.T, path string) int {
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(data), "\n")
}

// TestRunOnceOnSuccess: eight processes race; the command runs exactly once
// and the other seven are told it was done.
func TestRunOnceOnSuccess(t *testing.T) {
	srv := startServer(t, nil)
	log := filepath.Join(t.TempDir(), "runs")
	statuses, stderrs := raceRun(t, srv, 8, func(wait string) string { return `echo run >> ` + log + `; ` + wait })
	if n := lines(t, log); n != 1 {
		t.Fatalf("the command ran %d times, want 1", n)
	}
	skips := 0
	for i, st := range statuses {
		if st != 0 {
			t.Errorf("process %d exited %d: %s", i, st, stderrs[i])
		}
		if strings.Contains(stderrs[i], "skipped: done by ") {
			skips++
		}
	}
	if skips != 7 {
		t.Fatalf("%d processes said they skipped, want 7: %q", skips, stderrs)
	}
	// Moments later the work is still done: skipped, with --skip-exit-code.
	if _, errOut, st := dlock(t, srv.URL(), "run", "--resource", layer.Resource, "--skip-exit-code", "9", "--", "sh", "-c", "echo run >> "+log); st != 9 || lines(t, log) != 1 {
		t.Fatalf("late run: status %d (%s), %d runs", st, errOut, lines(t, log))
	}
	// --always runs it.
	if _, _, st := dlock(t, srv.URL(), "run", "--resource", layer.Resource, "--always", "--", "sh", "-c", "echo run >> "+log); st != 0 || lines(t, log) != 2 {
		t.Fatalf("--always: status %d, %d runs", st, lines(t, log))
	}
}

// TestRunTwiceOnFailure: the first run fails; exactly one other process
// takes over, and its exit status is the command's.
func TestRunTwiceOnFailure(t *testing.T) {
	srv := startServer(t, nil)
	dir := t.TempDir()
	log := filepath.Join(dir, "runs")
	// The first run fails once the others are queued; the second succeeds.
	statuses, stderrs := raceRun(t, srv, 8, func(wait string) string {
		return `echo run >> ` + log + `; if mkdir ` + filepath.Join(dir, "failed") + ` 2>/dev/null; then ` + wait + `; exit 3; fi`
	})
	if n := lines(t, log); n != 2 {
		t.Fatalf("the command ran %d times, want 2: %q", n, stderrs)
	}
	threes := 0
	for _, st := range statuses {
		if st == 3 {
			threes++
		} else if st != 0 {
			t.Errorf("unexpected status %d", st)
		}
	}
	if threes != 1 {
		t.Fatalf("statuses %v, want exactly one 3 (the failed run)", statuses)
	}
}

func TestRunSignalReleasesAsFailure(t *testing.T) {
	srv := startServer(t, nil).URL()
	started := filepath.Join(t.TempDir(), "started")
	cmd := exec.Command(dlockBinary(t), "run", "--resource", "r", "--node", "sig", "--", "sh", "-c", "touch "+started+"; exec sleep 30")
	cmd.Env = append(os.Environ(), "DLOCK_SERVER="+srv)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// The command runs: a signal now goes to it. (Seeing the lock held is
	// not enough: until dlock has the answer, a signal cancels the wait.)
	kit.WaitFor(t, "the command to start", func() bool { _, err := os.Stat(started); return err == nil })
	cmd.Process.Signal(syscall.SIGTERM)
	err := cmd.Wait()
	if cmd.ProcessState.ExitCode() != 128+15 {
		t.Fatalf("exit %v, want 143 (the command's death by SIGTERM)", err)
	}
	st := status(t, srv, "r")
	if st.State != "free" || st.LastCompleted == nil || st.LastCompleted.Success || st.LastCompleted.Error != "interrupted by a signal" {
		t.Fatalf("status after SIGTERM: %+v %+v", st, st.LastCompleted)
	}
}

// TestRunLockLost: a command whose lock runs out (here its max hold) is
// stopped before the server ends the hold: SIGTERM, ignored here, then
// SIGKILL, and dlock run gives the hold up itself, so the completion the
// server records is dlock run's, not the max hold's (docs/DESIGN.md,
// "Leases"). The command's children go with it: they are its process group.
func TestRunLockLost(t *testing.T) {
	s := startServer(t, func(c *memory.Config) { c.MaxHold = 4 * time.Second })
	dir := t.TempDir()
	child := filepath.Join(dir, "child.pid")
	_, errOut, st := dlock(t, s.URL(), "run", "--resource", "r", "--", "sh", "-c", `trap "" TERM; sleep 30 & echo $! > `+child+`; wait`)
	if st != ExitLockLost || !strings.Contains(errOut, "lock lost") || !strings.Contains(errOut, "SIGKILL") {
		t.Fatalf("status %d, stderr %q: want %d, 'lock lost' and SIGKILL", st, errOut, ExitLockLost)
	}
	got := status(t, s.URL(), "r")
	if got.State != "free" || got.LastCompleted == nil || got.LastCompleted.Error != errLostStopped.Error() {
		t.Fatalf("status %+v %+v: want the hold given up by dlock run before its max hold ended it", got, got.LastCompleted)
	}
	pid, err := os.ReadFile(child)
	if err != nil {
		t.Fatal(err)
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(pid)))
	kit.WaitFor(t, "the command's child to be gone", func() bool { return syscall.Kill(n, 0) != nil })
}

type statusAnswer struct {
	State         string
	Holder        string
	Token         uint64
	QueueLength   int `json:"queue_length"`
	LastCompleted *struct {
		NodeID  string `json:"node_id"`
		Success bool
		Error   string
	} `json:"last_completed"`
}

func status(t *testing.T, srv, res string) statusAnswer {
	resp, err := http.Get(srv + "/status?type=pull&resource_id=" + res)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st statusAnswer
	json.NewDecoder(resp.Body).Decode(&st)
	return st
}

func TestClientSubcommands(t *testing.T) {
	srv := startServer(t, func(c *memory.Config) { c.RefStore = memRefs{} }).URL()
	out, errOut, st := dlock(t, srv, "lock", "--resource", "r", "--node", "a")
	var lr struct {
		Acquired bool
		Token    uint64
	}
	if st != 0 || json.Unmarshal([]byte(out), &lr) != nil || !lr.Acquired {
		t.Fatalf("lock: %d %q %q", st, out, errOut)
	}
	if out, _, _ := dlock(t, srv, "lock", "--resource", "r", "--node", "b", "--human"); out != "queued for pull:r at position 1 behind a\n" {
		t.Fatalf("lock --human: %q", out)
	}
	if _, errOut, st := dlock(t, srv, "unlock", "--resource", "r", "--node", "b"); st != 1 || !strings.Contains(errOut, "not_holder") {
		t.Fatalf("unlock by a waiter: %d %q", st, errOut)
	}
	if out, _, st := dlock(t, srv, "unlock", "--resource", "r", "--node", "a", "--fail", "disk full", "--human"); st != 0 || out != "released pull:r; next holder b\n" {
		t.Fatalf("unlock --fail: %d %q", st, out)
	}
	out, _, _ = dlock(t, srv, "status", "--resource", "r", "--human")
	if !strings.HasPrefix(out, "pull:r held by b") || !strings.Contains(out, "last failed: disk full by a") {
		t.Fatalf("status --human: %q", out)
	}
	// A waiter's own status says its place (it was left out).
	dlock(t, srv, "lock", "--resource", "r", "--node", "c")
	if out, _, _ := dlock(t, srv, "status", "--resource", "r", "--node", "c", "--human"); !strings.Contains(out, ", 1 waiting, c at position 1;") {
		t.Fatalf("status --human --node c: %q", out)
	}
	if out, _, st := dlock(t, srv, "refcount", "--resource", "r", "--add", "--node", "a", "--human"); st != 0 || out != "r: 1 node(s) a\n" {
		t.Fatalf("refcount --add: %d %q", st, out)
	}
	if out, _, _ := dlock(t, srv, "refcount", "--release", "--node", "a"); !strings.Contains(out, `"released":1`) {
		t.Fatalf("refcount --release (all): %q", out)
	}
	// Another type, as the seeds' content layer's (docs/DESIGN.md, "Other types").
	if out, errOut, st := dlock(t, srv, "lock", "--resource", "r", "--node", "a", "--type", "image-layer", "--human"); st != 0 || !strings.HasPrefix(out, "acquired image-layer:r") {
		t.Fatalf("lock --type image-layer: %d %q %q", st, out, errOut)
	}
	for _, args := range [][]string{{"lock"}, {"lock", "--resource", "r", "--type", "Fetch"}, {"lock", "--resource", "r", "--type", "image_layer"}, {"run", "--resource", "r"}, {"frobnicate"}} {
		if _, _, st := dlock(t, srv, args...); st != 2 {
			t.Errorf("%v: status %d, want 2", args, st)
		}
	}
	if _, errOut, st := dlock(t, "http://127.0.0.1:1", "status", "--resource", "r"); st != 1 || errOut == "" {
		t.Errorf("unreachable server: status %d %q", st, errOut)
	}
}

type memRefs struct{}

func (memRefs) Load(context.Context) (map[string]memory.RefRecord, uint64, error) { return nil, 0, nil }
func (memRefs) Save(context.Context, string, memory.RefRecord) error              { return nil }

// TestClientServerList: --server and DLOCK_SERVER take several servers;
// the first here is dead, and every command is answered by the second.
func TestClientServerList(t *testing.T) {
	srv := startServer(t, nil).URL()
	list := "http://127.0.0.1:1," + srv
	if out, errOut, st := dlock(t, list, "lock", "--resource", "r", "--node", "a", "--human"); st != 0 || !strings.HasPrefix(out, "acquired pull:r") {
		t.Fatalf("lock through DLOCK_SERVER=%s: %d %q %q", list, st, out, errOut)
	}
	if out, errOut, st := dlock(t, list, "unlock", "--resource", "r", "--node", "a", "--human"); st != 0 || out != "released pull:r; now free\n" {
		t.Fatalf("unlock: %d %q %q", st, out, errOut)
	}
	ran := filepath.Join(t.TempDir(), "ran")
	if _, errOut, st := dlock(t, "", "run", "--server", list, "--resource", "r2", "--", "touch", ran); st != 0 {
		t.Fatalf("run --server %s: %d %q", list, st, errOut)
	}
	if _, err := os.Stat(ran); err != nil {
		t.Fatalf("the command did not run: %v", err)
	}
	if st := status(t, srv, "r2"); st.State != "free" || st.LastCompleted == nil || !st.LastCompleted.Success {
		t.Fatalf("status after run: %+v", st)
	}
	if _, errOut, st := dlock(t, "http://127.0.0.1:1,https://127.0.0.1:2", "status", "--resource", "r"); st != 1 || !strings.Contains(errOut, "all https://") {
		t.Errorf("http:// and https:// servers mixed: %d %q", st, errOut)
	}
	if _, errOut, st := dlock(t, list, "status", "--resource", "r", "--ca", "ca.pem"); st != 2 || !strings.Contains(errOut, "https") {
		t.Errorf("--ca for http:// servers: %d %q", st, errOut)
	}
	if _, _, st := dlock(t, list, "bench"); st != 2 {
		t.Errorf("bench of a server list: status %d, want 2", st)
	}
}
