// Command dlock is the dlock lock server (dlock serve) and its command-line
// client (lock, unlock, status, refcount, run), with a load generator (bench).
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

func main() {
	if code, ok := internalMain(os.Args[1:]); ok {
		os.Exit(code)
	}
	err := run(context.Background(), os.Args[1:], os.Getenv, os.Stdin, os.Stdout, os.Stderr)
	os.Exit(exitCode(err, os.Stderr))
}

// usageError is a bad command line: exit status 2.
type usageError struct{ error }

func (e usageError) Unwrap() error { return e.error }

// exitStatus ends the process with a status and no further message.
type exitStatus int

func (e exitStatus) Error() string { return fmt.Sprintf("exit status %d", int(e)) }

// exitCode maps run's error to the process status, printing it as one
// line: 0, a command's own status (dlock run), 2 for a bad command line,
// 1 for anything else.
func exitCode(err error, stderr io.Writer) int {
	var st exitStatus
	switch {
	case err == nil:
		return 0
	case errors.As(err, &st):
		return int(st)
	}
	fmt.Fprintln(stderr, "dlock:", message(err))
	if _, ok := errors.AsType[usageError](err); ok {
		return 2
	}
	return 1
}

// cli is what the commands share: the process's streams and environment.
type cli struct {
	ctx            context.Context
	getenv         func(string) string
	stdin          io.Reader
	stdout, stderr io.Writer
	// ran is set once a command's own work begins: an error before it
	// (cobra's or pflag's: an unknown command or flag, a bad value, a
	// stray argument) is a bad command line.
	ran bool
}

// action is a command's RunE: it marks the command line as accepted, so
// that the errors of its work are runtime failures unless they say
// otherwise (usageError).
func (c *cli) action(f func(cmd *cobra.Command, args []string) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		c.ran = true
		return f(cmd, args)
	}
}

// rootCommand is the dlock command line. It is built with cobra, as
// etcdctl's and kubectl's are: one command per subcommand with its help
// and examples, flags that read as --name value, and shell completion
// generated from the same definitions (dlock completion bash|zsh|fish).
func (c *cli) rootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:   "dlock",
		Short: "dlock: a distributed lock service for nodes that share work",
		Long: `dlock is a lock server (dlock serve) and its command-line client: a node takes a
lock on a resource, or joins its queue, does the work and unlocks, and the
next node learns whether the work is done (docs/CLI.md).

The client commands take --server (several servers of one lock service as
URL1,URL2,…: a request that fails for its server moves to the next), --node,
--type, --resource, --human, --source-addr, and the credentials --ca, --cert,
--key and --token-file. Every flag has an environment fallback DLOCK_<FLAG>
(DLOCK_SERVER, DLOCK_NODE, DLOCK_TOKEN_FILE, …); the command line wins.

bench runs the scenarios ` + strings.Join(benchScenarios, ", ") + `.

Exit status: 0, 1 for an error, 2 for a bad command line; dlock run exits with
its command's status.`,
		Example: `  dlock serve --listen 127.0.0.1:7380
  dlock lock --resource sha256:aaa --human
  dlock run --resource sha256:aaa -- sh -c 'echo downloading'
  dlock completion bash > /etc/bash_completion.d/dlock`,
		SilenceErrors: true,
		SilenceUsage:  true,
		// One line per error: exitCode prints it, with a suggestion of
		// our own for a mistyped command.
		DisableSuggestions:         true,
		SuggestionsMinimumDistance: 2,
		PersistentPreRunE: func(cmd *cobra.Command, args []string) error {
			return c.applyEnv(cmd.Flags())
		},
	}
	root.SetIn(c.stdin)
	root.SetOut(c.stdout)
	root.SetErr(c.stderr)
	root.AddGroup(&cobra.Group{ID: "server", Title: "Server:"}, &cobra.Group{ID: "client", Title: "Client:"})
	for _, cmd := range []*cobra.Command{c.serveCommand(), c.tokenCommand(), c.benchCommand()} {
		cmd.GroupID = "server"
		root.AddCommand(cmd)
	}
	for _, cmd := range []*cobra.Command{c.lockCommand(), c.unlockCommand(), c.statusCommand(), c.refcountCommand(), c.runCommand()} {
		cmd.GroupID = "client"
		root.AddCommand(cmd)
	}
	// cobra's own completion command, with a bad command line as every
	// other command's: status 2.
	root.InitDefaultCompletionCmd()
	for _, cmd := range root.Commands() {
		if cmd.Name() != "completion" {
			continue
		}
		cmd.Args = noArgsBut("a shell: bash, zsh, fish or powershell")
		cmd.RunE = c.action(func(cmd *cobra.Command, _ []string) error {
			return usageError{errors.New("completion wants a shell: dlock completion bash|zsh|fish|powershell")}
		})
		cmd.Example = completionExamples["bash"] + "\n" + completionExamples["zsh"] + "\n" + completionExamples["fish"]
		for _, sh := range cmd.Commands() {
			sh.Args = noArgs
			sh.Example = completionExamples[sh.Name()]
		}
	}
	return root
}

