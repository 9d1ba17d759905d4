package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/internal/bench"
	"github.com/dlock/dlock/internal/netfault"
	"github.com/dlock/dlock/lock"
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

// benchReport is what a run of bench measured, and what it started to
// measure it, to print once every scenario ran.
type benchReport struct {
	// setup says what was measured, when bench started it: printed with
	// the results (docs/BENCHMARKS.md, "dlock on etcd").
	setup   []string
	results []bench.Result
	pings   []bench.PingResult
	cutoff  []bench.CutoffSummary
}

// write prints the report to w: as JSON, as Markdown tables and lists, or
// as aligned tables and lines.
func (rep *benchReport) write(w io.Writer, asJSON, asMarkdown bool) error {
	ratios := benchRatios(rep.results)
	if asJSON {
		return rep.writeJSON(w, ratios)
	}
	lines := append(rep.setup, cpuLines(rep.results)...)
	for _, k := range slices.Sorted(maps.Keys(ratios)) {
		lines = append(lines, fmt.Sprintf("%s = %.2f", k, ratios[k]))
	}
	if asMarkdown {
		rep.writeMarkdown(w, lines)
	} else {
		rep.writeText(w, lines)
	}
	return nil
}

func (rep *benchReport) writeJSON(w io.Writer, ratios map[string]float64) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	out := map[string]any{"results": rep.results, "ratios": ratios}
	if len(rep.setup) > 0 {
		out["setup"] = rep.setup
	}
	if len(rep.pings) > 0 {
		out["pings"] = rep.pings
	}
	if len(rep.cutoff) > 0 {
		out["cutoff"] = rep.cutoff
	}
	return enc.Encode(out)
}

// writeMarkdown prints the tables and then the notes and lines as a list
// (make bench appends them to docs/BENCHMARKS.md).
func (rep *benchReport) writeMarkdown(w io.Writer, lines []string) {
	if len(rep.pings) > 0 {
		fmt.Fprintln(w, "| "+strings.Join(pingColumns, " | ")+" |")
		fmt.Fprintln(w, strings.Repeat("| --- ", len(pingColumns))+"|")
		for _, r := range rep.pings {
			fmt.Fprintln(w, "| "+strings.Join(pingRow(r), " | ")+" |")
		}
		fmt.Fprintln(w)
	}
	if len(rep.results) > 0 {
		fmt.Fprintln(w, "| scenario | system | concurrency | ops/s | p50 | p90 | p99 | max | one op | server CPU/op | server RSS |")
		fmt.Fprintln(w, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
		for _, r := range rep.results {
			fmt.Fprintf(w, "| %s | %s | %d | %.0f | %s | %s | %s | %s | %s | %s | %s |\n", r.Scenario, r.System, r.Concurrency, r.Rate, us(r.P50), us(r.P90), us(r.P99), us(r.Max), r.Unit, cpuText(r.ServerCPUPerOp), rssText(r))
		}
		fmt.Fprintln(w)
	}
	printCutoff(w, rep.cutoff, true)
	for _, r := range rep.results {
		if r.Note != "" {
			fmt.Fprintf(w, "- %s %s: %s\n", r.Scenario, r.System, r.Note)
		}
	}
	for _, l := range lines {
		fmt.Fprintf(w, "- %s\n", l)
	}
}

// writeText prints the tables aligned, then the notes and lines; the
// results' table, if empty, when nothing else was measured either.
func (rep *benchReport) writeText(w io.Writer, lines []string) {
	if len(rep.pings) > 0 {
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, strings.Join(pingColumns, "\t")+"\t")
		for _, r := range rep.pings {
			fmt.Fprintln(tw, strings.Join(pingRow(r), "\t")+"\t")
		}
		tw.Flush()
	}
	if len(rep.results) > 0 || (len(rep.pings) == 0 && len(rep.cutoff) == 0) {
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "scenario\tsystem\tconcurrency\tops/s\tp50\tp90\tp99\tmax\tone op\tserver CPU/op\tserver RSS\t")
		for _, r := range rep.results {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%.0f\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n", r.Scenario, r.System, r.Concurrency, r.Rate, us(r.P50), us(r.P90), us(r.P99), us(r.Max), r.Unit, cpuText(r.ServerCPUPerOp), rssText(r))
		}
		tw.Flush()
	}
	printCutoff(w, rep.cutoff, false)
	for _, r := range rep.results {
		if r.Note != "" {
			fmt.Fprintf(w, "%s %s: %s\n", r.Scenario, r.System, r.Note)
		}
	}
	for _, l := range lines {
		fmt.Fprintln(w, l)
	}
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

