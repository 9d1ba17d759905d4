package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
	"time"
)

// cmdRun is the distributed flock(1): it takes the lock, runs the command,
// and unlocks with the command's outcome. It returns the command's exit
// status as an exitStatus.
func cmdRun(ctx context.Context, args []string, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) error {
	f := newClientFlags("run", fmt.Sprintf("%s:%d", hostname(), os.Getpid()), stderr)
	always := f.fs.Bool("always", false, "run even if the operation was completed successfully moments ago")
	skipCode := f.fs.Int("skip-exit-code", 0, "exit status when the command is skipped because another node did the work")
	renew := f.fs.Duration("renew-interval", 10*time.Second, "how often the held lock is checked (and a ttl lease renewed) while the command runs")
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
	unlockCtx := context.WithoutCancel(ctx)
	if err := cmd.Start(); err != nil {
		_ = c.Unlock(unlockCtx, req, err)
		return err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	var interrupted, lost bool
	var waitErr error
wait:
	for {
		select {
		case waitErr = <-exited:
			break wait
		case s := <-sigs:
			interrupted = true
			_ = cmd.Process.Signal(s)
		case <-res.Lost:
			if !lost {
				lost = true
				fmt.Fprintln(stderr, "dlock: lock lost while the command ran; stopping it")
				_ = cmd.Process.Signal(syscall.SIGTERM)
			}
			res.Lost = nil
		}
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
		return errors.New("lock lost while the command ran")
	}
	if err := c.Unlock(unlockCtx, req, opErr); err != nil {
		fmt.Fprintln(stderr, "dlock: unlock:", err)
		if status == 0 {
			status = 1
		}
	}
	return exitStatus(status)
}
