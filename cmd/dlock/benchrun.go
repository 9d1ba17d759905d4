package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/dlock/dlock/internal/bench"
	"github.com/dlock/dlock/internal/rawhttp"
	"github.com/dlock/dlock/lock"
)

// benchRun is one run of dlock bench: the servers it started, what its
// scenarios measure, and what they measured.
type benchRun struct {
	opt    *benchOptions
	plan   benchPlan
	stderr io.Writer // progress lines, and the logs of the servers bench starts
	// server and dialer are what the scenarios that measure one server
	// measure: --server with its credentials, or the dlock serve started
	// on --backend etcd's etcd, with none.
	server string
	dialer rawhttp.Dialer
	load   bench.Options // those scenarios' options
	// etcd is --backend etcd's, nil without it.
	etcd       *bench.Etcd
	extraServe []string // --serve-flags
	// cleanups stop what the run started, last first (close).
	cleanups []func()
	report   benchReport
}

// run measures the plan's scenarios in order, then the --compare systems,
// and prints what they measured to stdout. Whatever it started is stopped
// on every path out.
func (o *benchOptions) run(ctx context.Context, plan benchPlan, stdout, stderr io.Writer) error {
	tlsConfig, token, err := loadCredentials(o.cred, o.server)
	if err != nil {
		return err
	}
	if err := ensureFileLimit(benchFiles(plan.runs, o.waiters, o.sessions, o.heldNodes, o.concurrency, o.nodes, o.servers)); err != nil {
		return err
	}
	// The fresh servers' logs share stderr with the progress lines.
	b := &benchRun{opt: o, plan: plan, stderr: &syncWriter{w: stderr}, server: o.server,
		dialer: rawhttp.Dialer{TLS: tlsConfig, Token: token}, extraServe: strings.Fields(o.serveFlags)}
	defer b.close()
	if o.backend == "etcd" {
		if err := b.startEtcd(ctx); err != nil {
			return err
		}
	}
	b.load = bench.Options{Duration: o.duration, Concurrency: o.concurrency, Waiters: o.waiters, Dialer: b.dialer,
		ServerCPU: bench.MetricsCPU(b.server, b.dialer)}
	for _, s := range plan.runs {
		if err := b.scenario(ctx, s); err != nil {
			return err
		}
	}
	for _, sys := range plan.others {
		if err := b.compare(ctx, sys); err != nil {
			return err
		}
	}
	if err := b.report.write(stdout, o.asJSON, o.asMarkdown); err != nil {
		return err
	}
	return cutoffFailed(b.report.cutoff)
}

// cleanup adds stop to what close runs.
func (b *benchRun) cleanup(stop func()) { b.cleanups = append(b.cleanups, stop) }

// close stops what the run started, the last started first.
func (b *benchRun) close() {
	for _, stop := range slices.Backward(b.cleanups) {
		stop()
	}
}

// startEtcd starts --backend etcd's etcd and, if a scenario measures one
// server, a dlock serve on it that is measured instead of --server.
func (b *benchRun) startEtcd(ctx context.Context) error {
	etcd, err := bench.LaunchEtcd(b.opt.etcdBin)
	if err != nil {
		return fmt.Errorf("--backend etcd: %w", err)
	}
	b.etcd = etcd
	b.cleanup(etcd.Stop)
	fmt.Fprintf(b.stderr, "%s\n", etcd)
	b.report.setup = append(b.report.setup, "etcd: "+etcd.String())
	if !slices.ContainsFunc(b.plan.runs, func(s string) bool { return s != "memory" && s != "failover" && s != "fleet" && s != "cutoff" }) {
		return nil
	}
	prefix := fmt.Sprintf("/dlock-bench-%d/", time.Now().UnixNano())
	base, stop, err := b.startOnEtcd(func() string { return prefix })(ctx)
	if err != nil {
		return fmt.Errorf("--backend etcd: starting dlock serve: %w", err)
	}
	b.cleanup(stop)
	b.server = base
	b.dialer = rawhttp.Dialer{}
	args := append([]string{"dlock serve --backend etcd --etcd-endpoints", etcd.Endpoint, "--etcd-prefix", prefix}, b.extraServe...)
	b.report.setup = append(b.report.setup, fmt.Sprintf("dlock: one `%s` at %s, started by bench, on that etcd", strings.Join(args, " "), base))
	return nil
}

