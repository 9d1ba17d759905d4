// Package bench is the load generator behind `dlock bench`: scenarios
// against a dlock server over raw HTTP/1.1 keep-alive connections, the same
// work against Redis and etcd for comparison, and latency statistics.
package bench

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/dlock/dlock/internal/rawhttp"
)

// Options of a run.
type Options struct {
	Duration    time.Duration
	Concurrency int // workers (pairs, sessions) or nodes on the key (handoff)
	Waiters     int // fanout: waiters queued on the key
	// Progress, if set, is called about once a second with the operations so far.
	Progress func(ops int64)
	// Dialer connects to a dlock server: TLS for an https:// one, and the
	// token of a server with a token file. Redis and etcd ignore it.
	Dialer rawhttp.Dialer
	// ServerCPU, if set, reads the CPU time the server under test has used
	// so far; a scenario reads it before and after its timed work and
	// reports the difference per op. MetricsCPU and RedisCPU make one.
	ServerCPU CPUProbe
}

// CPUProbe reads the CPU time (user + system) a server process has used
// since it started.
type CPUProbe func() (time.Duration, error)

// Result is one scenario on one system.
type Result struct {
	Scenario    string  `json:"scenario"`
	System      string  `json:"system"`
	Concurrency int     `json:"concurrency"`
	Ops         int64   `json:"ops"`
	Seconds     float64 `json:"seconds"`
	Rate        float64 `json:"ops_per_second"`
	P50         float64 `json:"p50_us"`
	P90         float64 `json:"p90_us"`
	P99         float64 `json:"p99_us"`
	Max         float64 `json:"max_us"`
	Unit        string  `json:"unit"` // what one op is
	RSSMiB      float64 `json:"server_rss_mib,omitempty"`
	// EmptyRSSMiB is the memory scenarios' server RSS before their work,
	// and RSSBytesPerOp (RSSMiB - EmptyRSSMiB) per lock or session.
	EmptyRSSMiB   float64 `json:"server_empty_rss_mib,omitempty"`
	RSSBytesPerOp float64 `json:"server_rss_bytes_per_op,omitempty"`
	// ServerCPUPerOp is the server's CPU time per op over the timed work,
	// when Options.ServerCPU could read it; BenchCPUPerOp is this
	// process's (the load generator's), the same way.
	ServerCPUPerOp float64 `json:"server_cpu_us_per_op,omitempty"`
	BenchCPUPerOp  float64 `json:"bench_cpu_us_per_op,omitempty"`
	// Rounds and RoundMedian: the fan-out's rounds, and the median of
	// their times until the last waiter knew (Max is the worst).
	Rounds      int     `json:"rounds,omitempty"`
	RoundMedian float64 `json:"round_median_us,omitempty"`
	// EtcdCallsPerOp is, on an etcd (dlock's backend or --compare etcd),
	// the gRPC calls by method and the WAL fsyncs its server answered
	// per op over the run (EtcdCalls): the round trips an op costs.
	EtcdCallsPerOp map[string]float64 `json:"etcd_calls_per_op,omitempty"`
	Note           string             `json:"note,omitempty"`
	// Frame is the raw event (id, event and data lines and the blank
	// line) one fan-out waiter received: what Floor writes.
	Frame []byte `json:"-"`
}

// cpuWindow measures the server's and this process's CPU time over some
// work: start before it, stop after.
type cpuWindow struct {
	probe        CPUProbe
	server0      time.Duration
	self0        time.Duration
	server, self time.Duration
	err          error
}

func startCPU(probe CPUProbe) *cpuWindow {
	w := &cpuWindow{probe: probe}
	w.restart()
	return w
}

// stop adds the CPU time used since start (or the last stop) to the totals.
func (w *cpuWindow) stop() {
	self := selfCPU()
	w.self += self - w.self0
	w.self0 = self
	if w.probe == nil || w.err != nil {
		return
	}
	var server time.Duration
	if server, w.err = w.probe(); w.err == nil {
		w.server += server - w.server0
		w.server0 = server
	}
}

