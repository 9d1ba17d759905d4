package netfault

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
)

// Freeze stops process pid with SIGSTOP, as a machine that froze or a
// process in a long pause: it keeps its sockets open and answers nothing
// (the kernel still acknowledges what fits in its buffers). It returns once
// every thread of the process is stopped, and registers at t's cleanup the
// SIGCONT that Thaw sends. A pid of this process, or one below 1 (a
// process group, every process), fails the test.
func Freeze(t testing.TB, pid int) {
	t.Helper()
	if err := checkPid(pid); err != nil {
		t.Fatalf("netfault: Freeze(%d): %v", pid, err)
	}
	t.Cleanup(func() {
		if err := Thaw(pid); err != nil && !errors.Is(err, syscall.ESRCH) {
			t.Errorf("netfault: thawing %d: %v", pid, err)
		}
	})
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatalf("netfault: Freeze(%d): %v", pid, err)
	}
	// A stop is delivered when each thread next runs: wait for all.
	kit.Await(t, fmt.Sprintf("process %d to stop", pid), func() error { return stopped(pid) })
}

// Suspend is Freeze for a program that is not a test (dlock bench): it
// stops pid with SIGSTOP and returns once every thread is stopped, or an
// error after kit.Patience. The caller thaws it (Thaw).
func Suspend(pid int) error {
	if err := checkPid(pid); err != nil {
		return fmt.Errorf("suspending %d: %w", pid, err)
	}
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		return fmt.Errorf("suspending %d: %w", pid, err)
	}
	deadline := time.Now().Add(kit.Patience)
	for {
		err := stopped(pid)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("process %d did not stop within %v: %w", pid, kit.Patience, err)
		}
		time.Sleep(time.Millisecond)
	}
}

// Thaw lets process pid go on with SIGCONT. Thawing a process that is not
// frozen does nothing; one that is gone is ESRCH.
func Thaw(pid int) error {
	if err := checkPid(pid); err != nil {
		return err
	}
	return syscall.Kill(pid, syscall.SIGCONT)
}

func checkPid(pid int) error {
	switch {
	case pid < 1:
		return fmt.Errorf("%d names no single process", pid)
	case pid == os.Getpid():
		return errors.New("the test's own process")
	}
	return nil
}

// stopped is nil once every thread of pid is stopped, and says what it
// saw otherwise.
func stopped(pid int) error {
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", pid))
	if err != nil {
		return err
	}
	if len(tasks) == 0 {
		return fmt.Errorf("process %d is gone", pid)
	}
	for _, stat := range tasks {
		state, err := statState(stat)
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				continue // a thread that ended
			}
			return err
		}
		if state != 'T' && state != 't' {
			return fmt.Errorf("%s: state %c", stat, state)
		}
	}
	return nil
}

// State is the state letter /proc/<pid>/stat gives for process pid (its
// main thread): 'R' running, 'S' sleeping, 'T' stopped, 'Z' a zombie...
func State(pid int) (byte, error) {
	return statState(fmt.Sprintf("/proc/%d/stat", pid))
}

// statState reads the state field of a /proc stat file: the one after the
// command's name, which is in parentheses and may hold any byte.
func statState(path string) (byte, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	s := string(raw)
	i := strings.LastIndexByte(s, ')')
	if i < 0 || i+2 >= len(s) {
		return 0, fmt.Errorf("%s: cannot read %q", path, s)
	}
	return s[i+2], nil
}