// startOnEtcd starts a fresh dlock serve on --backend etcd's etcd, under
// the key prefix that prefix returns, for each call.
func (b *benchRun) startOnEtcd(prefix func() string) bench.StartServer {
	return func(ctx context.Context) (string, func(), error) {
		bin, err := benchServerBinary()
		if err != nil {
			return "", nil, err
		}
		flags := append([]string{"--backend", "etcd", "--etcd-endpoints", b.etcd.Endpoint, "--etcd-prefix", prefix()}, b.extraServe...)
		return freshServer(bin, flags, b.stderr)(ctx)
	}
}

// etcdEndpoint is --backend etcd's etcd, "" without it.
func (b *benchRun) etcdEndpoint() string {
	if b.etcd == nil {
		return ""
	}
	return b.etcd.Endpoint
}

// timed runs f with o, showing its progress on stderr under label.
func (b *benchRun) timed(ctx context.Context, label string, o bench.Options, f func(context.Context, bench.Options) (bench.Result, error)) (bench.Result, error) {
	start := time.Now()
	o.Progress = func(ops int64) {
		fmt.Fprintf(b.stderr, "\r%-22s %10d ops %10.0f/s", label, ops, float64(ops)/time.Since(start).Seconds())
	}
	r, err := f(ctx, o)
	fmt.Fprintf(b.stderr, "\r%-22s done%40s\n", label, "")
	return r, err
}

// withEtcdCalls counts, on an etcd in play, the calls its server answered
// per op of f's run.
func withEtcdCalls(endpoint string, f func(context.Context, bench.Options) (bench.Result, error)) func(context.Context, bench.Options) (bench.Result, error) {
	if endpoint == "" {
		return f
	}
	return func(ctx context.Context, o bench.Options) (bench.Result, error) {
		cpu := bench.MetricsCPU(endpoint, rawhttp.Dialer{})
		before, berr := bench.EtcdCalls(endpoint)
		cpu0, cerr := cpu()
		r, err := f(ctx, o)
		cpu1, cerr1 := cpu()
		after, aerr := bench.EtcdCalls(endpoint)
		if err != nil || berr != nil || aerr != nil || r.Ops == 0 {
			return r, err
		}
		r.EtcdCallsPerOp = bench.EtcdCallsPerOp(before, after, r.Ops)
		if r.Note != "" {
			r.Note += "; "
		}
		r.Note += "etcd per " + r.Unit + ": " + bench.EtcdCallsText(r.EtcdCallsPerOp)
		if r.System == "dlock" && cerr == nil && cerr1 == nil {
			// The dlock server's CPU is its column; etcd's, under it,
			// here: together what the service costs.
			r.Note += fmt.Sprintf(", etcd's CPU %s", cpuText(float64((cpu1-cpu0).Nanoseconds())/1e3/float64(r.Ops)))
		}
		return r, nil
	}
}

// scenario measures one scenario and adds its results to the report.
func (b *benchRun) scenario(ctx context.Context, s string) error {
	switch s {
	case "pings":
		return b.pings(ctx)
	case "cutoff":
		return b.cutoff(ctx)
	case "memory":
		return b.memory(ctx)
	case "failover":
		return b.failover(ctx)
	case "fleet":
		return b.fleet(ctx)
	}
	return b.onServer(ctx, s)
}

// serverScenarios are the scenarios that measure one dlock server.
var serverScenarios = map[string]func(context.Context, string, bench.Options) (bench.Result, error){
	"pairs": bench.Pairs, "handoff": bench.Handoff, "fanout": bench.Fanout, "sessions": bench.Sessions,
}

