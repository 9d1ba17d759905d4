package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/netfault"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/memory"
)

// The tests of dlock run's watchdog (watchdog.go; docs/DESIGN.md, "A paused
// client"). Each orders its steps by states it waits for: lines in a file,
// the server's queue, processes in /proc.

// bgRun is a `dlock run` started in the background.
type bgRun struct {
	*exec.Cmd
	stderr string // the file of its standard error
}

// startRun starts `dlock run --node node --resource res -- sh -c script`
// against srv; its standard error goes to a file (not a pipe, which the
// command's processes would hold open).
func startRun(t *testing.T, srv, node, res, script string) *bgRun {
	t.Helper()
	errFile := filepath.Join(t.TempDir(), node+".stderr")
	f, err := os.Create(errFile)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd := exec.Command(dlockBinary(t), "run", "--node", node, "--resource", res, "--", "sh", "-c", script)
	cmd.Env = append(os.Environ(), "DLOCK_SERVER="+srv)
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	r := &bgRun{Cmd: cmd, stderr: errFile}
	t.Cleanup(func() {
		if r.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	return r
}

// wait waits for the run's end and returns its exit status and stderr.
func (r *bgRun) wait(t *testing.T) (int, string) {
	t.Helper()
	err := r.Wait()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatal(err)
	}
	out, _ := os.ReadFile(r.stderr)
	return r.ProcessState.ExitCode(), string(out)
}

// procStat reads a process's state letter, parent and process group from
// /proc; ok is false when it is gone.
func procStat(pid int) (state byte, ppid, pgrp int, ok bool) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, 0, 0, false
	}
	s := string(raw)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	ppid, _ = strconv.Atoi(f[1])
	pgrp, _ = strconv.Atoi(f[2])
	return f[0][0], ppid, pgrp, true
}

// running says whether pid is a process that has not exited: neither gone
// nor a zombie.
func running(pid int) bool {
	st, _, _, ok := procStat(pid)
	return ok && st != 'Z' && st != 'X'
}

// pids lists the processes of /proc that match.
func pids(match func(pid int) bool) []int {
	ents, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range ents {
		if pid, err := strconv.Atoi(e.Name()); err == nil && match(pid) {
			out = append(out, pid)
		}
	}
	return out
}

// groupRunning lists the processes of process group pgid that have not
// exited.
func groupRunning(pgid int) []int {
	return pids(func(pid int) bool {
		st, _, g, ok := procStat(pid)
		return ok && g == pgid && st != 'Z' && st != 'X'
	})
}

// watchdogOf waits for the watchdog of the dlock process pid: its child
// `dlock __watchdog`, in a process group of its own.
func watchdogOf(t *testing.T, pid int) int {
	t.Helper()
	var wd int
	kit.Await(t, fmt.Sprintf("the watchdog of dlock %d", pid), func() error {
		found := pids(func(p int) bool {
			_, ppid, _, ok := procStat(p)
			if !ok || ppid != pid {
				return false
			}
			cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", p))
			args := strings.Split(string(cmdline), "\x00")
			return len(args) > 1 && args[1] == watchdogArg
		})
		if len(found) != 1 {
			return fmt.Errorf("children running %s: %v", watchdogArg, found)
		}
		wd = found[0]
		return nil
	})
	if _, _, g, _ := procStat(wd); g != wd {
		t.Fatalf("the watchdog %d is in process group %d, not its own", wd, g)
	}
	return wd
}

// stamps reads the complete lines "<unix-nanos>" of a file; none if the
// file is not there yet.
func stamps(t *testing.T, path string) []int64 {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	s := string(raw)
	s = s[:strings.LastIndexByte(s, '\n')+1]
	var out []int64
	for l := range strings.Lines(s) {
		n, err := strconv.ParseInt(strings.TrimSpace(l), 10, 64)
		if err != nil {
			t.Fatalf("%s: line %q", path, l)
		}
		out = append(out, n)
	}
	return out
}

func readPid(t *testing.T, path string) int {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(raw)))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// writer is a command that writes its pid to pidFile, then a line
// "<unix-nanos>" to lines every 50 ms until it is stopped.
func writer(pidFile, lines string) string {
	return `echo $$ > ` + pidFile + `; while :; do date +%s%N >> ` + lines + `; sleep 0.05; done`
}