// restart begins a window (another one after a stop: its time adds to the
// same totals).
func (w *cpuWindow) restart() {
	w.self0 = selfCPU()
	if w.probe != nil && w.err == nil {
		w.server0, w.err = w.probe()
	}
}

// report puts the CPU per op into r; an unreadable server CPU goes in the
// note instead (a server that refuses /metrics to these credentials).
func (w *cpuWindow) report(r *Result) {
	if r.Ops == 0 {
		return
	}
	r.BenchCPUPerOp = float64(w.self.Nanoseconds()) / 1e3 / float64(r.Ops)
	switch {
	case w.probe == nil:
	case w.err != nil:
		r.Note = joinNote(r.Note, "server CPU unknown: "+w.err.Error())
	default:
		r.ServerCPUPerOp = float64(w.server.Nanoseconds()) / 1e3 / float64(r.Ops)
	}
}

func joinNote(a, b string) string {
	if a == "" {
		return b
	}
	return a + "; " + b
}

// selfCPU is the user + system time of this process so far.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// latencies collects samples from many workers.
type latencies struct {
	mu  sync.Mutex
	all []time.Duration
	cpu *cpuWindow // set by runWorkers
}

func (l *latencies) add(s []time.Duration) {
	l.mu.Lock()
	l.all = append(l.all, s...)
	l.mu.Unlock()
}

func (l *latencies) result(scenario, system, unit string, conc int, elapsed time.Duration) Result {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := Result{Scenario: scenario, System: system, Unit: unit, Concurrency: conc, Ops: int64(len(l.all)), Seconds: elapsed.Seconds()}
	if elapsed > 0 {
		r.Rate = float64(r.Ops) / elapsed.Seconds()
	}
	if len(l.all) == 0 {
		return r
	}
	slices.Sort(l.all)
	q := func(p float64) float64 {
		return float64(l.all[min(len(l.all)-1, int(p*float64(len(l.all))))].Nanoseconds()) / 1e3
	}
	r.P50, r.P90, r.P99, r.Max = q(0.50), q(0.90), q(0.99), float64(l.all[len(l.all)-1].Nanoseconds())/1e3
	if l.cpu != nil {
		l.cpu.report(&r)
	}
	return r
}

// progress calls opts.Progress every second until stop is closed.
func progress(opts Options, ops *atomic.Int64, stop <-chan struct{}) {
	if opts.Progress == nil {
		return
	}
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			opts.Progress(ops.Load())
		case <-stop:
			return
		}
	}
}

// runWorkers runs n workers until the duration ends or one fails.
func runWorkers(ctx context.Context, opts Options, n int, work func(ctx context.Context, w int, ops *atomic.Int64, lat *[]time.Duration) error) (*latencies, time.Duration, error) {
	ctx, cancel := context.WithTimeout(ctx, opts.Duration)
	defer cancel()
	var ops atomic.Int64
	stop := make(chan struct{})
	var pw sync.WaitGroup
	pw.Go(func() { progress(opts, &ops, stop) })
	defer func() { close(stop); pw.Wait() }()
	// The window includes the workers' connecting, which is negligible
	// next to a run's work (a connection or an etcd session per worker).
	all := &latencies{cpu: startCPU(opts.ServerCPU)}
	var wg sync.WaitGroup
	errs := make(chan error, n)
	start := time.Now()
	for w := range n {
		wg.Go(func() {
			lat := make([]time.Duration, 0, 4096)
			if err := work(ctx, w, &ops, &lat); err != nil && ctx.Err() == nil {
				errs <- err
				cancel()
			}
			all.add(lat)
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	all.cpu.stop()
	close(errs)
	return all, elapsed, <-errs
}

func runID() string { return fmt.Sprintf("%08x", rand.Uint32()) }
