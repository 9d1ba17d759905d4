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

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"
)

// ExitLockLost is dlock run's exit status when the lock was lost while the
// command ran and the command was stopped (EX_TEMPFAIL: try again).
const ExitLockLost = 75

// errLostStopped is the failure dlock run reports for a hold it gave up.
var errLostStopped = errors.New("lock lost: the command was stopped")

// errLostBeforeStart is the failure for a hold lost before its command ran.
var errLostBeforeStart = errors.New("lock lost before the command started")

// runCommand is the distributed flock(1): it takes the lock, runs the
// command, and unlocks with the command's outcome. It returns the
// command's exit status as an exitStatus.
func (e *cli) runCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "run --resource R [flags] -- CMD [ARGS...]",
		Short: "Run a command under a lock: the distributed flock(1)",
		Long: `run waits for --resource's lock (queued behind its holder if need be), runs CMD,
unlocks with success if CMD exits 0 and with failure otherwise, and exits
with CMD's status. If another node completes the same operation while it
waits, or completed it within the server's --completed-retention (--always
turns that off), CMD does not run: run prints "skipped: done by NODE" and
exits 0 (--skip-exit-code N).

CMD runs in a process group of its own, with the grant's fencing token in
DLOCK_FENCING_TOKEN. While it runs the lock is kept; if the lock is lost,
CMD's group gets SIGTERM, then SIGKILL, and run exits 75. SIGINT and SIGTERM
are passed on to CMD, and the lock is released as a failure. The flags end
at CMD: write them before it, and "--" before CMD when CMD has flags.`,
		Example: `  dlock run --resource sha256:aaa -- sh -c 'echo downloading; sleep 1'
  dlock run --resource sha256:aaa --skip-exit-code 3 --token-file /etc/dlock/token -- ./fetch.sh sha256:aaa`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usageError{errors.New("run needs a command: dlock run [flags] -- CMD [ARGS...]")}
			}
			// An exit status is a byte: 300 would leave the process as 44,
			// which a script would take for something else.
			if n, _ := cmd.Flags().GetInt("skip-exit-code"); n < 0 || n > 255 {
				return usageError{fmt.Errorf("--skip-exit-code %d: an exit status is 0 to 255", n)}
			}
			return nil
		},
		Annotations: map[string]string{annotationStopAtArg: "true"},
	}
	cmd.Flags().SetInterspersed(false)
	f := addClientFlags(cmd.Flags(), fmt.Sprintf("%s:%d", hostname(), os.Getpid()))
	o := runOptions{
		always:    cmd.Flags().Bool("always", false, "run even if the operation was completed successfully moments ago"),
		skipCode:  cmd.Flags().Int("skip-exit-code", 0, "exit status when the command is skipped because another node did the work"),
		renew:     cmd.Flags().Duration("renew-interval", 10*time.Second, "how often the held lock is checked (and a ttl lease renewed) while the command runs"),
		killAfter: cmd.Flags().Duration("kill-after", 5*time.Second, "with a server that gives no lease guarantee: how long after SIGTERM a command whose lock was lost gets SIGKILL"),
		retries:   cmd.Flags().Int("max-retries", 10, "how often a request is retried when the server refuses it for load (429/503, after its Retry-After, at most 30s) or the network fails; 0: never"),
	}
	cmd.RunE = e.action(func(cmd *cobra.Command, argv []string) error {
		return f.run(e.ctx, o, argv, e.stdin, e.stdout, e.stderr)
	})
	return cmd
}

// runOptions are dlock run's own flags.
type runOptions struct {
	always            *bool
	skipCode, retries *int
	renew, killAfter  *time.Duration
}

