package main

import (
	"errors"
	"fmt"
	"os/exec"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/internal/bench"
	"github.com/dlock/dlock/internal/netfault"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// benchScenarios are the scenarios bench runs; the top-level usage names
// each (TestUsageNamesScenarios).
var benchScenarios = []string{"pairs", "handoff", "fanout", "sessions", "memory", "pings", "failover", "fleet", "cutoff"}

// benchCommand is the load generator: scenarios against a running dlock
// server (the memory scenario: against fresh ones it starts) and, with
// --compare, the same work against Redis and etcd.
func (e *cli) benchCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "bench [--scenario S,…] [--backend etcd] [--compare redis,etcd] [flags]",
		Short: "Load generator: measure a dlock server (or servers bench starts)",
		Long: `bench runs scenarios against a running dlock server (--server), or against
servers it starts: fresh dlock serve processes for memory and pings, and with
--backend etcd an etcd on 127.0.0.1 and dlock servers on it (failover and
fleet need it). --compare runs pairs and handoff against Redis and etcd too.
It prints a table of each scenario's rate, latencies and the server's CPU
(--json, --markdown: docs/BENCHMARKS.md).

Scenarios: ` + strings.Join(benchScenarios, ", ") + ` (the default: pairs,handoff,fanout,sessions).`,
		Example: `  dlock bench --server http://127.0.0.1:7380 --duration 5s
  dlock bench --scenario failover,fleet --backend etcd
  dlock bench --scenario pairs,handoff --compare redis,etcd --json`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 1 && args[0] == floorWriterArg {
				return nil
			}
			return noArgs(cmd, args)
		},
	}
	fs := cmd.Flags()
	o := benchFlags(fs)
	cmd.RunE = e.action(func(cmd *cobra.Command, args []string) error {
		if len(args) == 1 {
			return bench.ServeFloor(e.stdin, e.stdout)
		}
		ctx, stop := signal.NotifyContext(e.ctx, syscall.SIGINT, syscall.SIGTERM)
		defer stop()
		plan, err := o.validate(fs.Changed("server"))
		if err != nil {
			return err
		}
		return o.run(ctx, plan, e.stdout, e.stderr)
	})
	return cmd
}

// benchOptions is everything `dlock bench` can be told: its flags.
type benchOptions struct {
	server    string // --server, the one measured
	scenarios string // comma-separated, in the order they run
	backend   string // "" or etcd
	etcdBin   string // --etcd
	compare   string // comma-separated: redis, etcd
	cred      *client.CredentialFiles

	duration             time.Duration
	concurrency, waiters int
	held, heldNodes      int // memory
	sessions             int // memory, pings
	memoryServer         string
	pingIntervals        string
	pingWindow           time.Duration
	servers, rounds      int           // servers: failover, fleet; rounds: failover, cutoff
	recheck              time.Duration // failover, fleet
	failoverRaw          bool
	nodes, holders       int // fleet
	fleetHeld, opening   int
	idle                 time.Duration
	cutoffCases          string // --cutoff
	serveFlags           string // --serve-flags, for every dlock serve bench starts
	asJSON, asMarkdown   bool
}