// overlapServer is a server whose session grace is 2 s: a client's lease is
// 1.5 s (the grace less a quarter of it), confirmed every 667 ms.
func overlapServer(t *testing.T) *dlocktest.Server {
	return startServer(t, func(c *memory.Config) { c.SessionGrace = 2 * time.Second })
}

// checkNoOverlap fails the test unless the first holder's command wrote
// its last line before the second's wrote its first.
func checkNoOverlap(t *testing.T, first, second []int64) {
	t.Helper()
	if len(first) == 0 || len(second) == 0 {
		t.Fatalf("lines: %d of the first holder, %d of the second", len(first), len(second))
	}
	last, next := slices.Max(first), second[0]
	if last >= next {
		t.Fatalf("the holders overlapped: the first wrote until %d, %v after the second began", last, time.Duration(last-next))
	}
	t.Logf("the first holder's command stopped %v before the second's began", time.Duration(next-last))
}

// TestRunWatchdogStopsCommandOfPausedDlock: dlock run alone is paused
// (SIGSTOP) while its command runs, and its session ends on the server, so
// the lock goes to a second dlock run at the end of the grace. The watchdog
// stops the command before that: its last line comes before the second
// command's first. Resumed, dlock run says so and exits 75.
func TestRunWatchdogStopsCommandOfPausedDlock(t *testing.T) {
	srv := overlapServer(t)
	dir := t.TempDir()
	aLines, aPid, bLines := filepath.Join(dir, "a.lines"), filepath.Join(dir, "a.pid"), filepath.Join(dir, "b.lines")
	a := startRun(t, srv.URL(), "a", "r", writer(aPid, aLines))
	kit.WaitFor(t, "a's command to write", func() bool { return len(stamps(t, aLines)) >= 2 })
	wd, leader := watchdogOf(t, a.Process.Pid), readPid(t, aPid)
	netfault.Freeze(t, a.Process.Pid)

	b := startRun(t, srv.URL(), "b", "r", `date +%s%N >> `+bLines)
	srv.WaitQueued(t, lock.Key{Type: lock.Pull, Resource: "r"}, 1)
	// a's session stream ends, and a, paused, cannot open another: the
	// server hands the lock to b at the end of the grace. a's lease,
	// confirmed last before the pause, ends earlier.
	if n := srv.KillStreams("a"); n != 1 {
		t.Fatalf("%d streams of a killed, want 1", n)
	}
	if st, errOut := b.wait(t); st != 0 {
		t.Fatalf("b: status %d: %s", st, errOut)
	}
	checkNoOverlap(t, stamps(t, aLines), stamps(t, bLines))
	if live := groupRunning(leader); len(live) != 0 {
		t.Fatalf("a's command still runs while a is paused: %v", live)
	}
	if running(wd) {
		t.Fatalf("the watchdog %d runs on after killing the command", wd)
	}

	if err := netfault.Thaw(a.Process.Pid); err != nil {
		t.Fatal(err)
	}
	st, errOut := a.wait(t)
	if st != ExitLockLost || !strings.Contains(errOut, "its watchdog stopped the command") {
		t.Fatalf("a, resumed: status %d, stderr %q; want %d and the watchdog's stop", st, errOut, ExitLockLost)
	}
	if _, _, _, ok := procStat(wd); ok {
		t.Fatalf("the watchdog %d is left after dlock run exited", wd)
	}
}

// TestRunWatchdogPausedDlockRunStillStops: the watchdog alone is paused;
// dlock run stops the command itself when its lease runs out (its session
// stream gone and refused), before the lock moves on, and kills the paused
// watchdog.
func TestRunWatchdogPausedDlockRunStillStops(t *testing.T) {
	srv := overlapServer(t)
	dir := t.TempDir()
	aLines, aPid, bLines := filepath.Join(dir, "a.lines"), filepath.Join(dir, "a.pid"), filepath.Join(dir, "b.lines")
	a := startRun(t, srv.URL(), "a", "r", writer(aPid, aLines))
	kit.WaitFor(t, "a's command to write", func() bool { return len(stamps(t, aLines)) >= 2 })
	wd, leader := watchdogOf(t, a.Process.Pid), readPid(t, aPid)
	netfault.Freeze(t, wd)

	b := startRun(t, srv.URL(), "b", "r", `date +%s%N >> `+bLines)
	srv.WaitQueued(t, lock.Key{Type: lock.Pull, Resource: "r"}, 1)
	allow := srv.RefuseStreams("a")
	defer allow()
	if n := srv.KillStreams("a"); n != 1 {
		t.Fatalf("%d streams of a killed, want 1", n)
	}
	st, errOut := a.wait(t)
	if st != ExitLockLost || !strings.Contains(errOut, "stopping it (SIGTERM") || strings.Contains(errOut, "watchdog") {
		t.Fatalf("a: status %d, stderr %q; want %d, stopped by dlock run itself", st, errOut, ExitLockLost)
	}
	if st, errOut := b.wait(t); st != 0 {
		t.Fatalf("b: status %d: %s", st, errOut)
	}
	checkNoOverlap(t, stamps(t, aLines), stamps(t, bLines))
	if _, _, _, ok := procStat(wd); ok {
		t.Fatalf("the paused watchdog %d is left after dlock run exited", wd)
	}
	if live := groupRunning(leader); len(live) != 0 {
		t.Fatalf("a's command runs on: %v", live)
	}
}

