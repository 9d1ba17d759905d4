package main

import (
	"fmt"
	"io"

	"github.com/spf13/pflag"

	"github.com/dlock/dlock/client"
)

// The commands' flags parsed on a FlagSet of their own, without cobra:
// the tests of flags, environment fallbacks and checks. The command line
// goes through rootCommand, which parses and applies the environment the
// same way, then calls the same check.

// newClientFlags is the client flags on a FlagSet of their own.
func newClientFlags(name, defaultNode string, stderr io.Writer) *clientFlags {
	fs := pflag.NewFlagSet("dlock "+name, pflag.ContinueOnError)
	fs.SetOutput(stderr)
	return addClientFlags(fs, defaultNode)
}

// parse parses args and checks them as check does.
func (f *clientFlags) parse(args []string, getenv func(string) string, needResource bool) (client.Request, error) {
	if err := f.fs.Parse(args); err != nil {
		return client.Request{}, usageError{err}
	}
	if err := applyEnv(f.fs, getenv); err != nil {
		return client.Request{}, usageError{err}
	}
	return f.check(needResource)
}

// parseServe reads flags, with DLOCK_… environment variables as fallback
// (a flag on the command line wins), as dlock serve does.
func parseServe(args []string, getenv func(string) string, stderr io.Writer) (serveConfig, error) {
	fs := pflag.NewFlagSet("dlock serve", pflag.ContinueOnError)
	fs.SetOutput(stderr)
	c := serveFlags(fs)
	if err := fs.Parse(args); err != nil {
		return *c, err
	}
	if fs.NArg() > 0 {
		return *c, fmt.Errorf("serve takes no arguments, got %q", fs.Args())
	}
	if err := applyEnv(fs, getenv); err != nil {
		return *c, err
	}
	return *c, c.check()
}
