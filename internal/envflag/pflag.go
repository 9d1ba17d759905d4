package envflag

import (
	"errors"

	"github.com/spf13/pflag"
)

// ApplyPFlags is Apply for a pflag FlagSet (the dlock command's, built with
// cobra): after fs.Parse, every flag not given on the command line takes
// its environment variable. A flag set this way counts as given
// (Changed), so a required flag may come from the environment.
func ApplyPFlags(fs *pflag.FlagSet, prefix string, getenv func(string) string) error {
	var errs []error
	fs.VisitAll(func(f *pflag.Flag) {
		if !f.Changed {
			errs = append(errs, fromEnv(prefix, f.Name, fs.Set, getenv))
		}
	})
	return errors.Join(errs...)
}