// TestRunWatchdogNormalRuns: in runs that end by themselves the watchdog
// is gone, reaped, by the time dlock run exits, and the exit statuses are
// the command's.
func TestRunWatchdogNormalRuns(t *testing.T) {
	srv := startServer(t, nil).URL()
	for i, tc := range []struct {
		exit string
		want int
	}{{"exit 0", 0}, {"exit 3", 3}, {"kill -TERM $$", 128 + 15}} {
		dir := t.TempDir()
		pidFile, started, goFile := filepath.Join(dir, "pid"), filepath.Join(dir, "started"), filepath.Join(dir, "go")
		r := startRun(t, srv, "n", fmt.Sprintf("r%d", i), `echo $$ > `+pidFile+`; touch `+started+`; until [ -e `+goFile+` ]; do sleep 0.01; done; `+tc.exit)
		kit.WaitFor(t, "the command to start", func() bool { _, err := os.Stat(started); return err == nil })
		wd, leader := watchdogOf(t, r.Process.Pid), readPid(t, pidFile)
		if _, ppid, g, _ := procStat(leader); ppid != r.Process.Pid || g != leader {
			t.Fatalf("the command %d: parent %d, group %d; want dlock run %d, a group of its own", leader, ppid, g, r.Process.Pid)
		}
		if err := os.WriteFile(goFile, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if st, errOut := r.wait(t); st != tc.want {
			t.Fatalf("%s: status %d (%s), want %d", tc.exit, st, errOut, tc.want)
		}
		// Reaped by dlock run before it exited: not even a zombie.
		if _, _, _, ok := procStat(wd); ok {
			t.Fatalf("%s: the watchdog %d is left after dlock run exited", tc.exit, wd)
		}
		if live := groupRunning(leader); len(live) != 0 {
			t.Fatalf("%s: the command's group runs on: %v", tc.exit, live)
		}
	}
}

// TestRunWatchdogDlockKilled: dlock run killed (SIGKILL) while its command
// runs: the command dies by its Pdeathsig, the watchdog sees the end of
// its input, kills the rest of the command's group (here a child of the
// command, which no Pdeathsig reaches), and exits.
func TestRunWatchdogDlockKilled(t *testing.T) {
	srv := startServer(t, nil).URL()
	dir := t.TempDir()
	pidFile, childFile, started := filepath.Join(dir, "pid"), filepath.Join(dir, "child"), filepath.Join(dir, "started")
	r := startRun(t, srv, "n", "r", `echo $$ > `+pidFile+`; sleep 300 & echo $! > `+childFile+`; touch `+started+`; wait`)
	kit.WaitFor(t, "the command to start", func() bool { _, err := os.Stat(started); return err == nil })
	wd, leader, child := watchdogOf(t, r.Process.Pid), readPid(t, pidFile), readPid(t, childFile)
	if err := r.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	r.wait(t)
	for what, pid := range map[string]int{"the command": leader, "the command's child": child, "the watchdog": wd} {
		kit.WaitFor(t, fmt.Sprintf("%s (%d) to exit", what, pid), func() bool { return !running(pid) })
	}
}

// watchdogProc runs `dlock __watchdog KILL_AFTER` directly, as dlock run
// does, with the pipes of its protocol: its input, its report, and the
// read end of the gate it opens.
type watchdogProc struct {
	cmd          *exec.Cmd
	in           *os.File
	report, gate *os.File
}

func startWatchdogProc(t *testing.T, killAfter time.Duration) *watchdogProc {
	t.Helper()
	inR, inW, _ := os.Pipe()
	repR, repW, _ := os.Pipe()
	gateR, gateW, _ := os.Pipe()
	cmd := exec.Command(dlockBinary(t), watchdogArg, killAfter.String())
	cmd.Stdin, cmd.Stdout, cmd.Stderr = inR, repW, os.Stderr
	cmd.ExtraFiles = []*os.File{gateW}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	inR.Close()
	repW.Close()
	gateW.Close()
	w := &watchdogProc{cmd: cmd, in: inW, report: repR, gate: gateR}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		inW.Close()
		repR.Close()
		gateR.Close()
	})
	return w
}