// cutoffRoundText is one round's outcome in a progress line.
func cutoffRoundText(o bench.CutoffOutcome) string {
	var t string
	if o.Kept {
		t = fmt.Sprintf("holder kept its hold; next holder ran %s after the cut", secs(o.Next))
	} else {
		t = fmt.Sprintf("cut → holder stopped %s, cut → next holder running %s", secs(o.Stopped), secs(o.Next))
	}
	t += fmt.Sprintf(", overlap %s", secs(o.Overlap))
	for _, p := range o.Problems {
		t += "; " + p
	}
	return t
}

func secs(d time.Duration) string { return fmt.Sprintf("%.2f s", d.Seconds()) }

// msText prints milliseconds as seconds; "—" for none.
func msText(v float64) string {
	if v <= 0 {
		return "—"
	}
	return fmt.Sprintf("%.2f s", v/1e3)
}

// printCutoff prints the cutoff scenario's table: per case, the rounds,
// in how many the holder kept its hold, cut → holder stopped and cut →
// next holder running (p50 / max over the rounds the holder stopped in),
// the bound, and the overlap, which must be 0; then every problem.
func printCutoff(w io.Writer, sums []bench.CutoffSummary, markdown bool) {
	if len(sums) == 0 {
		return
	}
	row := func(s bench.CutoffSummary) []string {
		return []string{s.Scenario, fmt.Sprint(s.Rounds), fmt.Sprintf("%d/%d", s.Kept, s.Rounds),
			msText(s.StoppedP50) + " / " + msText(s.StoppedMax), msText(s.NextP50) + " / " + msText(s.NextMax),
			msText(s.Bound), fmt.Sprintf("%.0f ms, %d lines", s.Overlap, s.OverlapLines)}
	}
	head := []string{"cutoff case", "rounds", "hold kept", "cut → holder stopped (p50 / max)", "cut → next holder running (p50 / max)", "bound", "overlap"}
	if markdown {
		fmt.Fprintf(w, "| %s |\n|%s\n", strings.Join(head, " | "), strings.Repeat(" --- |", len(head)))
		for _, s := range sums {
			fmt.Fprintf(w, "| %s |\n", strings.Join(row(s), " | "))
		}
		fmt.Fprintln(w)
	} else {
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, strings.Join(head, "\t")+"\t")
		for _, s := range sums {
			fmt.Fprintln(tw, strings.Join(row(s), "\t")+"\t")
		}
		tw.Flush()
	}
	for _, s := range sums {
		for _, p := range s.Problems {
			fmt.Fprintf(w, "FAILED %s %s\n", s.Scenario, p)
		}
	}
}

// cutoffFailed is the error of a cutoff run in which a round broke the
// promise: an overlap, a holder that did not stop, a key that did not move
// on within its bound.
func cutoffFailed(sums []bench.CutoffSummary) error {
	var failed []string
	for _, s := range sums {
		if s.Failed() {
			failed = append(failed, s.Scenario)
		}
	}
	if len(failed) > 0 {
		return fmt.Errorf("cutoff: %s broke the promise: an overlap, a holder that did not stop, or a key that did not move on within its bound (see above)", strings.Join(failed, ", "))
	}
	return nil
}

// pingColumns head the pings scenario's table, a row of which pingRow
// makes: CPU in percent of one core, bytes the streams' payload.
var pingColumns = []string{"ping interval", "streams", "window", "server CPU", "bench CPU", "pings/s", "of expected", "bytes/s", "bytes/s a stream", "bytes a ping", "server CPU a ping"}