// onServer measures one of serverScenarios against the server measured,
// and after the fan-out its floor.
func (b *benchRun) onServer(ctx context.Context, s string) error {
	f := serverScenarios[s]
	r, err := b.timed(ctx, s+" dlock", b.load, withEtcdCalls(b.etcdEndpoint(), func(ctx context.Context, o bench.Options) (bench.Result, error) { return f(ctx, b.server, o) }))
	if err != nil {
		return fmt.Errorf("%s: %w", s, err)
	}
	b.report.results = append(b.report.results, r)
	if s == "fanout" {
		return b.fanoutFloor(ctx, r)
	}
	return nil
}

// fanoutFloor measures the floor right after the fan-out, on the frame a
// waiter got: the same event bytes to as many sockets (docs/CLI.md, "Load
// generator"), written by this binary as a process of its own.
func (b *benchRun) fanoutFloor(ctx context.Context, fanout bench.Result) error {
	bin, err := benchServerBinary()
	if err != nil {
		return fmt.Errorf("fanout floor: the dlock binary to write: %w", err)
	}
	fr, err := b.timed(ctx, "fanout floor", b.load, func(ctx context.Context, o bench.Options) (bench.Result, error) {
		return bench.Floor(ctx, fanout.Frame, o.Waiters, max(fanout.Rounds, 5), bench.ExecFloor(b.stderr, bin, "bench", floorWriterArg))
	})
	if err != nil {
		return fmt.Errorf("fanout floor: %w", err)
	}
	b.report.results = append(b.report.results, fr)
	return nil
}

// pings measures the pings of idle session streams on a fresh dlock serve
// for each --ping-intervals.
func (b *benchRun) pings(ctx context.Context) error {
	o := b.opt
	bin, err := benchServerBinary()
	if err != nil {
		return fmt.Errorf("pings: the dlock binary to serve: %w", err)
	}
	po := bench.PingOptions{Intervals: b.plan.intervals, Sessions: o.sessions, Window: o.pingWindow,
		Start: func(ctx context.Context, ping time.Duration) (string, func(), error) {
			flags := append(append(freshServerFlags(o.sessions, 0), b.extraServe...), "--ping-interval", ping.String())
			return freshServer(bin, flags, b.stderr)(ctx)
		},
		Opened: func(ping, took time.Duration) {
			fmt.Fprintf(b.stderr, "pings %v: %d streams open in %.1fs, measuring %v\n", ping, o.sessions, took.Seconds(), bench.PingWindow(ping, o.pingWindow))
		},
		Done: func(r bench.PingResult) {
			fmt.Fprintf(b.stderr, "pings %v: %.0f pings/s (%.0f expected), server CPU %.2f%%\n", msDuration(r.IntervalMS), r.Rate, r.Expected, r.ServerCPU)
		}}
	rs, err := bench.Pings(ctx, po)
	if err != nil {
		return fmt.Errorf("pings: %w", err)
	}
	b.report.pings = append(b.report.pings, rs...)
	b.report.setup = append(b.report.setup, fmt.Sprintf("pings: a fresh `dlock serve --ping-interval …` for each interval, started by bench, %d idle session streams on it read by bench over 127.0.0.1; CPU in %% of one core; bytes are the streams' payload (no TCP/IP headers or ACKs); a ping is %q", o.sessions, bench.PingFrame))
	return nil
}

// cutoff runs each of the plan's cutoff cases --rounds times.
func (b *benchRun) cutoff(ctx context.Context) error {
	bin, err := benchServerBinary()
	if err != nil {
		return fmt.Errorf("cutoff: the dlock binary to run: %w", err)
	}
	dir, err := os.MkdirTemp("", "dlock-bench-cutoff")
	if err != nil {
		return err
	}
	b.cleanup(func() { os.RemoveAll(dir) })
	env := bench.CutoffEnv{Bin: bin, Dir: dir, LostStatus: ExitLockLost}
	if b.etcd != nil {
		env.Etcd = []string{b.etcd.Endpoint}
	}
	for _, c := range b.plan.cutoffs {
		var outcomes []bench.CutoffOutcome
		for round := 1; round <= b.opt.rounds; round++ {
			o, err := bench.RunCutoff(ctx, env, c)
			if err != nil {
				return fmt.Errorf("cutoff %s, round %d: %w", c, round, err)
			}
			fmt.Fprintf(b.stderr, "cutoff %s round %d: %s\n", c, round, cutoffRoundText(o))
			outcomes = append(outcomes, o)
		}
		b.report.cutoff = append(b.report.cutoff, bench.SummarizeCutoff(c, outcomes))
	}
	b.report.setup = append(b.report.setup, fmt.Sprintf("cutoff: per case and round, fresh `dlock serve` processes (memory: one, --session-grace 3s; etcd: three on one data set of the etcd above, --session-grace 5s; --ping-interval 1s --dead-peer-timeout 3s) and two `dlock run` on one key, the holder dialing from a loopback address of its own; faults by iptables, SIGSTOP and black-holing proxies; %d rounds each", b.opt.rounds))
	return nil
}