func (w *watchdogProc) send(t *testing.T, format string, args ...any) {
	t.Helper()
	if _, err := fmt.Fprintf(w.in, format+"\n", args...); err != nil {
		t.Fatal(err)
	}
}

// sleeper starts `sleep 300` in a process group of its own: a command for
// a watchdog to stop. It returns its pid and its end.
func sleeper(t *testing.T) (int, <-chan *os.ProcessState) {
	t.Helper()
	cmd := exec.Command("sleep", "300")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done, reaped := make(chan *os.ProcessState, 1), make(chan struct{})
	go func() {
		defer close(reaped)
		cmd.Wait()
		done <- cmd.ProcessState
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-reaped
	})
	return cmd.Process.Pid, done
}

// TestRunWatchdogProtocol: the watchdog's messages, driven directly. A
// group told after its deadline is stopped at once and its gate stays
// shut; a deadline to come opens the gate, and the end of the input then
// kills the group at once (SIGKILL) instead of at the deadline; a group
// whose deadline passes gets SIGTERM, which a sleep dies of.
func TestRunWatchdogProtocol(t *testing.T) {
	signalOf := func(ps *os.ProcessState) syscall.Signal {
		if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return ws.Signal()
		}
		return 0
	}
	t.Run("late group", func(t *testing.T) {
		w := startWatchdogProc(t, time.Hour)
		pid, done := sleeper(t)
		w.send(t, "end %d", monoNow()-1)
		w.send(t, "group %d", pid)
		if sig := signalOf(<-done); sig != syscall.SIGTERM {
			t.Fatalf("the group got %v, want SIGTERM", sig)
		}
		if b, _ := io.ReadAll(w.gate); len(b) != 0 {
			t.Fatalf("the gate was opened: %q", b)
		}
		w.in.Close() // dlock run gone: it exits
		if err := w.cmd.Wait(); err != nil {
			t.Fatal(err)
		}
		if out, _ := io.ReadAll(w.report); string(out) != "fired\n" {
			t.Fatalf("report %q, want fired", out)
		}
	})
	t.Run("end of input", func(t *testing.T) {
		w := startWatchdogProc(t, time.Second)
		pid, done := sleeper(t)
		w.send(t, "end %d", monoNow()+int64(time.Hour))
		w.send(t, "group %d", pid)
		if b, _ := io.ReadAll(w.gate); string(b) != "g" {
			t.Fatalf("the gate gave %q, want g", b)
		}
		w.in.Close()
		if sig := signalOf(<-done); sig != syscall.SIGKILL {
			t.Fatalf("the group got %v, want SIGKILL", sig)
		}
		if err := w.cmd.Wait(); err != nil {
			t.Fatal(err)
		}
		if out, _ := io.ReadAll(w.report); len(out) != 0 {
			t.Fatalf("report %q, want nothing: it did not fire", out)
		}
	})
	t.Run("deadline", func(t *testing.T) {
		w := startWatchdogProc(t, time.Hour)
		pid, done := sleeper(t)
		w.send(t, "group %d", pid)
		if b, _ := io.ReadAll(w.gate); string(b) != "g" {
			t.Fatalf("the gate gave %q, want g", b)
		}
		w.send(t, "end %d", monoNow()+int64(100*time.Millisecond))
		if sig := signalOf(<-done); sig != syscall.SIGTERM {
			t.Fatalf("the group got %v, want SIGTERM", sig)
		}
		buf := make([]byte, 6)
		if _, err := io.ReadFull(w.report, buf); err != nil || string(buf) != "fired\n" {
			t.Fatalf("report %q %v, want fired", buf, err)
		}
	})
}
