package main

// An operator's SIGHUP at the worst moment.

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/auth"
	"github.com/dlock/dlock/internal/dlocktest/kit"
)

// TestServeSIGHUPDuringStart: a SIGHUP while dlock serve starts (a
// rotation script or `systemctl reload` while the service restarts, or a
// server slow to open a large refcount.db) must not end it, as Go's
// default action would. The token file is a FIFO so that the test knows,
// without timing, that the process is inside its start-up (reading it).
func TestServeSIGHUPDuringStart(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "tokens")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Skipf("mkfifo: %v", err)
	}
	var logs kit.Buffer
	cmd := exec.Command(dlockBinary(t), "serve", "--listen", "127.0.0.1:0", "--data-dir", "", "--token-file", fifo)
	cmd.Stderr = &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(time.Minute):
			// A failed test may leave it blocked opening the FIFO.
			_ = cmd.Process.Kill()
			<-exited
		}
	})
	// A writer opens without blocking once the server has the FIFO open
	// for reading: it is then reading its token file, mid start-up.
	var w *os.File
	openWriter := func() {
		t.Helper()
		kit.WaitFor(t, "dlock serve to open its token file", func() bool {
			fd, err := syscall.Open(fifo, syscall.O_WRONLY|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
			if err != nil {
				return false
			}
			w = os.NewFile(uintptr(fd), fifo)
			return true
		})
	}
	openWriter()
	if err := cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	// Nothing is written yet, so the process cannot leave its start-up:
	// once the signal is no longer pending it was handled there.
	pid := cmd.Process.Pid
	kit.WaitFor(t, "the SIGHUP to be delivered", func() bool {
		select {
		case err := <-exited:
			exited <- err
			return true
		default:
		}
		return !hupPending(pid)
	})
	line := auth.NewToken() + " node-a\n"
	_, _ = io.WriteString(w, line)
	w.Close()
	var err error
	kit.WaitFor(t, "dlock serve to serve or exit", func() bool {
		select {
		case err = <-exited:
			exited <- err // for the cleanup
			return true
		default:
			return strings.Contains(logs.String(), "dlock serving")
		}
	})
	if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
		t.Fatalf("a SIGHUP during start-up ended dlock serve: %v\n%s", err, logs.String())
	}
	// The SIGHUP is a reload once the server runs: it reads the token
	// file again.
	openWriter()
	_, _ = io.WriteString(w, line)
	w.Close()
	kit.WaitFor(t, "the reload the SIGHUP asked for", func() bool {
		return strings.Contains(logs.String(), "token file reloaded")
	})
}

// hupPending reports whether SIGHUP is pending for process pid or one of
// its threads (/proc/PID/status ShdPnd, /proc/PID/task/*/status SigPnd).
func hupPending(pid int) bool {
	files, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/status", pid))
	files = append(files, fmt.Sprintf("/proc/%d/status", pid))
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(data), "\n") {
			k, v, ok := strings.Cut(line, ":")
			if !ok || (k != "ShdPnd" && k != "SigPnd") {
				continue
			}
			if mask, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64); err == nil && mask&(1<<(uint(syscall.SIGHUP)-1)) != 0 {
				return true
			}
		}
	}
	return false
}
