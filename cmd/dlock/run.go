package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"syscall"
	"time"
)

// ExitLockLost is dlock run's exit status when the lock was lost while the
// command ran and the command was stopped (EX_TEMPFAIL: try again).
const ExitLockLost = 75

// errLostStopped is the failure dlock run reports for a hold it gave up.
var errLostStopped = errors.New("lock lost: the command was stopped")

// cmdRun is the distributed flock(1): it takes the lock, runs the command,
// and unlocks with the command's outcome. It returns the command's exit
// status as an exitStatus.
func cmdRun(ctx context.Context, args []string, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) error {
	f := newClientFlags("run", fmt.Sprintf("%s:%d", hostname(), os.Getpid()), stderr)
	always := f.fs.Bool("always", false, "run even if the operation was completed successfully moments ago")
	skipCode := f.fs.Int("skip-exit-code", 0, "exit status when the command is skipped because another node did the work")
	renew := f.fs.Duration("renew-interval", 10*time.Second, "how often the held lock is checked (and a ttl lease renewed) while the command runs")
	killAfter := f.fs.Duration("kill-after", 5*time.Second, "with a server that gives no lease guarantee: how long after SIGTERM a command whose lock was lost gets SIGKILL")
	retries := f.fs.Int("max-retries", 10, "how often a request is retried when the server refuses it for load (429/503, after its Retry-After, at most 30s) or the network fails; 0: never")
	req, err := f.parse(args, getenv, true)
	if err != nil {
		return err
	}
	argv := f.fs.Args()
	if len(argv) == 0 {
		return usageError{errors.New("run needs a command: dlock run [flags] -- CMD [ARGS...]")}
	}
	req.SkipRecent = !*always
	c, err := f.client()
	if err != nil {
		return err
	}
	c.RenewInterval = *renew
	// A run waits as long as it takes: a server refusing for load is
	// asked again when it says, up to --max-retries times per request.
	c.MaxRetries = *retries
	if *retries <= 0 {
		c.MaxRetries = -1
	}
	defer c.Close()

	// Signals: while waiting they cancel the wait (ctx); while the command
	// runs they are passed on to it.
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	waitCtx, cancelWait := context.WithCancelCause(ctx)
	errInterrupted := errors.New("interrupted while waiting for the lock")
	watching := make(chan struct{})
	go func() {
		defer close(watching)
		select {
		case <-sigs:
			cancelWait(errInterrupted)
		case <-waitCtx.Done():
		}
	}()

	res, err := c.Lock(waitCtx, req)
	cancelWait(nil)
	<-watching // from here on signals go to the command
	if errors.Is(context.Cause(waitCtx), errInterrupted) {
		if res.Acquired {
			_ = c.Unlock(context.WithoutCancel(ctx), req, errInterrupted)
		}
		return errInterrupted
	}
	if err != nil {
		return err
	}
	if res.Skipped {
		by := res.SkippedBy
		if by == "" {
			by = "another node"
		}
		fmt.Fprintf(stderr, "skipped: done by %s\n", by)
		return exitStatus(*skipCode)
	}

	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdin, stdout, stderr
	cmd.Env = append(os.Environ(), "DLOCK_FENCING_TOKEN="+strconv.FormatUint(res.Token, 10))
	// Its own process group, so that a lost lock stops the command and
	// every process it started; and killed if dlock dies, so that it never
	// runs on unwatched (docs/DESIGN.md, "Leases").
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	unlockCtx := context.WithoutCancel(ctx)
	if err := cmd.Start(); err != nil {
		_ = c.Unlock(unlockCtx, req, err)
		return err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	group := -cmd.Process.Pid
	var interrupted, lost bool
	var waitErr error
	var kill <-chan time.Time
wait:
	for {
		select {
		case waitErr = <-exited:
			break wait
		case s := <-sigs:
			interrupted = true
			_ = syscall.Kill(group, s.(syscall.Signal))
		case <-res.Lost:
			// The lease ran out a margin before any server may hand the
			// lock on: the command gets SIGTERM now and SIGKILL half the
			// margin later, so that it is gone before the next holder
			// starts.
			lost, res.Lost = true, nil
			after := res.Margin / 2
			if after <= 0 {
				after = *killAfter
			}
			fmt.Fprintf(stderr, "dlock: lock lost while the command ran; stopping it (SIGTERM, SIGKILL in %v)\n", after)
			_ = syscall.Kill(group, syscall.SIGTERM)
			kill = time.After(after)
		case <-kill:
			kill = nil
			_ = syscall.Kill(group, syscall.SIGKILL)
		}
	}
	if lost {
		// Whatever of the group is left goes too.
		_ = syscall.Kill(group, syscall.SIGKILL)
	}
	status := cmd.ProcessState.ExitCode()
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		status = 128 + int(ws.Signal())
	}
	var opErr error
	switch {
	case interrupted:
		opErr = errors.New("interrupted by a signal")
	case waitErr != nil:
		opErr = fmt.Errorf("%s: %v", argv[0], waitErr)
	}
	if lost {
		// The command is gone: a hold the server still has goes on to the
		// next in line now, as a failure, rather than at its lease's end.
		_ = c.Unlock(unlockCtx, req, errLostStopped)
		fmt.Fprintln(stderr, "dlock: lock lost while the command ran; the command was stopped")
		return exitStatus(ExitLockLost)
	}
	if err := c.Unlock(unlockCtx, req, opErr); err != nil {
		fmt.Fprintln(stderr, "dlock: unlock:", err)
		if status == 0 {
			status = 1
		}
	}
	return exitStatus(status)
}
