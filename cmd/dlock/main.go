// Command dlock is the dlock lock server (dlock serve) and its command-line
// client (lock, unlock, status, refcount, run), with a load generator (bench).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if code, ok := internalMain(os.Args[1:]); ok {
		os.Exit(code)
	}
	err := run(context.Background(), os.Args[1:], os.Getenv, os.Stdin, os.Stdout, os.Stderr)
	os.Exit(exitCode(err, os.Stderr))
}

// exitCode maps run's error to the process status: 0, a command's own
// status (dlock run), 2 for a bad command line, 1 for anything else.
func exitCode(err error, stderr io.Writer) int {
	var st exitStatus
	var ue usageError
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return 0
	case errors.As(err, &st):
		return int(st)
	case errors.As(err, &ue):
		fmt.Fprintln(stderr, "dlock:", err)
		return 2
	}
	fmt.Fprintln(stderr, "dlock:", err)
	return 1
}

const usage = `usage: dlock <command> [flags]

server:
  serve      run the lock server
  token      token new NODE_ID: a line for the server's --token-file

client (flags: --server, --node, --type, --resource, --human, --source-addr, and
        the credentials --ca, --cert, --key, --token-file; env DLOCK_<FLAG>; --server takes
        several servers of one lock service as URL1,URL2,…, and moves to the
        next when one fails):
  lock       take a lock, or join its queue, with a ttl lease (repeat to renew)
  unlock     release a lock: success, or --fail MESSAGE
  status     show a lock's holder, queue and last completion
  refcount   show, --add or --release a resource's references
  run        run a command under a lock: dlock run --resource R -- CMD [ARGS...]

  bench      load generator: dlock bench [--scenario pairs,handoff,fanout,sessions,memory,pings,
             failover,fleet,cutoff] [--backend etcd]
             [--compare redis,etcd] [--json]

'dlock <command> -h' lists a command's flags.
`

func run(ctx context.Context, args []string, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return usageError{errors.New("no command given")}
	}
	cmd, args := args[0], args[1:]
	switch cmd {
	case "serve":
		ctx, stop := signal.NotifyContext(ctx, syscall.SIGINT, syscall.SIGTERM)
		defer stop()
		return serve(ctx, args, getenv, stderr)
	case "token":
		return cmdToken(args, stdout, stderr)
	case "lock":
		return cmdLock(ctx, args, getenv, stdout, stderr)
	case "unlock":
		return cmdUnlock(ctx, args, getenv, stdout, stderr)
	case "status":
		return cmdStatus(ctx, args, getenv, stdout, stderr)
	case "refcount":
		return cmdRefcount(ctx, args, getenv, stdout, stderr)
	case "run":
		return cmdRun(ctx, args, getenv, stdin, stdout, stderr)
	case "bench":
		ctx, stop := signal.NotifyContext(ctx, syscall.SIGINT, syscall.SIGTERM)
		defer stop()
		return cmdBench(ctx, args, getenv, stdout, stderr)
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, usage)
		return nil
	}
	fmt.Fprint(stderr, usage)
	return usageError{fmt.Errorf("unknown command %q", cmd)}
}
