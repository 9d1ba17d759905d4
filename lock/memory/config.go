package memory

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/dlock/dlock/lock"
)

// Config configures a Backend: the rules every backend honours, and what
// only this engine has. Start from DefaultConfig.
type Config struct {
	lock.Rules

	// Shards is the number of shards keys are spread over (docs/DESIGN.md,
	// "Sharding"); each has its own mutex.
	Shards int
	// RefStore, when not nil, turns on server-side reference counting and
	// makes references durable in it.
	RefStore RefStore
	// TokenCeiling, when not nil, keeps a bound above every fencing token
	// durable, so that tokens never go back across a restart whatever the
	// wall clock does. Nil: across restarts, tokens rest on the wall clock
	// not stepping back (docs/DESIGN.md, "Fencing tokens").
	TokenCeiling CeilingStore
	// Logger receives one line per grant and hand-off (debug), expiry and
	// session loss (info). Nil discards.
	Logger *slog.Logger

	// Tests set these (tokens.go); zero means the default.
	tokenLead, tokenWindow time.Duration
}

// DefaultConfig returns the defaults of docs/RUNNING.md, "Configuration".
func DefaultConfig() Config {
	return Config{Rules: lock.DefaultRules(), Shards: 32}
}

// Validate reports every setting that cannot work.
func (c Config) Validate() error {
	var errs []error
	if c.Shards < 1 || c.Shards > 1<<16 {
		errs = append(errs, fmt.Errorf("shards must be between 1 and 65536, not %d", c.Shards))
	}
	errs = append(errs, c.Rules.Validate())
	return errors.Join(errs...)
}
