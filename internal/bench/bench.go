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
}

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
	Note        string  `json:"note,omitempty"`
}

// latencies collects samples from many workers.
type latencies struct {
	mu  sync.Mutex
	all []time.Duration
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
	all := &latencies{}
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
	close(errs)
	return all, elapsed, <-errs
}

func runID() string { return fmt.Sprintf("%08x", rand.Uint32()) }