func pingRow(r bench.PingResult) []string {
	return []string{msDuration(r.IntervalMS).String(), strconv.Itoa(r.Streams), fmt.Sprintf("%.1fs", r.Seconds),
		fmt.Sprintf("%.2f%%", r.ServerCPU), fmt.Sprintf("%.2f%%", r.BenchCPU),
		fmt.Sprintf("%.0f", r.Rate), fmt.Sprintf("%.2f", r.Rate/r.Expected),
		fmt.Sprintf("%.0f", r.BytesPerSecond), fmt.Sprintf("%.2f", r.BytesPerStream), fmt.Sprintf("%.1f", r.PingBytes), cpuText(r.ServerCPUPerPing)}
}

// msDuration is a duration given in milliseconds.
func msDuration(ms float64) time.Duration { return time.Duration(ms * float64(time.Millisecond)) }

// benchRatios divides dlock's rate by each other system's, and the other
// system's server CPU per op into dlock's, per scenario; and the fan-out's
// times by its floor's: how many times the floor dlock takes to tell every
// waiter, in its worst round and in its median one.
func benchRatios(results []bench.Result) map[string]float64 {
	ratios := map[string]float64{}
	for _, d := range results {
		if d.System != "dlock" {
			continue
		}
		for _, o := range results {
			if o.System == "dlock" || o.Scenario != d.Scenario {
				continue
			}
			if o.Rate > 0 {
				ratios[fmt.Sprintf("%s dlock/%s", d.Scenario, o.System)] = d.Rate / o.Rate
			}
			if d.ServerCPUPerOp > 0 && o.ServerCPUPerOp > 0 {
				ratios[fmt.Sprintf("%s server CPU/op dlock/%s", d.Scenario, o.System)] = d.ServerCPUPerOp / o.ServerCPUPerOp
			}
		}
		if d.Scenario != "fanout" {
			continue
		}
		for _, f := range results {
			if f.Scenario != "fanout-floor" {
				continue
			}
			if f.Max > 0 {
				ratios["fanout max dlock/floor"] = d.Max / f.Max
			}
			if f.RoundMedian > 0 {
				ratios["fanout median round dlock/floor"] = d.RoundMedian / f.RoundMedian
			}
		}
	}
	return ratios
}

// cpuLines puts the server CPU per op of the systems that ran a scenario
// side by side, one line per scenario that more than one ran.
func cpuLines(results []bench.Result) []string {
	var lines []string
	var done []string
	for _, r := range results {
		if slices.Contains(done, r.Scenario) {
			continue
		}
		done = append(done, r.Scenario)
		var parts []string
		for _, o := range results {
			if o.Scenario == r.Scenario && o.ServerCPUPerOp > 0 {
				parts = append(parts, o.System+" "+cpuText(o.ServerCPUPerOp))
			}
		}
		if len(parts) > 1 {
			lines = append(lines, fmt.Sprintf("%s server CPU per %s: %s", r.Scenario, r.Unit, strings.Join(parts, ", ")))
		}
	}
	return lines
}

func cpuText(v float64) string {
	switch {
	case v <= 0:
		return ""
	case v >= 1e3:
		return fmt.Sprintf("%.2fms", v/1e3)
	}
	return fmt.Sprintf("%.1fµs", v)
}

// benchFiles is the file descriptors the scenarios open in this process
// (and in the floor's writers, which inherit the limit): a stream per
// fan-out waiter or per floor reader, the memory scenario's idle-sessions
// and the pings scenario's --sessions streams, plus a reserve for
// everything else.
func benchFiles(runs []string, waiters, sessions, heldNodes, conns, nodes, servers int) uint64 {
	need := conns + heldNodes
	if slices.Contains(runs, "fleet") {
		// The nodes' streams, and a connection per worker to each server.
		need = max(need, nodes+conns*servers)
	}
	if slices.Contains(runs, "fanout") {
		need = max(need, waiters+32)
	}
	if slices.Contains(runs, "memory") || slices.Contains(runs, "pings") {
		need = max(need, sessions+conns)
	}
	return uint64(need) + 256
}

