package envflag

import (
	"flag"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
)

func TestApply(t *testing.T) {
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	a := fs.String("listen-addr", "def", "")
	b := fs.Duration("ttl", time.Second, "")
	c := fs.Int("n", 1, "")
	if err := fs.Parse([]string{"-n", "5"}); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"P_LISTEN_ADDR": "from-env", "P_TTL": "3s", "P_N": "9"}
	if err := Apply(fs, "P", func(k string) string { return env[k] }); err != nil {
		t.Fatal(err)
	}
	if *a != "from-env" || *b != 3*time.Second || *c != 5 {
		t.Fatalf("got %q %v %d: the environment fills unset flags, the command line wins", *a, *b, *c)
	}
	env["P_TTL"] = "soon"
	fs2 := flag.NewFlagSet("x", flag.ContinueOnError)
	fs2.Duration("ttl", time.Second, "")
	if err := Apply(fs2, "P", func(k string) string { return env[k] }); err == nil || !strings.Contains(err.Error(), "P_TTL") {
		t.Fatalf("bad value: %v, want an error naming P_TTL", err)
	}
}

func TestApplyPFlags(t *testing.T) {
	fs := pflag.NewFlagSet("x", pflag.ContinueOnError)
	a := fs.String("listen-addr", "def", "")
	b := fs.Duration("ttl", time.Second, "")
	c := fs.Int("n", 1, "")
	if err := fs.Parse([]string{"--n", "5"}); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"P_LISTEN_ADDR": "from-env", "P_TTL": "3s", "P_N": "9"}
	if err := ApplyPFlags(fs, "P", func(k string) string { return env[k] }); err != nil {
		t.Fatal(err)
	}
	if *a != "from-env" || *b != 3*time.Second || *c != 5 {
		t.Fatalf("got %q %v %d: the environment fills unset flags, the command line wins", *a, *b, *c)
	}
	if !fs.Changed("listen-addr") {
		t.Error("a flag set from the environment does not count as given")
	}
	env["P_TTL"] = "soon"
	fs2 := pflag.NewFlagSet("x", pflag.ContinueOnError)
	fs2.Duration("ttl", time.Second, "")
	if err := ApplyPFlags(fs2, "P", func(k string) string { return env[k] }); err == nil || !strings.Contains(err.Error(), "P_TTL") {
		t.Fatalf("bad value: %v, want an error naming P_TTL", err)
	}
}