func (f *clientFlags) run(ctx context.Context, o runOptions, argv []string, stdin io.Reader, stdout, stderr io.Writer) error {
	always, skipCode, renew, killAfter, retries := o.always, o.skipCode, o.renew, o.killAfter, o.retries
	if *renew <= 0 {
		// The client would take it for its default: say so instead.
		return usageError{fmt.Errorf("--renew-interval must be positive, not %v", *renew)}
	}
	req, err := f.check(true)
	if err != nil {
		return err
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
	err = f.explain(err)
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

	unlockCtx := context.WithoutCancel(ctx)
	fail := func(err error) error {
		_ = c.Unlock(unlockCtx, req, err)
		return err
	}
	select {
	case <-res.Lost:
		// Granted, but vouched for less than the lease margin (a server
		// that cannot reach etcd): the command does not start.
		_ = c.Unlock(unlockCtx, req, errLostBeforeStart)
		fmt.Fprintln(stderr, "dlock: lock lost before the command started (its server vouched for less than the lease margin); not running it")
		return exitStatus(ExitLockLost)
	default:
	}
	path, err := exec.LookPath(argv[0])
	if err != nil {
		return fail(err)
	}
	after := res.Margin / 2
	if after <= 0 {
		after = *killAfter
	}

	// The watchdog stops the command when the lease runs out and dlock
	// run cannot (paused, stalled). The command starts behind a gate
	// that the watchdog opens once it knows the command's group, so that
	// the command never runs unwatched (watchdog.go).
	gateR, gateW, err := os.Pipe()
	if err != nil {
		return fail(err)
	}
	wd, err := startWatchdog(after, gateW, stderr)
	gateW.Close()
	if err != nil {
		gateR.Close()
		return fail(fmt.Errorf("starting the watchdog: %w", err))
	}
	select {
	case end := <-res.LeaseEnds: // the grant's, before the command starts
		_ = wd.setEnd(end)
	default: // a server that gives no guarantee
	}
	cmd := exec.Command(selfExe, append([]string{execArg, path}, argv...)...)
	cmd.Args[0] = argv[0]
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdin, stdout, stderr
	cmd.Env = append(os.Environ(), "DLOCK_FENCING_TOKEN="+strconv.FormatUint(res.Token, 10))
	cmd.ExtraFiles = []*os.File{gateR}
	// Its own process group, so that a lost lock stops the command and
	// every process it started; and killed if dlock dies, so that it never
	// runs on unwatched (docs/DESIGN.md, "Leases").
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	err = cmd.Start()
	gateR.Close()
	if err != nil {
		wd.stop()
		return fail(err)
	}
	group := -cmd.Process.Pid
	_ = wd.setGroup(cmd.Process.Pid)

	// Each later end of the lease goes to the watchdog.
	stopForward, forwarded := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(forwarded)
		for {
			select {
			case end := <-res.LeaseEnds:
				if wd.setEnd(end) != nil {
					return
				}
			case <-stopForward:
				return
			}
		}
	}()
	// The leader's exit is seen without reaping it: its number, the
	// group's, stays the command's until the watchdog, which signals the
	// group, is gone.
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		var info unix.Siginfo
		for unix.Waitid(unix.P_PID, cmd.Process.Pid, &info, unix.WEXITED|unix.WNOWAIT, nil) == unix.EINTR {
		}
	}()
	var interrupted, lost, wdFired bool
	var kill <-chan time.Time
	wdGone := wd.gone
wait:
	for {
		select {
		case <-exited:
			break wait
		case s := <-sigs:
			interrupted = true
			_ = syscall.Kill(group, s.(syscall.Signal))
		case <-res.Lost:
			if leaderExited(cmd.Process.Pid) {
				// The command ended already (dlock run was paused
				// past its lease, say): by itself, or stopped by
				// the watchdog, which tells which.
				break wait
			}
			// The lease ran out a margin before any server may hand the
			// lock on: the command gets SIGTERM now and SIGKILL half the
			// margin later, so that it is gone before the next holder
			// starts.
			lost, res.Lost = true, nil
			fmt.Fprintf(stderr, "dlock: lock lost while the command ran; stopping it (SIGTERM, SIGKILL in %v)\n", after)
			_ = syscall.Kill(group, syscall.SIGTERM)
			kill = time.After(after)
		case <-kill:
			kill = nil
			_ = syscall.Kill(group, syscall.SIGKILL)
		case <-wdGone:
			// It exits by itself only once it has killed the group.
			wdGone = nil
			if !wd.fired {
				fmt.Fprintf(stderr, "dlock: the watchdog ended (%v); the command runs on, watched by dlock run alone\n", wd.err)
			}
		}
	}
	close(stopForward)
	wdFired = wd.stop()
	<-forwarded
	if wdFired && !lost {
		// dlock run did not act in time (paused, stalled): its watchdog
		// did.
		lost = true
		fmt.Fprintln(stderr, "dlock: the lease ran out while dlock run could not act; its watchdog stopped the command")
	}
	if lost {
		// Whatever of the group is left goes too.
		_ = syscall.Kill(group, syscall.SIGKILL)
	}
	waitErr := cmd.Wait()
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
		fmt.Fprintln(stderr, "dlock: unlock:", message(f.explain(err)))
		if status == 0 {
			status = 1
		}
	}
	return exitStatus(status)
}

// leaderExited says, without waiting and without reaping it, whether the
// child pid has exited.
func leaderExited(pid int) bool {
	var info unix.Siginfo // zeroed by the kernel when none has
	err := unix.Waitid(unix.P_PID, pid, &info, unix.WEXITED|unix.WNOWAIT|unix.WNOHANG, nil)
	return err == nil && info.Signo != 0
}