// benchFlags defines dlock bench's flags on fs, bound to the returned
// options.
func benchFlags(fs *pflag.FlagSet) *benchOptions {
	o := &benchOptions{}
	fs.StringVar(&o.server, "server", "http://127.0.0.1:7380", "dlock server URL (one: bench measures a server)")
	fs.StringVar(&o.scenarios, "scenario", "pairs,handoff,fanout,sessions", "scenarios to run: pairs, handoff, fanout (and its floor), sessions, memory, pings, failover and fleet (--backend etcd), cutoff (as root; its etcd cases with --backend etcd)")
	fs.DurationVar(&o.duration, "duration", 10*time.Second, "how long each scenario runs")
	fs.IntVar(&o.concurrency, "concurrency", 32, "connections (pairs, sessions, memory) or nodes on the key (handoff)")
	fs.IntVar(&o.waiters, "waiters", 1000, "fanout: waiters, each with its own session, queued on one key (and the floor's loopback sockets)")
	fs.IntVar(&o.held, "held", 100000, "memory: locks to hold while the server's RSS is read (held-ttl, held-session; 0: neither)")
	fs.IntVar(&o.heldNodes, "held-nodes", 100, "memory: nodes, each with a session stream, that hold the held-session locks")
	fs.IntVar(&o.sessions, "sessions", 10000, "memory: session streams to keep open while the server's RSS is read (idle-sessions; 0: not run); pings: idle session streams on each server")
	fs.StringVar(&o.pingIntervals, "ping-intervals", "250ms,1s,5s,15s", "pings: the --ping-interval of each fresh dlock serve measured, comma-separated (10ms to 1m)")
	fs.DurationVar(&o.pingWindow, "ping-window", 10*time.Second, "pings: the shortest window measured on each server, made a whole number of intervals, two at least")
	fs.StringVar(&o.memoryServer, "memory-server", "", "memory: measure this server (with the same credentials) instead of a fresh dlock serve for each measurement")
	fs.StringVar(&o.compare, "compare", "", "also run pairs and handoff against: redis, etcd (comma-separated; started on 127.0.0.1)")
	fs.StringVar(&o.etcdBin, "etcd", "", "the etcd binary that --backend etcd and --compare etcd start (default: etcd in PATH; make etcd builds the etcd of go.mod into bin/etcd)")
	fs.StringVar(&o.backend, "backend", "", "etcd: instead of measuring --server, start an etcd on 127.0.0.1 and dlock serve --backend etcd on it, and measure that (--compare etcd then measures the same etcd)")
	fs.IntVar(&o.servers, "servers", 3, "failover: dlock servers on the one etcd, one SIGKILLed each round; fleet: the servers the nodes are spread over, one SIGKILLed")
	fs.IntVar(&o.nodes, "nodes", 10000, "fleet: nodes, each with its session stream open, spread over --servers")
	fs.IntVar(&o.holders, "holders", 1000, "fleet: nodes that hold a session-leased lock when a server is killed")
	fs.IntVar(&o.fleetHeld, "fleet-held", 100000, "fleet: locks the nodes then hold with session leases, for the servers' RSS and etcd's database size (0: not measured)")
	fs.DurationVar(&o.idle, "idle", 10*time.Second, "fleet: how long etcd's and the servers' CPU is read while the sessions idle (0: not read)")
	fs.IntVar(&o.opening, "opening", 256, "fleet: session streams opening at once")
	fs.IntVar(&o.rounds, "rounds", 5, "failover, cutoff: rounds (cutoff: of each case)")
	fs.StringVar(&o.cutoffCases, "cutoff", "", "cutoff: the cases to run, comma-separated (default: the memory engine's, and with --backend etcd the etcd engine's): "+strings.Join(bench.CutoffScenarios, ", "))
	fs.BoolVar(&o.failoverRaw, "failover-raw", false, "failover: the node is raw HTTP that tries the other servers in turn, not client.Client with every server")
	fs.DurationVar(&o.recheck, "recheck", 6*time.Second, "failover: check the hold again this long after the kill, past the servers' --session-grace (0: only at once)")
	fs.StringVar(&o.serveFlags, "serve-flags", "", "more flags for the dlock serve processes bench starts, space-separated (e.g. --debug-listen 127.0.0.1:6060)")
	fs.BoolVar(&o.asJSON, "json", false, "print the results as JSON")
	fs.BoolVar(&o.asMarkdown, "markdown", false, "print the results as a Markdown table (make bench appends it to docs/BENCHMARKS.md)")
	o.cred = credentialFlags(fs)
	return o
}

// benchPlan is what the flags ask for, read and checked by validate.
type benchPlan struct {
	runs      []string        // the scenarios, in the order they run
	cutoffs   []string        // the cutoff scenario's cases
	others    []string        // --compare's systems, in order
	intervals []time.Duration // the pings scenario's
}

// validate checks the flags in a fixed order, so that a command line with
// several faults is told of the same one each time: most are usage errors
// (exit status 2); a missing etcd or redis-server, or a cutoff scenario
// without root, is not. serverSet says whether --server was given.
func (o *benchOptions) validate(serverSet bool) (benchPlan, error) {
	var p benchPlan
	if len(client.SplitServers(o.server)) > 1 {
		return p, usageError{fmt.Errorf("--server %s: bench measures one server, not a list", o.server)}
	}
	if err := checkServers(o.server); err != nil {
		return p, err
	}
	p.runs = strings.Split(o.scenarios, ",")
	for _, s := range p.runs {
		if !slices.Contains(benchScenarios, s) {
			return p, usageError{fmt.Errorf("unknown scenario %q: the scenarios are %s", s, strings.Join(benchScenarios, ", "))}
		}
	}
	if err := o.validateBackend(p.runs, serverSet); err != nil {
		return p, err
	}
	if o.servers < 2 || o.rounds < 1 {
		return p, usageError{errors.New("--servers must be at least 2 and --rounds at least 1")}
	}
	var err error
	if p.cutoffs, err = o.cutoffPlan(p.runs); err != nil {
		return p, err
	}
	if p.others, err = o.compareSystems(); err != nil {
		return p, err
	}
	// --etcd alone would measure the --server given and start no etcd:
	// a run that seems to be on that etcd and is not.
	if o.etcdBin != "" && o.backend != "etcd" && !slices.Contains(p.others, "etcd") {
		return p, usageError{errors.New("--etcd needs --backend etcd or --compare etcd: it names the etcd they start")}
	}
	if o.concurrency < 1 || o.waiters < 1 || o.duration <= 0 || o.held < 0 || o.sessions < 0 || o.heldNodes < 1 {
		return p, usageError{errors.New("--concurrency, --waiters, --held-nodes and --duration must be positive, --held and --sessions not negative")}
	}
	if o.nodes < o.servers || o.holders < 0 || o.holders > o.nodes || o.fleetHeld < 0 || o.idle < 0 || o.opening < 1 {
		return p, usageError{errors.New("--nodes must be at least --servers, --holders at most --nodes, --opening positive, --fleet-held and --idle not negative")}
	}
	if slices.Contains(p.runs, "pings") {
		if p.intervals, err = bench.ParsePingIntervals(o.pingIntervals); err != nil {
			return p, usageError{fmt.Errorf("--ping-intervals: %w", err)}
		}
		if o.sessions < 1 || o.pingWindow <= 0 {
			return p, usageError{errors.New("--scenario pings needs --sessions and --ping-window above 0")}
		}
	}
	return p, nil
}

