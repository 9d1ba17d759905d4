package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// dlock run's helpers are the dlock binary itself, run again with one of
// these as its first argument: internal, and not in the usage.
const (
	// watchdogArg runs the watchdog: `dlock __watchdog KILL_AFTER`.
	watchdogArg = "__watchdog"
	// execArg runs the gate in front of the command:
	// `dlock __exec PATH ARGV0 ARGS...`.
	execArg = "__exec"
)

// selfExe is the running binary, even if its file was replaced or removed
// since it started.
const selfExe = "/proc/self/exe"

// internalMain runs a helper of dlock run when args (os.Args[1:]) name one,
// and says whether it did; the helper's exit status is then code.
func internalMain(args []string) (code int, ok bool) {
	if len(args) == 0 {
		return 0, false
	}
	switch args[0] {
	case watchdogArg:
		return watchdogMain(args[1:], os.Stdin, os.Stdout, os.Stderr, os.NewFile(3, "gate")), true
	case execArg:
		return execMain(args[1:], os.NewFile(3, "gate"), os.Stderr), true
	}
	return 0, false
}

// The watchdog: dlock run's deputy, a process of its own that stops the
// command when the client-side lease runs out while dlock run cannot act
// (paused by SIGSTOP or a debugger, or stalled), as dlock run would itself:
// SIGTERM to the command's process group at the lease's end, SIGKILL
// KILL_AFTER (half the lease margin) after it (docs/DESIGN.md, "Leases").
//
// Its standard input is a pipe from dlock run, one line per message:
//
//	end N    the lease ends at N, in nanoseconds of CLOCK_MONOTONIC
//	group G  the command's process group, whose leader is process G
//
// An end is a moment of the monotonic clock that every process of the host
// reads alike, not a duration: a duration is stale by however long it took
// to be read, and dlock run may be paused between taking the lease's end
// and writing it, which would push the deadline past the lease by the
// length of the pause. dlock run reads the clock before it turns the
// lease's end into a moment of it, so that a pause there moves the
// deadline earlier, never later. Nor is it a wall-clock time, which may
// jump.
//
// End of file on its input means that dlock run is gone (it died or was
// killed: dlock run never closes the pipe while the watchdog lives, but
// kills it first, SIGKILL, and reaps it). The command's leader got SIGKILL
// then already, from its Pdeathsig; the watchdog gives the same to the
// rest of the group at once, which is never later than the deadline, and
// exits. So it needs no Pdeathsig of its own: that would kill it with
// dlock run, before it could take the rest of the group.
//
// Once it has the group it opens the gate (fd 3): one byte, which lets the
// command start (execMain); so the command never runs before the watchdog
// knows its group and its deadline. A group that comes after the deadline
// is stopped at once, and its gate is closed without the byte.
//
// At the deadline the watchdog first checks that the command's leader
// still runs: dlock run reaps the leader only after the watchdog is gone,
// so a leader that exited is still there, a zombie. A command that ended
// before its lease did is not stopped, nor reported as stopped: the
// watchdog waits, disarmed, for dlock run to kill it. Otherwise it writes
// "fired" to its standard output, a pipe dlock run reads once it has
// reaped the watchdog, and only then signals the group; after the SIGKILL
// it exits.
//
// It is in a process group of its own and ignores the signals a terminal
// or a supervisor sends (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGTSTP, ...):
// a ^Z that stops dlock run leaves its watchdog running. SIGKILL and
// SIGSTOP cannot be ignored: a watchdog stopped together with dlock run
// guards nothing.
func watchdogMain(args []string, in io.Reader, report, stderr io.Writer, gate *os.File) int {
	signal.Ignore(syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT,
		syscall.SIGTSTP, syscall.SIGTTIN, syscall.SIGTTOU, syscall.SIGPIPE)
	// Its name in ps and top, rather than "exe" (selfExe).
	_ = os.WriteFile("/proc/self/comm", []byte("dlock-watchdog"), 0)
	if len(args) != 1 {
		fmt.Fprintln(stderr, "dlock: internal use only")
		return 2
	}
	killAfter, err := time.ParseDuration(args[0])
	if err != nil || killAfter < 0 {
		fmt.Fprintf(stderr, "dlock: watchdog: bad kill-after %q\n", args[0])
		return 2
	}
	msgs := make(chan watchdogMsg)
	go readWatchdogMsgs(in, msgs, stderr)

	var (
		end      int64 = -1 // the lease's end; -1: none yet
		group    int        // the command's process group; 0: not yet
		fired    bool       // SIGTERM sent; SIGKILL at killAt
		killAt   int64
		disarmed bool // the leader exited before the deadline
	)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	for {
		select {
		case m := <-msgs:
			switch m.kind {
			case msgEOF:
				if group != 0 {
					// dlock run is gone, and with it the leader
					// (Pdeathsig). The group's number stays the
					// group's while any of it is left, so this
					// reaches the command's processes only.
					_ = syscall.Kill(-group, syscall.SIGKILL)
					fmt.Fprintf(stderr, "dlock: dlock run is gone: its watchdog killed the command (process group %d)\n", group)
				}
				return 0
			case msgEnd:
				if !fired {
					end = m.n
				}
			case msgGroup:
				if group == 0 {
					group = int(m.n)
				}
			}
		case <-timer.C:
		}
		now := monoNow()
		if !fired && !disarmed && group != 0 && end >= 0 && now >= end {
			if leaderGone(group) {
				disarmed = true
			} else {
				fmt.Fprintln(report, "fired")
				_ = syscall.Kill(-group, syscall.SIGTERM)
				fired, killAt = true, end+int64(killAfter)
			}
		}
		if fired && now >= killAt {
			_ = syscall.Kill(-group, syscall.SIGKILL)
			if gate != nil {
				gate.Close()
			}
			return 0
		}
		if group != 0 && gate != nil {
			if !fired {
				_, _ = gate.Write([]byte{'g'})
			}
			gate.Close()
			gate = nil
		}
		timer.Stop()
		switch {
		case fired:
			timer.Reset(time.Duration(killAt - now))
		case !disarmed && group != 0 && end >= 0:
			timer.Reset(time.Duration(end - now))
		}
	}
}