// memory measures servers' RSS with locks held and sessions open: of
// --memory-server, or of a fresh dlock serve (on --backend etcd's etcd,
// with one) for each measurement.
func (b *benchRun) memory(ctx context.Context) error {
	o := b.opt
	mo := bench.MemoryOptions{Held: o.held, HeldNodes: o.heldNodes, Sessions: o.sessions, Conns: o.concurrency,
		Done: func(r bench.Result) { fmt.Fprintf(b.stderr, "memory %s: %s\n", r.Scenario, r.Note) }}
	if o.memoryServer != "" {
		mo.Dialer = b.dialer
		mo.Start = func(context.Context) (string, func(), error) { return o.memoryServer, func() {}, nil }
	} else {
		bin, err := benchServerBinary()
		if err != nil {
			return fmt.Errorf("memory: the dlock binary to serve: %w", err)
		}
		mo.Start = freshServer(bin, append(freshServerFlags(o.sessions+o.heldNodes, o.held), b.extraServe...), b.stderr)
		if b.etcd != nil {
			n := 0
			mo.Start = b.startOnEtcd(func() string { n++; return shortPrefix('m', n) })
		}
	}
	rs, err := bench.Memory(ctx, mo)
	if err != nil {
		return fmt.Errorf("memory: %w", err)
	}
	b.report.results = append(b.report.results, rs...)
	return nil
}

// failover measures a node's hold across SIGKILLs of the dlock servers on
// --backend etcd's etcd.
func (b *benchRun) failover(ctx context.Context) error {
	o := b.opt
	prefix := fmt.Sprintf("/dlock-bench-failover-%d/", time.Now().UnixNano())
	fo := bench.FailoverOptions{Servers: o.servers, Rounds: o.rounds, Recheck: o.recheck, Client: !o.failoverRaw, Start: b.startOnEtcd(func() string { return prefix }),
		Round: func(r bench.FailoverRound) {
			fmt.Fprintf(b.stderr, "failover round: next lock %v, stream resumed %v, hold kept %v, next grant delivered %v %s\n", r.Lock, r.Stream, r.Kept, r.Replayed, r.Problem)
		}}
	// No etcd calls per op: the replacement servers' starts would count
	// too.
	r, err := b.timed(ctx, "failover dlock", b.load, func(ctx context.Context, o bench.Options) (bench.Result, error) {
		fo.Progress = o.Progress
		return bench.Failover(ctx, fo)
	})
	if err != nil {
		return fmt.Errorf("failover: %w", err)
	}
	nodeText := "client.Client given every server"
	if o.failoverRaw {
		nodeText = "raw HTTP"
	}
	b.report.setup = append(b.report.setup, fmt.Sprintf("failover: %d `dlock serve --backend etcd --etcd-prefix %s` on that etcd, started by bench; the node: %s", o.servers, prefix, nodeText))
	b.report.results = append(b.report.results, r)
	return nil
}

