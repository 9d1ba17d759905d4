package netfault

import (
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"

	"github.com/dlock/dlock/internal/dlocktest/kit"
)

// echoChild starts this test binary as a child that echoes its input
// (TestMain), and returns its pid with the pipes to it.
func echoChild(t *testing.T) (pid int, in, out *os.File) {
	t.Helper()
	inR, inW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "NETFAULT_HELPER=echo")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = inR, outW, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	inR.Close()
	outW.Close()
	t.Cleanup(func() {
		inW.Close()
		outR.Close()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return cmd.Process.Pid, inW, outR
}

// expectState waits until pid's state is one of states.
func expectState(t *testing.T, pid int, states string) {
	t.Helper()
	kit.Await(t, fmt.Sprintf("process %d in state %s", pid, states), func() error {
		s, err := State(pid)
		if err != nil {
			return err
		}
		for i := range len(states) {
			if s == states[i] {
				return nil
			}
		}
		return fmt.Errorf("state %c", s)
	})
}

// TestFreeze: a frozen child is in state T and answers nothing; thawed,
// it answers what it was sent while frozen; the cleanup of a test that
// froze it thaws it.
func TestFreeze(t *testing.T) {
	pid, in, out := echoChild(t)
	send(t, in, "1")
	expect(t, out, "1")

	Freeze(t, pid)
	if s, err := State(pid); err != nil || s != 'T' {
		t.Fatalf("state %c, %v after Freeze; want T", s, err)
	}
	send(t, in, "2")
	expectQuiet(t, out, "a frozen child")
	if err := Thaw(pid); err != nil {
		t.Fatal(err)
	}
	expect(t, out, "2")
	expectState(t, pid, "RS")

	t.Run("frozen until cleanup", func(t *testing.T) {
		Freeze(t, pid)
		send(t, in, "3")
		expectQuiet(t, out, "a frozen child")
	})
	expect(t, out, "3")
	expectState(t, pid, "RS")
}

// TestFreezeRefuses: pids that name no single process, and the test's
// own, are refused rather than signalled.
func TestFreezeRefuses(t *testing.T) {
	for _, pid := range []int{0, -1, os.Getpid()} {
		o := kit.Catch(t, func(tb testing.TB) { Freeze(tb, pid) })
		if o.FatalMsg == "" {
			t.Errorf("Freeze(%d) did not fail", pid)
		}
		if err := Thaw(pid); err == nil {
			t.Errorf("Thaw(%d) did not fail", pid)
		}
	}
}

// TestSuspend: Suspend, for programs that are not tests, returns with
// every thread stopped; Thaw lets the process go on; a pid of this
// process is refused.
func TestSuspend(t *testing.T) {
	pid, _, _ := echoChild(t)
	if err := Suspend(pid); err != nil {
		t.Fatal(err)
	}
	if err := stopped(pid); err != nil {
		t.Fatalf("after Suspend: %v", err)
	}
	if err := Thaw(pid); err != nil {
		t.Fatal(err)
	}
	expectState(t, pid, "RS")
	if err := Suspend(os.Getpid()); err == nil {
		t.Fatal("Suspend of the test's own process: no error")
	}
}