type watchdogMsgKind int

const (
	msgEOF watchdogMsgKind = iota
	msgEnd
	msgGroup
)

type watchdogMsg struct {
	kind watchdogMsgKind
	n    int64
}

// readWatchdogMsgs parses the watchdog's input into msgs; the last is
// msgEOF, at the end of the input or a read error.
func readWatchdogMsgs(in io.Reader, msgs chan<- watchdogMsg, stderr io.Writer) {
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		word, num, _ := strings.Cut(sc.Text(), " ")
		n, err := strconv.ParseInt(num, 10, 64)
		switch {
		case err != nil || n < 0:
		case word == "end":
			msgs <- watchdogMsg{msgEnd, n}
			continue
		case word == "group" && n > 1:
			msgs <- watchdogMsg{msgGroup, n}
			continue
		}
		fmt.Fprintf(stderr, "dlock: watchdog: bad message %q\n", sc.Text())
	}
	msgs <- watchdogMsg{kind: msgEOF}
}

// leaderGone says whether process group g's leader has exited: it is a
// zombie, or gone, or its number is another process's now.
func leaderGone(g int) bool {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", g))
	if err != nil {
		return true
	}
	// The fields after the command's name, which is in parentheses and
	// may hold any byte: state, ppid, pgrp, ...
	s := string(raw)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return true
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 3 || f[0] == "Z" || f[0] == "X" {
		return true
	}
	return f[2] != strconv.Itoa(g)
}

// monoNow reads CLOCK_MONOTONIC, the clock Go's timers and time.Since run
// on, in nanoseconds; every process of the host reads the same one.
func monoNow() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		panic(fmt.Sprintf("dlock: reading CLOCK_MONOTONIC: %v", err))
	}
	return ts.Nano()
}