// fleet measures --nodes nodes spread over --servers dlock servers on
// --backend etcd's etcd, one of them SIGKILLed.
func (b *benchRun) fleet(ctx context.Context) error {
	o := b.opt
	prefix := shortPrefix('f', 1)
	bin, err := benchServerBinary()
	if err != nil {
		return fmt.Errorf("fleet: the dlock binary to serve: %w", err)
	}
	flags := append(append([]string{"--backend", "etcd", "--etcd-endpoints", b.etcd.Endpoint, "--etcd-prefix", prefix},
		freshServerFlags(o.nodes, o.fleetHeld+o.holders+64)...), b.extraServe...)
	floorFlags := append(append([]string{"--backend", "memory"}, freshServerFlags(o.nodes, o.fleetHeld+o.holders+64)...), b.extraServe...)
	fo := bench.FleetOptions{Servers: o.servers, Nodes: o.nodes, Holders: o.holders, Held: o.fleetHeld,
		Opening: o.opening, Conns: o.concurrency, Idle: o.idle, Recheck: o.recheck,
		Start: freshServer(bin, flags, b.stderr), Floor: freshServer(bin, floorFlags, b.stderr), EtcdEndpoint: b.etcd.Endpoint, EtcdCPU: bench.ProcCPU(b.etcd.PID),
		Log: func(l string) { fmt.Fprintln(b.stderr, l) }}
	rs, err := bench.Fleet(ctx, fo)
	if err != nil {
		return fmt.Errorf("fleet: %w", err)
	}
	b.report.results = append(b.report.results, rs...)
	b.report.setup = append(b.report.setup, fmt.Sprintf("fleet: %d `dlock serve %s` on that etcd, started by bench; %d nodes, node i's session stream on server i mod %d, read by a goroutine each; locks and waiters over %d connections to each server; etcd's CPU from /proc/%d/stat, the servers' from their /metrics; before them, the same opening on %d `dlock serve %s` (fleet-open-floor)",
		o.servers, strings.Join(flags, " "), o.nodes, o.servers, o.concurrency, b.etcd.PID, o.servers, strings.Join(floorFlags, " ")))
	return nil
}

// compare runs those of pairs and handoff that the plan has against sys:
// a redis or an etcd started for them, or --backend etcd's etcd, the
// same as dlock's backend.
func (b *benchRun) compare(ctx context.Context, sys string) error {
	var addr string
	var stop func()
	var err error
	var pairs, handoff func(context.Context, string, bench.Options) (bench.Result, error)
	oo := b.load
	switch sys {
	case "redis":
		addr, stop, err = bench.StartRedis()
		pairs, handoff = bench.RedisPairs, bench.RedisHandoff
		oo.ServerCPU = bench.RedisCPU(addr)
	case "etcd":
		if b.etcd != nil {
			// The same etcd as dlock's backend: a fair comparison.
			addr, stop = b.etcd.Endpoint, func() {}
		} else {
			addr, stop, err = bench.StartEtcd(b.opt.etcdBin)
		}
		pairs, handoff = bench.EtcdPairs, bench.EtcdHandoff
		oo.ServerCPU = bench.MetricsCPU(addr, rawhttp.Dialer{})
	}
	if err != nil {
		return err
	}
	for _, s := range b.plan.runs {
		f := map[string]func(context.Context, string, bench.Options) (bench.Result, error){"pairs": pairs, "handoff": handoff}[s]
		if f == nil {
			continue
		}
		count := ""
		if sys == "etcd" {
			count = addr
		}
		r, err := b.timed(ctx, s+" "+sys, oo, withEtcdCalls(count, func(ctx context.Context, opt bench.Options) (bench.Result, error) { return f(ctx, addr, opt) }))
		if err != nil {
			stop()
			return fmt.Errorf("%s %s: %w", s, sys, err)
		}
		b.report.results = append(b.report.results, r)
	}
	stop()
	if sys == "etcd" && b.etcd != nil {
		b.report.setup = append(b.report.setup, "etcd's concurrency.Mutex (--compare etcd): on the same etcd")
	}
	return nil
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

// shortPrefix is the etcd key prefix of the n-th data set of a kind
// (memory's fresh servers, the fleet) on the etcd bench started for this
// run, which no other run shares: as long as the default prefix
// (etcd.DefaultPrefix, "/dlock/"). Every key a server keeps begins with
// it, so that a measurement of a server's memory is a default
// deployment's, where a prefix of some 40 characters added 32 bytes a
// key (docs/BENCHMARKS.md, "What a server on etcd keeps per key, a third
// time").
func shortPrefix(kind byte, n int) string { return fmt.Sprintf("/dl%c%02d/", kind, n%100) }
