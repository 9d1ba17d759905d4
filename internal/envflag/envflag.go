// Package envflag gives every flag of a FlagSet, the flag package's or
// pflag's, an environment fallback: a flag not given on the command line
// takes PREFIX_<FLAG> (upper case, dashes as underscores) when that is
// set. The command line wins.
package envflag

import (
	"errors"
	"flag"
	"fmt"
	"strings"
)

// Apply sets, after fs.Parse, every flag not given on the command line from
// its environment variable. Bad values are reported naming the variable.
func Apply(fs *flag.FlagSet, prefix string, getenv func(string) string) error {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var errs []error
	fs.VisitAll(func(f *flag.Flag) {
		if !set[f.Name] {
			errs = append(errs, fromEnv(prefix, f.Name, fs.Set, getenv))
		}
	})
	return errors.Join(errs...)
}

// fromEnv sets the flag name with set from its environment variable, if
// that is set; a bad value is an error naming the variable.
func fromEnv(prefix, name string, set func(name, value string) error, getenv func(string) string) error {
	env := Name(prefix, name)
	if v := getenv(env); v != "" {
		if err := set(name, v); err != nil {
			return fmt.Errorf("%s=%q: %v", env, v, err)
		}
	}
	return nil
}

// Name is the environment variable of a flag.
func Name(prefix, flagName string) string {
	return prefix + "_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}
