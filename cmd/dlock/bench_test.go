package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/bench"
	"github.com/dlock/dlock/internal/dlocktest"
	"github.com/dlock/dlock/internal/netfault"
	"github.com/dlock/dlock/lock/etcd"
)

// freshServer runs the real binary on a loopback port, answering, and
// stop ends it: the port refuses connections after.
func TestFreshServer(t *testing.T) {
	// A DLOCK_ setting of the bench's environment is not the fresh
	// server's: with this one it would not start.
	t.Setenv("DLOCK_TOKEN_FILE", "/nonexistent/tokens")
	start := freshServer(dlockBinary(t), freshServerFlags(10, 10), io.Discard)
	base, stop, err := start(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(base)
	if err != nil || u.Hostname() != "127.0.0.1" {
		t.Fatalf("fresh server at %q: %v; want 127.0.0.1", base, err)
	}
	resp, err := http.Post(base+"/lock", "application/json", strings.NewReader(`{"type":"pull","resource_id":"r","node_id":"a"}`))
	if err != nil {
		stop()
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		stop()
		t.Fatalf("lock on the fresh server: %s", resp.Status)
	}
	if rss, err := bench.ServerRSS(base, bench.Options{}.Dialer); err != nil || rss <= 0 {
		stop()
		t.Fatalf("fresh server's RSS: %v %v", rss, err)
	}
	http.DefaultClient.CloseIdleConnections()
	stop()
	if c, err := net.Dial("tcp", u.Host); err == nil {
		c.Close()
		t.Fatalf("%s still accepts connections after stop", u.Host)
	}
	// A second one is another process, on its own port, empty.
	base2, stop2, err := start(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer stop2()
	resp, err = http.Get(base2 + "/status?type=pull&resource_id=r")
	if err != nil {
		t.Fatal(err)
	}
	var st struct{ State string }
	json.NewDecoder(resp.Body).Decode(&st)
	resp.Body.Close()
	if st.State == "held" {
		t.Fatalf("the second fresh server %s holds the first one's lock", base2)
	}
}

func TestFreshServerFlags(t *testing.T) {
	if f := freshServerFlags(10000+100, 100000); len(f) != 0 {
		t.Errorf("the defaults allow 10,100 sessions and 100,000 keys, yet flags %q", f)
	}
	f := freshServerFlags(500000, 5000000)
	if !slices.Equal(f, []string{"--max-sessions", "500064", "--max-keys", "5000064"}) {
		t.Errorf("flags for 500,000 sessions and 5,000,000 keys: %q", f)
	}
}

// useBinary makes the test's dlock bench run the built binary as its
// fresh servers and floor writers, not the test binary.
func useBinary(t *testing.T) {
	bin := dlockBinary(t)
	old := benchServerBinary
	benchServerBinary = func() (string, error) { return bin, nil }
	t.Cleanup(func() { benchServerBinary = old })
}

// dlock bench --scenario memory: three fresh servers, three results.
func TestBenchMemory(t *testing.T) {
	useBinary(t)
	out, errOut, st := inProcess(t, nil, "bench", "--scenario", "memory", "--held", "300", "--held-nodes", "3", "--sessions", "30", "--concurrency", "4", "--json")
	var res struct {
		Results []bench.Result
	}
	if st != 0 || json.Unmarshal([]byte(out), &res) != nil {
		t.Fatalf("bench memory: %d %q %q", st, out, errOut)
	}
	var got []string
	for _, r := range res.Results {
		got = append(got, r.Scenario)
		if r.RSSMiB <= 0 || r.EmptyRSSMiB <= 0 || r.Note == "" {
			t.Errorf("%s: %+v", r.Scenario, r)
		}
	}
	if !slices.Equal(got, []string{"idle-sessions", "held-session", "held-ttl"}) {
		t.Fatalf("memory results %q", got)
	}
}

// dlock bench --scenario fanout: the floor comes with it, written by a
// dlock process, and the ratios.
func TestBenchFanoutFloor(t *testing.T) {
	useBinary(t)
	srv := dlocktest.Start(t, dlocktest.Options{})
	out, errOut, st := inProcess(t, nil, "bench", "--server", srv.URL(), "--scenario", "fanout", "--waiters", "20", "--duration", "100ms", "--json")
	var res struct {
		Results []bench.Result
		Ratios  map[string]float64
	}
	if st != 0 || json.Unmarshal([]byte(out), &res) != nil || len(res.Results) != 2 {
		t.Fatalf("bench fanout: %d %q %q", st, out, errOut)
	}
	d, f := res.Results[0], res.Results[1]
	if d.Scenario != "fanout" || f.Scenario != "fanout-floor" || f.Rounds != max(d.Rounds, 5) || f.Ops != int64(20*f.Rounds) {
		t.Fatalf("fanout and floor: %+v %+v", d, f)
	}
	if d.ServerCPUPerOp <= 0 {
		t.Errorf("fanout: no server CPU read: %+v", d)
	}
	for _, k := range []string{"fanout max dlock/floor", "fanout median round dlock/floor"} {
		if res.Ratios[k] <= 0 {
			t.Errorf("no ratio %q: %v", k, res.Ratios)
		}
	}
	out, _, st = inProcess(t, nil, "bench", "--server", srv.URL(), "--scenario", "fanout", "--waiters", "5", "--duration", "10ms", "--markdown")
	if st != 0 || !strings.Contains(out, "| fanout-floor | loopback | 5 |") || !strings.Contains(out, "- fanout max dlock/floor = ") || !strings.Contains(out, "server CPU/op") {
		t.Fatalf("markdown: %q", out)
	}
}

// dlock bench --scenario pings: a fresh server per interval, the pings of
// its idle streams counted; the shorter interval, the more pings, in
// proportion. A check of the measurement, not of its numbers.
func TestBenchPings(t *testing.T) {
	useBinary(t)
	const streams = 50
	out, errOut, st := inProcess(t, nil, "bench", "--scenario", "pings", "--sessions", "50", "--ping-intervals", "100ms,400ms", "--ping-window", "1s", "--json")
	var res struct {
		Results []bench.Result
		Pings   []bench.PingResult
		Setup   []string
	}
	if st != 0 || json.Unmarshal([]byte(out), &res) != nil || len(res.Pings) != 2 || len(res.Results) != 0 || len(res.Setup) != 1 {
		t.Fatalf("bench pings: %d %q %q", st, out, errOut)
	}
	for i, want := range []struct {
		ms     float64
		window float64
	}{{100, 1}, {400, 1.2}} {
		r := res.Pings[i]
		if r.IntervalMS != want.ms || r.Streams != streams || r.Seconds < want.window || r.Seconds > want.window+0.5 {
			t.Errorf("row %d: %+v, want interval %vms, %d streams, a %vs window", i, r, want.ms, streams, want.window)
		}
		if r.Pings <= 0 || r.Rate <= 0 || r.FewestPings < 1 || math.Abs(r.Expected-streams*1000/want.ms) > 1e-6 {
			t.Errorf("row %d: no pings measured: %+v", i, r)
		}
		if r.PingBytes != float64(len(bench.PingFrame)) || r.Bytes != r.Pings*int64(len(bench.PingFrame)) || math.Abs(r.BytesPerStream*streams-r.BytesPerSecond) > 1e-6 {
			t.Errorf("row %d: bytes %d for %d pings: %+v", i, r.Bytes, r.Pings, r)
		}
		// The server's CPU is read (an unread one fails the run), in steps
		// of 10 ms: a second of 50 streams' pings may round to none.
		if r.ServerCPU < 0 || r.ServerCPUPerPing < 0 {
			t.Errorf("row %d: server CPU %+v", i, r)
		}
	}
	// A quarter of the interval, four times the pings: at least twice,
	// whatever the machine's load.
	if a, b := res.Pings[0].Rate, res.Pings[1].Rate; a < 2*b || a > 8*b {
		t.Errorf("%.0f pings/s at 100ms, %.0f at 400ms: not about 4 times", a, b)
	}
	out, _, st = inProcess(t, nil, "bench", "--scenario", "pings", "--sessions", "5", "--ping-intervals", "50ms", "--ping-window", "200ms")
	if st != 0 || !strings.Contains(out, "ping interval") || !strings.Contains(out, "bytes a ping") || !strings.Contains(out, " 50ms ") || strings.Contains(out, "scenario") {
		t.Fatalf("the pings table: %q", out)
	}
	for _, bad := range [][]string{{"--ping-intervals", "5ms"}, {"--ping-intervals", "2m"}, {"--ping-intervals", ","}, {"--sessions", "0"}, {"--backend", "etcd"}} {
		if _, errOut, st := inProcess(t, nil, append([]string{"bench", "--scenario", "pings"}, bad...)...); st != 2 {
			t.Errorf("bench pings %q: status %d %q, want a usage error", bad, st, errOut)
		}
	}
}

func TestBenchRatios(t *testing.T) {
	results := []bench.Result{
		{Scenario: "pairs", System: "dlock", Rate: 20000, ServerCPUPerOp: 40, Unit: "lock+unlock"},
		{Scenario: "fanout", System: "dlock", Max: 150000, RoundMedian: 90000, Unit: "waiter told"},
		{Scenario: "fanout-floor", System: "loopback", Max: 50000, RoundMedian: 60000},
		{Scenario: "pairs", System: "redis", Rate: 10000, ServerCPUPerOp: 10, Unit: "lock+unlock"},
		{Scenario: "pairs", System: "etcd", Rate: 1000, Unit: "lock+unlock"},
	}
	want := map[string]float64{
		"pairs dlock/redis":               2,
		"pairs dlock/etcd":                20,
		"pairs server CPU/op dlock/redis": 4,
		"fanout max dlock/floor":          3,
		"fanout median round dlock/floor": 1.5,
	}
	got := benchRatios(results)
	if len(got) != len(want) {
		t.Errorf("ratios %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %v, want %v", k, got[k], v)
		}
	}
	if l := cpuLines(results); !slices.Equal(l, []string{"pairs server CPU per lock+unlock: dlock 40.0µs, redis 10.0µs"}) {
		t.Errorf("CPU lines %q", l)
	}
}

// dlock bench --backend etcd: one etcd, started by bench and reported with
// its setup; the dlock server it starts on it and --compare etcd both
// measured on it, with etcd's calls per op; and the fail-over scenario on
// servers it starts on the same etcd (docs/BENCHMARKS.md, "dlock on etcd").
func TestBenchBackendEtcd(t *testing.T) {
	if _, err := exec.LookPath("etcd"); err != nil {
		if os.Geteuid() != 0 {
			t.Skip("SKIPPED LOUDLY: etcd is not installed and installing it needs root; run `make test` as root")
		}
		t.Fatal("etcd is not installed: `make test` installs it")
	}
	useBinary(t)
	out, errOut, st := inProcess(t, nil, "bench", "--backend", "etcd", "--scenario", "pairs,failover", "--compare", "etcd",
		"--duration", "1s", "--concurrency", "2", "--servers", "2", "--rounds", "2", "--recheck", "0", "--json")
	var res struct {
		Results []bench.Result
		Setup   []string
	}
	if st != 0 || json.Unmarshal([]byte(out), &res) != nil || len(res.Results) != 3 {
		t.Fatalf("bench --backend etcd: %d %q %q", st, out, errOut)
	}
	var endpoints []string
	for _, s := range res.Setup {
		if i := strings.Index(s, "http://127.0.0.1:"); i >= 0 {
			endpoints = append(endpoints, strings.TrimRight(strings.Fields(s[i:])[0], ",`"))
		}
	}
	if len(res.Setup) != 4 || !strings.Contains(res.Setup[0], "fsync on") || !strings.Contains(res.Setup[0], "data dir ") ||
		!strings.Contains(res.Setup[1], "dlock serve --backend etcd --etcd-endpoints "+endpoints[0]) || !strings.Contains(res.Setup[3], "same etcd") {
		t.Fatalf("setup %q", res.Setup)
	}
	for _, r := range res.Results {
		switch r.Scenario + " " + r.System {
		case "pairs dlock", "pairs etcd":
			if r.Ops == 0 || r.EtcdCallsPerOp["Txn"] <= 0 {
				t.Errorf("%s %s: %+v", r.Scenario, r.System, r)
			}
		case "failover dlock":
			if r.Rounds != 2 || r.Concurrency != 2 || !strings.Contains(r.Note, "holds kept 2/2") {
				t.Errorf("failover: %+v", r)
			}
		default:
			t.Errorf("unexpected result %+v", r)
		}
	}
	for _, args := range [][]string{
		{"--scenario", "failover"},
		{"--backend", "etcd", "--server", "http://127.0.0.1:1"},
		{"--backend", "redis"},
		{"--backend", "etcd", "--servers", "1"},
	} {
		if _, errOut, st := inProcess(t, nil, append([]string{"bench"}, args...)...); st != 2 {
			t.Errorf("bench %q: exit %d, want 2 (usage): %s", args, st, errOut)
		}
	}
}

// dlock bench --backend etcd --scenario fleet, small (docs/BENCHMARKS.md,
// "Fleet scale on etcd"): three servers on bench's etcd, nodes spread over
// them, one server killed under its nodes, which move with their holds;
// the fan-out to every node and the locks held after it.
func TestBenchFleet(t *testing.T) {
	if _, err := exec.LookPath("etcd"); err != nil {
		if os.Geteuid() != 0 {
			t.Skip("SKIPPED LOUDLY: etcd is not installed and installing it needs root; run `make test` as root")
		}
		t.Fatal("etcd is not installed: `make test` installs it")
	}
	useBinary(t)
	// --etcd names the etcd bench starts: here the one in PATH under a name
	// of its own, which the setup then names (the path of etcd in PATH
	// would be named by a bench that ignored --etcd too).
	inPath, err := exec.LookPath("etcd")
	if err != nil {
		t.Fatal(err)
	}
	etcdBin := filepath.Join(t.TempDir(), "etcd-by-flag")
	if err := os.Symlink(inPath, etcdBin); err != nil {
		t.Fatal(err)
	}
	out, errOut, st := inProcess(t, nil, "bench", "--backend", "etcd", "--etcd", etcdBin, "--scenario", "fleet", "--nodes", "30", "--holders", "6",
		"--fleet-held", "90", "--idle", "1s", "--recheck", "6s", "--concurrency", "2", "--serve-flags", "--session-grace 10s", "--json")
	var res struct {
		Results []bench.Result
		Setup   []string
	}
	if st != 0 || json.Unmarshal([]byte(out), &res) != nil || len(res.Results) != 5 {
		t.Fatalf("bench fleet: %d %q %q", st, out, errOut)
	}
	want := map[string]func(bench.Result) bool{
		"fleet-open": func(r bench.Result) bool {
			return r.Ops == 30 && r.RSSMiB > 0 && strings.Contains(r.Note, "over 3 servers") && strings.Contains(r.Note, "CPU in % of one core: etcd ") &&
				strings.Contains(r.Note, "CPU while opening, in seconds: etcd ") && strings.Contains(r.Note, ", server 3 ") && strings.Contains(r.Note, ", the nodes (bench) ")
		},
		"fleet-open-floor": func(r bench.Result) bool {
			_, cpu, ok := strings.Cut(r.Note, "CPU while opening, in seconds: ")
			return r.Ops == 30 && r.RSSMiB > 0 && strings.HasPrefix(r.Note, "no etcd ") && ok && strings.HasPrefix(cpu, "server 1 ") &&
				strings.Contains(cpu, ", the nodes (bench) ") && !strings.Contains(cpu, "etcd") && !strings.Contains(r.Note, "idle for")
		},
		"fleet-failover": func(r bench.Result) bool {
			return r.Ops == 10 && strings.Contains(r.Note, "holds kept 6/6") && strings.Contains(r.Note, "and 6/6 6s after the kill") && !strings.Contains(r.Note, "FAILED")
		},
		"fleet-fanout": func(r bench.Result) bool { return r.Ops == 30 && r.Max > 0 },
		"fleet-held": func(r bench.Result) bool {
			return r.Ops == 90 && r.RSSMiB > 0 && strings.Contains(r.Note, "etcd's database ")
		},
	}
	for _, r := range res.Results {
		if ok := want[r.Scenario]; ok == nil || !ok(r) {
			t.Errorf("%s: %+v", r.Scenario, r)
		}
		delete(want, r.Scenario)
	}
	if len(want) > 0 || len(res.Setup) != 2 || !strings.Contains(res.Setup[0], " ("+etcdBin+"), one member") ||
		!strings.Contains(res.Setup[1], "3 `dlock serve --backend etcd --etcd-endpoints ") ||
		!strings.Contains(res.Setup[1], " --session-grace 10s`") || !strings.Contains(res.Setup[1], "3 `dlock serve --backend memory ") {
		t.Errorf("missing %v; setup %q", want, res.Setup)
	}
	// One server's idle sessions on etcd, as docs/BENCHMARKS.md measures
	// them beside the fleet.
	out, errOut, st = inProcess(t, nil, "bench", "--backend", "etcd", "--scenario", "memory", "--held", "0", "--sessions", "20",
		"--serve-flags", "--session-grace 10s", "--json")
	var mem struct{ Results []bench.Result }
	if st != 0 || json.Unmarshal([]byte(out), &mem) != nil || len(mem.Results) != 1 || mem.Results[0].Scenario != "idle-sessions" || mem.Results[0].RSSMiB <= 0 {
		t.Fatalf("bench memory on etcd: %d %q %q", st, out, errOut)
	}
	for _, args := range [][]string{
		{"--scenario", "fleet"},
		{"--backend", "etcd", "--scenario", "fleet", "--nodes", "2"},
		{"--backend", "etcd", "--scenario", "fleet", "--nodes", "10", "--holders", "11"},
		{"--backend", "etcd", "--etcd", filepath.Join(t.TempDir(), "no-etcd"), "--scenario", "fleet"},
	} {
		if _, errOut, st := inProcess(t, nil, append([]string{"bench"}, args...)...); st != 2 {
			t.Errorf("bench %q: exit %d, want 2 (usage): %s", args, st, errOut)
		}
	}
}

// dlock bench --scenario cutoff: its flags, and without root (faked here)
// it says it cannot run and exits non-zero.
func TestBenchCutoffFlags(t *testing.T) {
	old := cutoffUsable
	t.Cleanup(func() { cutoffUsable = old })
	cutoffUsable = func() error { return errors.New("dropping packets with iptables needs root") }
	_, errOut, st := inProcess(t, nil, "bench", "--scenario", "cutoff")
	if st != 1 || !strings.Contains(errOut, "the cutoff scenario cannot run") || !strings.Contains(errOut, "needs root") {
		t.Fatalf("cutoff without root: exit %d, %q; want 1 saying it cannot run", st, errOut)
	}
	for _, args := range [][]string{
		{"--scenario", "cutoff", "--cutoff", "etcd-cut"},        // needs --backend etcd
		{"--scenario", "cutoff", "--cutoff", "memory-cut,nope"}, // no such case
		{"--scenario", "pairs", "--cutoff", "memory-cut"},       // --cutoff without the scenario
		{"--scenario", "cutoff", "--rounds", "0"},
	} {
		if _, errOut, st := inProcess(t, nil, append([]string{"bench"}, args...)...); st != 2 {
			t.Errorf("bench %q: exit %d, want 2 (usage): %s", args, st, errOut)
		}
	}
	if got, err := cutoffList("", false); err != nil || !slices.Equal(got, []string{bench.CutoffMemoryCut, bench.CutoffMemoryToHolder, bench.CutoffMemoryFromHolder}) {
		t.Errorf("default cases without etcd: %q %v", got, err)
	}
	if got, err := cutoffList("", true); err != nil || !slices.Equal(got, bench.CutoffScenarios) {
		t.Errorf("default cases with etcd: %q %v", got, err)
	}
	if got, err := cutoffList(" etcd-frozen ,memory-cut", true); err != nil || !slices.Equal(got, []string{bench.CutoffEtcdFrozen, bench.CutoffMemoryCut}) {
		t.Errorf("--cutoff ' etcd-frozen ,memory-cut': %q %v", got, err)
	}
}

// The cutoff table: the three measures and the overlap per case, in text
// and Markdown; an overlap, or any problem, fails the run.
func TestBenchCutoffPrint(t *testing.T) {
	ok := bench.SummarizeCutoff(bench.CutoffMemoryCut, []bench.CutoffOutcome{
		{Stopped: 2 * time.Second, Next: 6 * time.Second},
		{Stopped: 2200 * time.Millisecond, Next: 7 * time.Second},
		{Kept: true, Next: 11 * time.Second},
	})
	if ok.Rounds != 3 || ok.Kept != 1 || ok.StoppedMax != 2200 || ok.NextMax != 7000 || ok.NextP50 != 6500 || ok.Bound != 17000 || ok.Failed() {
		t.Fatalf("summary %+v", ok)
	}
	bad := bench.SummarizeCutoff(bench.CutoffEtcdCut, []bench.CutoffOutcome{
		{Stopped: 4 * time.Second, Next: 3 * time.Second, Overlap: time.Second, OverlapLines: 20, Problems: []string{"OVERLAP: 20 lines"}},
	})
	if !bad.Failed() || bad.Overlap != 1000 || len(bad.Problems) != 1 || !strings.HasPrefix(bad.Problems[0], "round 1: ") {
		t.Fatalf("summary %+v", bad)
	}
	var text, md strings.Builder
	printCutoff(&text, []bench.CutoffSummary{ok, bad}, false)
	printCutoff(&md, []bench.CutoffSummary{ok, bad}, true)
	for _, want := range []string{"cut → holder stopped (p50 / max)", "cut → next holder running (p50 / max)", "overlap", "2.10 s / 2.20 s", "6.50 s / 7.00 s", "17.00 s", "1/3", "0 ms, 0 lines", "1000 ms, 20 lines", "FAILED etcd-cut round 1: OVERLAP"} {
		if !strings.Contains(text.String(), want) {
			t.Errorf("text table lacks %q:\n%s", want, text.String())
		}
	}
	if !strings.Contains(md.String(), "| memory-cut | 3 | 1/3 | 2.10 s / 2.20 s | 6.50 s / 7.00 s | 17.00 s | 0 ms, 0 lines |") {
		t.Errorf("markdown:\n%s", md.String())
	}
	if err := cutoffFailed([]bench.CutoffSummary{ok}); err != nil {
		t.Errorf("a clean run failed: %v", err)
	}
	if err := cutoffFailed([]bench.CutoffSummary{ok, bad}); err == nil || !strings.Contains(err.Error(), "etcd-cut") {
		t.Errorf("a run with an overlap: %v", err)
	}
}

// dlock bench --scenario cutoff, one round of the memory engine's cut, for
// real (as root).
func TestBenchCutoff(t *testing.T) {
	netfault.NeedRoot(t)
	useBinary(t)
	out, errOut, st := inProcess(t, nil, "bench", "--scenario", "cutoff", "--cutoff", "memory-cut", "--rounds", "1", "--json")
	var res struct {
		Cutoff []bench.CutoffSummary
		Setup  []string
	}
	if st != 0 || json.Unmarshal([]byte(out), &res) != nil || len(res.Cutoff) != 1 {
		t.Fatalf("bench cutoff: %d %q %q", st, out, errOut)
	}
	c := res.Cutoff[0]
	if c.Scenario != bench.CutoffMemoryCut || c.Rounds != 1 || c.Failed() || c.StoppedMax <= 0 || c.NextMax <= c.StoppedMax || len(res.Setup) != 1 {
		t.Fatalf("cutoff %+v, setup %q", c, res.Setup)
	}
}

// TestBenchHelpPlaceholders: bench -h names each flag's value plainly.
// pflag, as the flag package did, takes a flag's first back-quoted word
// as its value's name, so a usage that quoted `dlock serve` printed
// "--backend dlock serve" (issue: the help said that).
func TestBenchHelpPlaceholders(t *testing.T) {
	for _, h := range []string{"-h", "--help"} {
		var out bytes.Buffer
		if err := run(context.Background(), []string{"bench", h}, func(string) string { return "" }, nil, &out, &out); err != nil {
			t.Fatalf("bench %s: %v", h, err)
		}
		for _, l := range strings.Split(out.String(), "\n") {
			if f := strings.Fields(l); len(f) >= 2 && strings.HasPrefix(f[0], "-") && f[1] == "dlock" {
				t.Errorf("bench %s: %q: a usage quotes a command, which pflag shows as the value's name", h, l)
			}
		}
		if !strings.Contains(out.String(), "--backend string") {
			t.Errorf("bench %s does not show --backend's value as a string:\n%s", h, out.String())
		}
	}
}

// TestUsageNamesScenarios: dlock -h names every scenario bench runs (it
// left out failover), and so does bench -h.
func TestUsageNamesScenarios(t *testing.T) {
	for _, args := range [][]string{{"-h"}, {"--help"}, {"bench", "--help"}} {
		var out bytes.Buffer
		if err := run(context.Background(), args, func(string) string { return "" }, nil, &out, &out); err != nil {
			t.Fatalf("%q: %v", args, err)
		}
		for _, s := range benchScenarios {
			if !regexp.MustCompile(`\b` + s + `\b`).MatchString(out.String()) {
				t.Errorf("dlock %s does not name the bench scenario %s:\n%s", strings.Join(args, " "), s, out.String())
			}
		}
	}
}

// TestBenchUsageMessages: each bad bench command line is told of its
// first fault, in the order the flags are checked, as one line, with exit
// status 2; before any server or etcd is started.
func TestBenchUsageMessages(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--server", "http://a:1,http://b:2", "--scenario", "bogus"}, "--server http://a:1,http://b:2: bench measures one server, not a list"},
		{[]string{"--server", "nope"}, `--server wants a URL like http://127.0.0.1:7380, not "nope"`},
		{[]string{"--scenario", "pairs,bogus", "--backend", "redis"}, `unknown scenario "bogus": the scenarios are pairs, handoff, fanout, sessions, memory, pings, failover, fleet, cutoff`},
		{[]string{"--etcd", filepath.Join(t.TempDir(), "no-etcd"), "--backend", "redis"}, "--etcd: exec: "},
		{[]string{"--scenario", "fleet", "--rounds", "0"}, "--scenario fleet needs --backend etcd: servers that share their lock state, started by bench"},
		{[]string{"--backend", "etcd", "--scenario", "pings", "--server", "http://127.0.0.1:1"}, "--scenario pings measures fresh memory servers: no --backend"},
		{[]string{"--backend", "etcd", "--server", "http://127.0.0.1:1"}, "--backend etcd measures the server it starts: no --server"},
		{[]string{"--backend", "redis", "--servers", "1"}, `--backend: "redis" is not etcd`},
		{[]string{"--rounds", "0", "--cutoff", "memory-cut"}, "--servers must be at least 2 and --rounds at least 1"},
		{[]string{"--scenario", "cutoff", "--cutoff", "memory-cut,nope", "--compare", "mysql"}, `--cutoff: unknown case "nope" (` + strings.Join(bench.CutoffScenarios, ", ") + ")"},
		{[]string{"--scenario", "cutoff", "--cutoff", "etcd-cut"}, "--cutoff etcd-cut needs --backend etcd"},
		{[]string{"--scenario", "pairs", "--cutoff", "memory-cut", "--compare", "mysql"}, "--cutoff needs --scenario cutoff"},
		{[]string{"--compare", "redis,mongo", "--concurrency", "0"}, `--compare: unknown system "mongo" (redis, etcd)`},
		{[]string{"--etcd", os.Args[0], "--concurrency", "0"}, "--etcd needs --backend etcd or --compare etcd: it names the etcd they start"},
		{[]string{"--held", "-1", "--nodes", "1"}, "--concurrency, --waiters, --held-nodes and --duration must be positive, --held and --sessions not negative"},
		{[]string{"--opening", "0", "--scenario", "pings", "--sessions", "0"}, "--nodes must be at least --servers, --holders at most --nodes, --opening positive, --fleet-held and --idle not negative"},
		{[]string{"--scenario", "pings", "--ping-intervals", "1ms", "--sessions", "0"}, "--ping-intervals: ping interval 1ms: not within 10ms and 1m"},
		{[]string{"--scenario", "pings", "--ping-window", "0s"}, "--scenario pings needs --sessions and --ping-window above 0"},
		{[]string{"--ca", filepath.Join(t.TempDir(), "no-ca"), "--server", "http://127.0.0.1:1"}, "TLS settings need an https:// server: a CA, certificate or key given for http://127.0.0.1:1"},
	} {
		out, errOut, st := inProcess(t, nil, append([]string{"bench"}, c.args...)...)
		if st != 2 || out != "" || !strings.HasPrefix(errOut, "dlock: "+c.want) || strings.Count(errOut, "\n") != 1 {
			t.Errorf("bench %q: exit %d, stdout %q, stderr %q; want 2 and %q", c.args, st, out, errOut, c.want)
		}
	}
}

// TestBenchPrefixesAsLongAsTheDefault: the data sets whose servers' memory
// bench reads are under prefixes as long as the default one, distinct for
// each, since every key a server keeps begins with its prefix.
func TestBenchPrefixesAsLongAsTheDefault(t *testing.T) {
	seen := map[string]bool{}
	for _, kind := range []byte{'m', 'f'} {
		for n := 1; n <= 3; n++ {
			p := shortPrefix(kind, n)
			if len(p) != len(etcd.DefaultPrefix) || !strings.HasPrefix(p, "/") || !strings.HasSuffix(p, "/") || seen[p] {
				t.Fatalf("shortPrefix(%q, %d) = %q: want a distinct prefix as long as %q", kind, n, p, etcd.DefaultPrefix)
			}
			seen[p] = true
		}
	}
}