// applyEnv sets every flag not given on the command line from DLOCK_<FLAG>.
func (c *cli) applyEnv(fs *pflag.FlagSet) error {
	if err := applyEnv(fs, c.getenv); err != nil {
		return usageError{err}
	}
	return nil
}

func run(ctx context.Context, args []string, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) error {
	c := &cli{ctx: ctx, getenv: getenv, stdin: stdin, stdout: stdout, stderr: stderr}
	root := c.rootCommand()
	if len(args) == 0 {
		fmt.Fprint(stderr, root.UsageString())
		return usageError{errors.New("no command given: dlock COMMAND [flags]; dlock --help says what each does")}
	}
	root.SetArgs(normalizeArgs(root, args))
	cmd, err := root.ExecuteC()
	if err == nil || c.ran {
		return err
	}
	if _, ok := errors.AsType[usageError](err); ok {
		return err
	}
	if cmd == root && strings.HasPrefix(err.Error(), "unknown command") {
		msg := fmt.Sprintf("unknown command %q", args[0])
		if s := root.SuggestionsFor(args[0]); len(s) > 0 {
			msg += fmt.Sprintf(": did you mean %s?", strings.Join(s, " or "))
		}
		return usageError{fmt.Errorf("%s (dlock --help lists the commands)", msg)}
	}
	return usageError{fmt.Errorf("%w (see %s --help)", err, cmd.CommandPath())}
}

// normalizeArgs writes a long flag given with one dash, -resource R, as
// --resource R: the flag package, which dlock used before, took both, and
// scripts may still use the short form. pflag would read -resource as -r
// -e -s …. Arguments after "--", flags' values, and, for a command that
// stops at its first argument (dlock run), everything from it on, are
// left alone.
func normalizeArgs(root *cobra.Command, args []string) []string {
	cmd, rest, err := root.Find(args)
	if err != nil {
		return args
	}
	cmd.InitDefaultHelpFlag()
	fs := pflag.NewFlagSet("", pflag.ContinueOnError)
	fs.AddFlagSet(cmd.Flags())
	fs.AddFlagSet(cmd.InheritedFlags())
	stopAtArg := cmd.Annotations[annotationStopAtArg] == "true"
	path := strings.Fields(cmd.CommandPath())[1:]
	out := append(path, rest...)
	for i := len(path); i < len(out); i++ {
		a := out[i]
		if a == "--" {
			break
		}
		if len(a) < 2 || a[0] != '-' {
			if stopAtArg {
				break
			}
			continue
		}
		name, _, hasValue := strings.Cut(strings.TrimPrefix(a[1:], "-"), "=")
		f := fs.Lookup(name)
		if f == nil {
			continue
		}
		if a[1] != '-' {
			if len(name) < 2 {
				continue // a shorthand, -h
			}
			out[i] = "-" + a
		}
		if !hasValue && f.NoOptDefVal == "" {
			i++ // its value, whatever it looks like
		}
	}
	return out
}

// annotationStopAtArg marks a command whose flags end at its first
// argument (pflag's SetInterspersed(false)).
const annotationStopAtArg = "dlock/stop-at-arg"

// completionExamples load each shell's completion script.
var completionExamples = map[string]string{
	"bash":       "  source <(dlock completion bash)",
	"zsh":        `  dlock completion zsh > "${fpath[1]}/_dlock"`,
	"fish":       "  dlock completion fish > ~/.config/fish/completions/dlock.fish",
	"powershell": "  dlock completion powershell | Out-String | Invoke-Expression",
}

// noArgsBut is the Args of a command whose subcommands are its
// arguments: an unknown one is named.
func noArgsBut(want string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) > 0 {
			return usageError{fmt.Errorf("%s: unknown subcommand %q, want %s (see %s --help)", cmd.CommandPath(), args[0], want, cmd.CommandPath())}
		}
		return nil
	}
}

// noArgs is the Args of a command that takes only flags.
func noArgs(cmd *cobra.Command, args []string) error {
	if len(args) > 0 {
		return usageError{fmt.Errorf("%s takes no arguments, got %q: flags are written --name value (see %s --help)", cmd.CommandPath(), args[0], cmd.CommandPath())}
	}
	return nil
}