// execMain is the command's process until the watchdog has its group:
// it waits for the gate's byte, then becomes the command (execve: the same
// process, group and Pdeathsig). args are the path of the command's
// program and its argv. Without the byte (the watchdog stopped the group
// first, or is gone) the command never starts.
func execMain(args []string, gate *os.File, stderr io.Writer) int {
	if len(args) < 2 {
		fmt.Fprintln(stderr, "dlock: internal use only")
		return 2
	}
	var b [1]byte
	n, _ := gate.Read(b[:])
	gate.Close()
	if n != 1 || b[0] != 'g' {
		fmt.Fprintln(stderr, "dlock: the command was not started: its watchdog did not let it")
		return 1
	}
	err := syscall.Exec(args[0], args[1:], os.Environ())
	fmt.Fprintf(stderr, "dlock: %s: %v\n", args[1], err)
	if errors.Is(err, syscall.ENOENT) {
		return 127
	}
	return 126
}

// watchdog is dlock run's end of its watchdog process.
type watchdog struct {
	cmd    *exec.Cmd
	mu     sync.Mutex
	in     *os.File      // the watchdog's input
	report *os.File      // its output: "fired" once it signalled the group
	gone   chan struct{} // closed once it is reaped
	err    error         // how it ended, once gone is closed
	fired  bool          // it had signalled the group, once gone is closed
}

// startWatchdog starts the watchdog (watchdogMain), with killAfter between
// its SIGTERM and its SIGKILL and the write end of the command's gate.
func startWatchdog(killAfter time.Duration, gate *os.File, stderr io.Writer) (*watchdog, error) {
	inR, inW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	repR, repW, err := os.Pipe()
	if err != nil {
		inR.Close()
		inW.Close()
		return nil, err
	}
	cmd := exec.Command(selfExe, watchdogArg, killAfter.String())
	cmd.Args[0] = "dlock"
	cmd.Stdin, cmd.Stdout, cmd.Stderr = inR, repW, stderr
	cmd.ExtraFiles = []*os.File{gate}
	// A process group of its own: the terminal's signals (^C, ^Z) are
	// for dlock run's group. No Pdeathsig (watchdogMain).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	err = cmd.Start()
	inR.Close()
	repW.Close()
	if err != nil {
		inW.Close()
		repR.Close()
		return nil, err
	}
	w := &watchdog{cmd: cmd, in: inW, report: repR, gone: make(chan struct{})}
	go func() {
		w.err = cmd.Wait()
		// Its output is complete: the watchdog held the only write end.
		out, _ := io.ReadAll(w.report)
		w.report.Close()
		w.fired = strings.Contains(string(out), "fired")
		close(w.gone)
	}()
	return w, nil
}

// setEnd tells the watchdog that the lease ends at end (a time with a
// monotonic clock reading, Result.LeaseEnds).
func (w *watchdog) setEnd(end time.Time) error {
	// The clock first: a pause between the two readings moves the end
	// earlier, never later (watchdogMain).
	now := monoNow()
	at := now + int64(time.Until(end))
	return w.send(fmt.Sprintf("end %d\n", max(at, 0)))
}

// setGroup tells the watchdog the command's process group, and so lets it
// open the command's gate.
func (w *watchdog) setGroup(pgid int) error {
	return w.send(fmt.Sprintf("group %d\n", pgid))
}

func (w *watchdog) send(line string) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	_, err := w.in.WriteString(line)
	return err
}

// stop kills the watchdog, SIGKILL (which a stopped one gets too), reaps
// it, and says whether it had signalled the command's group. Its input is
// closed only then: end of file there means that dlock run is gone.
func (w *watchdog) stop() (fired bool) {
	_ = w.cmd.Process.Kill()
	<-w.gone
	w.mu.Lock()
	w.in.Close()
	w.mu.Unlock()
	return w.fired
}