// ensureFileLimit raises this process's open-file limit to need if it is
// lower: the soft limit up to the hard one, and the hard one too where
// that is allowed (root). The servers bench starts inherit it.
func ensureFileLimit(need uint64) error {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return fmt.Errorf("reading the open-file limit: %w", err)
	}
	if lim.Cur >= need {
		return nil
	}
	want := syscall.Rlimit{Cur: need, Max: max(lim.Max, need)}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &want); err != nil {
		return fmt.Errorf("these scenarios open about %d files in this process, over the open-file limit of %d (hard %d) that cannot be raised (%v): fewer --waiters or --sessions, or a higher ulimit -n",
			need, lim.Cur, lim.Max, err)
	}
	return nil
}

// benchServerBinary is the dlock that the memory scenario runs as its fresh
// servers, and the fan-out floor as its writers: this one (tests: the one
// they built).
var benchServerBinary = os.Executable

// floorWriterArg, alone after `dlock bench`, makes it the fan-out floor's
// writers (bench.ServeFloor), driven by another dlock bench on its
// standard input and output: not a command for people.
const floorWriterArg = "floor-writer"

// freshServerFlags are the `dlock serve` flags a fresh server needs past
// its defaults to hold sessions streams and keys locks.
func freshServerFlags(sessions, keys int) []string {
	var flags []string
	def := lock.DefaultRules()
	if need := sessions + 64; def.MaxSessions > 0 && need > def.MaxSessions {
		flags = append(flags, "--max-sessions", strconv.Itoa(need))
	}
	if need := keys + 64; def.MaxKeys > 0 && need > def.MaxKeys {
		flags = append(flags, "--max-keys", strconv.Itoa(need))
	}
	return flags
}

// freshServer starts `bin serve` on a free 127.0.0.1 port, with flags,
// for each call, and stops it (SIGKILL: nothing of it needs to last) with
// the func returned. Its log goes to stderr at level warn.
func freshServer(bin string, flags []string, stderr io.Writer) bench.StartServer {
	return func(ctx context.Context) (string, func(), error) {
		var err error
		// A free port can be taken between its finding and the server's
		// listen: try again then.
		for range 3 {
			var base string
			var stop func()
			base, stop, err = startFresh(ctx, bin, flags, stderr)
			if err == nil {
				return base, stop, nil
			}
			if !errors.Is(err, errExited) {
				break
			}
		}
		return "", nil, err
	}
}

type syncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}

var errExited = errors.New("dlock serve exited")

func startFresh(ctx context.Context, bin string, flags []string, stderr io.Writer) (string, func(), error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	addr := ln.Addr().String()
	ln.Close()
	// No data dir: a fresh server shares no state, and takes no lock on
	// the default one that a real server may hold.
	args := append([]string{"serve", "--listen", addr, "--data-dir", "", "--log-level", "warn"}, flags...)
	cmd := exec.Command(bin, args...)
	// The environment's DLOCK_* settings (a token file, TLS) are for the
	// servers under test, not for a default fresh one.
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DLOCK_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Stdout, cmd.Stderr = stderr, stderr
	if err := cmd.Start(); err != nil {
		return "", nil, err
	}
	exited := make(chan struct{})
	var waitErr error
	go func() { waitErr = cmd.Wait(); close(exited) }()
	stop := func() {
		cmd.Process.Kill()
		<-exited
	}
	base := "http://" + addr
	hc := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := hc.Get(base + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				hc.CloseIdleConnections()
				return base, stop, nil
			}
		}
		select {
		case <-exited:
			return "", nil, fmt.Errorf("%w: %v", errExited, waitErr)
		case <-ctx.Done():
			stop()
			return "", nil, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			stop()
			return "", nil, fmt.Errorf("dlock serve on %s did not answer /healthz within 30 s", addr)
		}
	}
}

// us formats a latency; none (the memory rows, which time nothing) is
// left blank.
func us(v float64) string {
	switch {
	case v <= 0:
		return ""
	case v >= 1e6:
		return fmt.Sprintf("%.2fs", v/1e6)
	case v >= 1e3:
		return fmt.Sprintf("%.2fms", v/1e3)
	}
	return fmt.Sprintf("%.0fµs", v)
}

func rssText(r bench.Result) string {
	if r.RSSMiB <= 0 {
		return ""
	}
	return fmt.Sprintf("%.1f MiB", r.RSSMiB)
}
