package bench

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest"
	"github.com/dlock/dlock/internal/rawhttp"
)

func TestParseMetrics(t *testing.T) {
	// Excerpts of dlock's and etcd's /metrics.
	const dlock = `# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 12.47
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 1.8755584e+07
dlock_http_request_duration_seconds_bucket{endpoint="/lock",le="5e-05"} 33
process_cpu_seconds_total_other 99
`
	const etcd = "process_cpu_seconds_total 0.1\nprocess_resident_memory_bytes 2.4756224e+07 1700000000000\n"
	for _, tc := range []struct {
		text      string
		cpu, rssB float64
	}{{dlock, 12.47, 18755584}, {etcd, 0.1, 24756224}} {
		v, err := parseMetrics(strings.NewReader(tc.text), "process_cpu_seconds_total", "process_resident_memory_bytes")
		if err != nil || v["process_cpu_seconds_total"] != tc.cpu || v["process_resident_memory_bytes"] != tc.rssB {
			t.Errorf("parseMetrics = %v, %v; want cpu %v, rss %v", v, err, tc.cpu, tc.rssB)
		}
	}
	if _, err := parseMetrics(strings.NewReader("process_cpu_seconds_total_other 1\n"), "process_cpu_seconds_total"); err == nil {
		t.Error("a missing sample parsed")
	}
	if _, err := parseMetrics(strings.NewReader("process_cpu_seconds_total x\n"), "process_cpu_seconds_total"); err == nil {
		t.Error("a sample that is no number parsed")
	}
}

func TestParseRedisCPU(t *testing.T) {
	// redis-server 7.0's INFO cpu.
	const info = "# CPU\r\nused_cpu_sys:0.015367\r\nused_cpu_user:0.020490\r\nused_cpu_sys_children:0.000000\r\nused_cpu_user_children:0.000000\r\nused_cpu_sys_main_thread:0.014895\r\nused_cpu_user_main_thread:0.019860\r\n"
	d, err := parseRedisCPU(info)
	if err != nil || d != 35857*time.Microsecond {
		t.Fatalf("parseRedisCPU = %v, %v; want 35.857ms (user + sys, the whole process)", d, err)
	}
	for _, bad := range []string{"# CPU\r\nused_cpu_sys:0.1\r\n", "used_cpu_sys:x\r\nused_cpu_user:1\r\n", ""} {
		if _, err := parseRedisCPU(bad); err == nil {
			t.Errorf("parseRedisCPU(%q) parsed", bad)
		}
	}
}

// The server's CPU per op is the probe's difference over the run, divided
// by the ops; a probe that fails leaves it out, with a note, and the
// scenario's numbers stand.
func TestServerCPU(t *testing.T) {
	srv := dlocktest.Start(t, dlocktest.Options{})
	calls := 0
	opts := Options{Duration: 200 * time.Millisecond, Concurrency: 2, ServerCPU: func() (time.Duration, error) {
		calls++
		return time.Duration(calls) * time.Second, nil
	}}
	r, err := Pairs(context.Background(), srv.URL(), opts)
	if err != nil || calls != 2 || r.Ops == 0 || r.ServerCPUPerOp != 1e6/float64(r.Ops) || r.BenchCPUPerOp <= 0 {
		t.Fatalf("pairs with a probe that counts a second a call: %+v %v (%d calls)", r, err, calls)
	}
	opts.ServerCPU = func() (time.Duration, error) { return 0, errors.New("403 Forbidden") }
	r, err = Pairs(context.Background(), srv.URL(), opts)
	if err != nil || r.Ops == 0 || r.ServerCPUPerOp != 0 || !strings.Contains(r.Note, "server CPU unknown: 403") {
		t.Fatalf("pairs with a failing probe: %+v %v", r, err)
	}
	// The real probe, on the test's own process: dlocktest serves in it.
	opts.ServerCPU = MetricsCPU(srv.URL(), rawhttp.Dialer{})
	for name, f := range map[string]func(context.Context, string, Options) (Result, error){"pairs": Pairs, "handoff": Handoff} {
		r, err := f(context.Background(), srv.URL(), opts)
		if err != nil || r.ServerCPUPerOp <= 0 {
			t.Fatalf("%s with /metrics's CPU: %+v %v", name, r, err)
		}
	}
}

func TestParseProcStat(t *testing.T) {
	// /proc/PID/stat of an etcd, its command name with a space and a
	// parenthesis in it to show the fields are counted past the last one.
	const stat = "4242 (etcd (x) y) S 1 4242 4242 0 -1 4194560 5188 0 0 0 1234 566 0 0 20 0 13 0 100 11800000000 16000 18446744073709551615"
	d, err := parseProcStat(stat)
	if err != nil || d != 18*time.Second {
		t.Fatalf("parseProcStat = %v, %v; want 18s (1234 + 566 ticks of 10 ms)", d, err)
	}
	for _, bad := range []string{"4242 etcd S 1", "4242 (etcd) S 1 2 3", "4242 (etcd) S 1 4242 4242 0 -1 4194560 5188 0 0 0 x 566"} {
		if _, err := parseProcStat(bad); err == nil {
			t.Errorf("parseProcStat(%q) read a CPU time", bad)
		}
	}
	if _, err := ProcCPU(os.Getpid())(); err != nil {
		t.Fatalf("this process's CPU: %v", err)
	}
}