// validateBackend checks --etcd and --backend against the scenarios and
// --server.
func (o *benchOptions) validateBackend(runs []string, serverSet bool) error {
	if o.etcdBin != "" {
		if _, err := exec.LookPath(o.etcdBin); err != nil {
			return usageError{fmt.Errorf("--etcd: %w", err)}
		}
	}
	switch o.backend {
	case "":
		for _, s := range []string{"failover", "fleet"} {
			if slices.Contains(runs, s) {
				return usageError{fmt.Errorf("--scenario %s needs --backend etcd: servers that share their lock state, started by bench", s)}
			}
		}
	case "etcd":
		if slices.Contains(runs, "pings") {
			return usageError{errors.New("--scenario pings measures fresh memory servers: no --backend")}
		}
		if serverSet {
			return usageError{errors.New("--backend etcd measures the server it starts: no --server")}
		}
		if o.etcdBin == "" {
			if _, err := exec.LookPath("etcd"); err != nil {
				return fmt.Errorf("--backend etcd: etcd is not installed (Debian: apt-get install etcd-server; or --etcd)")
			}
		}
	default:
		return usageError{fmt.Errorf("--backend: %q is not etcd", o.backend)}
	}
	return nil
}

// cutoffPlan is the cutoff scenario's cases, when runs has it.
func (o *benchOptions) cutoffPlan(runs []string) ([]string, error) {
	if !slices.Contains(runs, "cutoff") {
		if o.cutoffCases != "" {
			return nil, usageError{errors.New("--cutoff needs --scenario cutoff")}
		}
		return nil, nil
	}
	cutoffs, err := cutoffList(o.cutoffCases, o.backend == "etcd")
	if err != nil {
		return nil, usageError{err}
	}
	// Faults are iptables rules: without root, nothing to measure.
	if err := cutoffUsable(); err != nil {
		return nil, fmt.Errorf("the cutoff scenario cannot run: %w", err)
	}
	return cutoffs, nil
}

// compareSystems is --compare's systems, each installed (an etcd named by
// --etcd is checked by validateBackend).
func (o *benchOptions) compareSystems() ([]string, error) {
	if o.compare == "" {
		return nil, nil
	}
	others := strings.Split(o.compare, ",")
	for _, sys := range others {
		bin := map[string]string{"redis": "redis-server", "etcd": "etcd"}[sys]
		if bin == "" {
			return nil, usageError{fmt.Errorf("--compare: unknown system %q (redis, etcd)", sys)}
		}
		if sys == "etcd" && o.etcdBin != "" {
			continue
		}
		if _, err := exec.LookPath(bin); err != nil {
			return nil, fmt.Errorf("--compare %s: %s is not installed (Debian: apt-get install %s)", sys, bin, map[string]string{"redis": "redis-server", "etcd": "etcd-server"}[sys])
		}
	}
	return others, nil
}

// cutoffUsable says whether the cutoff scenario can make its faults:
// netfault.Usable (root, a working iptables); a variable for the tests.
var cutoffUsable = netfault.Usable

// cutoffList reads --cutoff: the cases named, or by default the memory
// engine's, and the etcd engine's with an etcd.
func cutoffList(list string, etcd bool) ([]string, error) {
	var out []string
	if list == "" {
		for _, c := range bench.CutoffScenarios {
			if etcd || !bench.CutoffEtcd(c) {
				out = append(out, c)
			}
		}
		return out, nil
	}
	for _, c := range strings.Split(list, ",") {
		c = strings.TrimSpace(c)
		if !slices.Contains(bench.CutoffScenarios, c) {
			return nil, fmt.Errorf("--cutoff: unknown case %q (%s)", c, strings.Join(bench.CutoffScenarios, ", "))
		}
		if bench.CutoffEtcd(c) && !etcd {
			return nil, fmt.Errorf("--cutoff %s needs --backend etcd", c)
		}
		out = append(out, c)
	}
	return out, nil
}

// floorWriterArg, alone after `dlock bench`, makes it the fan-out floor's
// writers (bench.ServeFloor), driven by another dlock bench on its
// standard input and output: not a command for people.
const floorWriterArg = "floor-writer"
