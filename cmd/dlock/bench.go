package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os/exec"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/dlock/dlock/internal/bench"
	"github.com/dlock/dlock/internal/rawhttp"
)

// cmdBench is the load generator: scenarios against a running dlock server
// and, with --compare, the same work against Redis and etcd.
func cmdBench(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("dlock bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	server := fs.String("server", "http://127.0.0.1:7380", "dlock server URL")
	scenarios := fs.String("scenario", "pairs,handoff,fanout,sessions", "scenarios to run: pairs, handoff, fanout, sessions, memory")
	duration := fs.Duration("duration", 10*time.Second, "how long each scenario runs")
	concurrency := fs.Int("concurrency", 32, "connections (pairs, sessions) or nodes on the key (handoff)")
	waiters := fs.Int("waiters", 1000, "fanout: waiters, each with its own session, queued on one key")
	heldN := fs.Int("held", 100000, "memory: locks to hold while the server's RSS is read")
	sessionsN := fs.Int("sessions", 10000, "memory: session streams to keep open while the server's RSS is read")
	compare := fs.String("compare", "", "also run pairs and handoff against: redis, etcd (comma-separated; started on 127.0.0.1)")
	asJSON := fs.Bool("json", false, "print the results as JSON")
	asMarkdown := fs.Bool("markdown", false, "print the results as a Markdown table (make bench appends it to docs/BENCHMARKS.md)")
	cred := credentialFlags(fs)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usageError{err}
	}
	if err := applyEnv(fs, getenv); err != nil {
		return usageError{err}
	}
	runs := strings.Split(*scenarios, ",")
	for _, s := range runs {
		if !slices.Contains([]string{"pairs", "handoff", "fanout", "sessions", "memory"}, s) {
			return usageError{fmt.Errorf("unknown scenario %q", s)}
		}
	}
	var others []string
	if *compare != "" {
		others = strings.Split(*compare, ",")
		for _, o := range others {
			bin := map[string]string{"redis": "redis-server", "etcd": "etcd"}[o]
			if bin == "" {
				return usageError{fmt.Errorf("--compare: unknown system %q (redis, etcd)", o)}
			}
			if _, err := exec.LookPath(bin); err != nil {
				return fmt.Errorf("--compare %s: %s is not installed (Debian: apt-get install %s)", o, bin, map[string]string{"redis": "redis-server", "etcd": "etcd-server"}[o])
			}
		}
	}
	if *concurrency < 1 || *waiters < 1 || *duration <= 0 || *heldN < 0 || *sessionsN < 0 {
		return usageError{errors.New("--concurrency, --waiters and --duration must be positive, --held and --sessions not negative")}
	}
	tlsConfig, token, err := loadCredentials(cred, *server)
	if err != nil {
		return err
	}
	dialer := rawhttp.Dialer{TLS: tlsConfig, Token: token}
	opts := bench.Options{Duration: *duration, Concurrency: *concurrency, Waiters: *waiters, Dialer: dialer}
	run := func(label string, f func(context.Context, bench.Options) (bench.Result, error)) (bench.Result, error) {
		o := opts
		start := time.Now()
		o.Progress = func(ops int64) {
			fmt.Fprintf(stderr, "\r%-22s %10d ops %10.0f/s", label, ops, float64(ops)/time.Since(start).Seconds())
		}
		r, err := f(ctx, o)
		fmt.Fprintf(stderr, "\r%-22s done%40s\n", label, "")
		return r, err
	}
	var results []bench.Result
	for _, s := range runs {
		if s == "memory" {
			// Sessions first: the held locks' ttl leases outlive the run.
			// Each measures best on a fresh server: --held 0 or --sessions 0
			// leaves one out.
			var fs []func() (bench.Result, error)
			if *sessionsN > 0 {
				fs = append(fs, func() (bench.Result, error) { return bench.OpenSessions(ctx, *server, dialer, *sessionsN) })
			}
			if *heldN > 0 {
				fs = append(fs, func() (bench.Result, error) { return bench.HeldLocks(ctx, *server, dialer, *heldN, *concurrency) })
			}
			for _, f := range fs {
				r, err := f()
				if err != nil {
					return fmt.Errorf("memory: %w", err)
				}
				fmt.Fprintf(stderr, "memory: %s\n", r.Note)
				results = append(results, r)
			}
			continue
		}
		var f func(context.Context, string, bench.Options) (bench.Result, error)
		switch s {
		case "pairs":
			f = bench.Pairs
		case "handoff":
			f = bench.Handoff
		case "fanout":
			f = bench.Fanout
		case "sessions":
			f = bench.Sessions
		}
		r, err := run(s+" dlock", func(ctx context.Context, o bench.Options) (bench.Result, error) { return f(ctx, *server, o) })
		if err != nil {
			return fmt.Errorf("%s: %w", s, err)
		}
		results = append(results, r)
	}
	for _, o := range others {
		var addr string
		var stop func()
		var err error
		var pairs, handoff func(context.Context, string, bench.Options) (bench.Result, error)
		switch o {
		case "redis":
			addr, stop, err = bench.StartRedis()
			pairs, handoff = bench.RedisPairs, bench.RedisHandoff
		case "etcd":
			addr, stop, err = bench.StartEtcd()
			pairs, handoff = bench.EtcdPairs, bench.EtcdHandoff
		}
		if err != nil {
			return err
		}
		for _, s := range runs {
			f := map[string]func(context.Context, string, bench.Options) (bench.Result, error){"pairs": pairs, "handoff": handoff}[s]
			if f == nil {
				continue
			}
			r, err := run(s+" "+o, func(ctx context.Context, opt bench.Options) (bench.Result, error) { return f(ctx, addr, opt) })
			if err != nil {
				stop()
				return fmt.Errorf("%s %s: %w", s, o, err)
			}
			results = append(results, r)
		}
		stop()
	}
	ratios := benchRatios(results)
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(map[string]any{"results": results, "ratios": ratios})
	}
	if *asMarkdown {
		fmt.Fprintln(stdout, "| scenario | system | concurrency | ops/s | p50 | p90 | p99 | max | one op | server RSS |")
		fmt.Fprintln(stdout, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
		for _, r := range results {
			fmt.Fprintf(stdout, "| %s | %s | %d | %.0f | %s | %s | %s | %s | %s | %s |\n", r.Scenario, r.System, r.Concurrency, r.Rate, us(r.P50), us(r.P90), us(r.P99), us(r.Max), r.Unit, rssText(r))
		}
		fmt.Fprintln(stdout)
		for _, r := range results {
			if r.Note != "" {
				fmt.Fprintf(stdout, "- %s %s: %s\n", r.Scenario, r.System, r.Note)
			}
		}
		for _, k := range slices.Sorted(maps.Keys(ratios)) {
			fmt.Fprintf(stdout, "- %s = %.2f\n", k, ratios[k])
		}
		return nil
	}
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "scenario\tsystem\tconcurrency\tops/s\tp50\tp90\tp99\tmax\tone op\tserver RSS\t")
	for _, r := range results {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%.0f\t%s\t%s\t%s\t%s\t%s\t%s\t\n", r.Scenario, r.System, r.Concurrency, r.Rate, us(r.P50), us(r.P90), us(r.P99), us(r.Max), r.Unit, rssText(r))
	}
	tw.Flush()
	for _, r := range results {
		if r.Note != "" {
			fmt.Fprintf(stdout, "%s %s: %s\n", r.Scenario, r.System, r.Note)
		}
	}
	for _, k := range slices.Sorted(maps.Keys(ratios)) {
		fmt.Fprintf(stdout, "%s = %.2f\n", k, ratios[k])
	}
	return nil
}

// benchRatios divides dlock's rate by each other system's, per scenario.
func benchRatios(results []bench.Result) map[string]float64 {
	ratios := map[string]float64{}
	for _, d := range results {
		if d.System != "dlock" {
			continue
		}
		for _, o := range results {
			if o.System != "dlock" && o.Scenario == d.Scenario && o.Rate > 0 {
				ratios[fmt.Sprintf("%s dlock/%s", d.Scenario, o.System)] = d.Rate / o.Rate
			}
		}
	}
	return ratios
}

func us(v float64) string {
	switch {
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
