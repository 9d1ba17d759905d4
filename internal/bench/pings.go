package bench

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/internal/rawhttp"
)

// PingFrame is what a server writes to a stream that has been silent for
// its ping interval (server/hub.go).
const PingFrame = ": ping\n\n"

// DefaultPingSettle is the pause between the last stream's opening and
// the window: the opening's own work (accepts, first writes, the GC of
// what they left) is over by then.
const DefaultPingSettle = 2 * time.Second

// PingOptions are the pings scenario's.
type PingOptions struct {
	// Intervals are the ping intervals measured, each on a fresh server
	// that Start starts with it.
	Intervals []time.Duration
	Sessions  int // idle session streams kept open on each server
	// Window is the shortest measurement; PingWindow makes it a whole
	// number of intervals, two at least.
	Window time.Duration
	Settle time.Duration // 0: DefaultPingSettle, or Window if that is shorter
	Start  func(ctx context.Context, ping time.Duration) (base string, stop func(), err error)
	Dialer rawhttp.Dialer
	// Opened, if set, is called once a server's streams are open, and
	// Done with each result as it comes.
	Opened func(ping time.Duration, took time.Duration)
	Done   func(PingResult)
}

// PingResult is what the pings of idle streams cost a server at one ping
// interval. CPU is in percent of one core, over the window; bytes are the
// streams' payload as read by the load generator (no TCP/IP headers, no
// ACKs).
type PingResult struct {
	IntervalMS float64 `json:"interval_ms"`
	Streams    int     `json:"streams"`
	Seconds    float64 `json:"seconds"` // the window
	// ServerCPU is the server's CPU time over the window, BenchCPU this
	// process's (the streams' readers), both per second of the window.
	ServerCPU float64 `json:"server_cpu_percent"`
	BenchCPU  float64 `json:"bench_cpu_percent"`
	Pings     int64   `json:"pings"`
	Rate      float64 `json:"pings_per_second"`
	// Expected is Streams / interval: one ping per stream and interval.
	Expected       float64 `json:"expected_pings_per_second"`
	Bytes          int64   `json:"bytes"`
	BytesPerSecond float64 `json:"bytes_per_second"`
	BytesPerStream float64 `json:"bytes_per_second_per_stream"`
	// PingBytes is Bytes / Pings: len(PingFrame) when nothing else came.
	PingBytes float64 `json:"ping_bytes"`
	// ServerCPUPerPing is the server's CPU over the window per ping, the
	// idle server's own (its runtime, the pinger's scans) included.
	ServerCPUPerPing float64 `json:"server_cpu_us_per_ping"`
	// FewestPings and MostPings are one stream's, over the window.
	FewestPings int64 `json:"fewest_pings_a_stream"`
	MostPings   int64 `json:"most_pings_a_stream"`
}

// PingWindow is the window measured at interval ping: the smallest whole
// number of intervals, two at least, that is at least min. A stream is
// pinged once an interval, and streams opened together are pinged
// together: a window of whole intervals counts each stream's pings the
// same number of times whatever the phase, and two of them see every
// stream pinged.
func PingWindow(ping, min time.Duration) time.Duration {
	k := max(2, (min+ping-1)/ping)
	return k * ping
}

// ParsePingIntervals parses a comma-separated list of ping intervals,
// each within what `dlock serve --ping-interval` takes (10ms at least)
// and a minute at most, so that a run stays short.
func ParsePingIntervals(s string) ([]time.Duration, error) {
	var out []time.Duration
	for f := range strings.SplitSeq(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		d, err := time.ParseDuration(f)
		if err != nil {
			return nil, err
		}
		if d < 10*time.Millisecond || d > time.Minute {
			return nil, fmt.Errorf("ping interval %v: not within 10ms and 1m", d)
		}
		out = append(out, d)
	}
	if len(out) == 0 {
		return nil, errors.New("no ping interval")
	}
	return out, nil
}

// Pings measures, for each interval on a fresh server, what the pings of
// Sessions idle session streams cost: the server's CPU and the bytes the
// streams carry per second, read by this process over the window. It
// fails rather than report a window in which the pings did not arrive:
// a stream that got none, fewer than half the expected, anything else
// on an idle stream, a stream that ended, or a server that announces
// another interval.
func Pings(ctx context.Context, o PingOptions) ([]PingResult, error) {
	if o.Sessions < 1 || o.Window <= 0 || len(o.Intervals) == 0 {
		return nil, fmt.Errorf("pings needs streams, a window and intervals: %d, %v, %v", o.Sessions, o.Window, o.Intervals)
	}
	if o.Settle <= 0 {
		o.Settle = min(DefaultPingSettle, o.Window)
	}
	var results []PingResult
	for _, ping := range o.Intervals {
		base, stop, err := o.Start(ctx, ping)
		if err != nil {
			return results, fmt.Errorf("starting a server with ping interval %v: %w", ping, err)
		}
		r, err := measurePings(ctx, base, o, ping)
		stop()
		if err != nil {
			return results, fmt.Errorf("ping interval %v: %w", ping, err)
		}
		if o.Done != nil {
			o.Done(r)
		}
		results = append(results, r)
	}
	return results, nil
}

// openIdle opens n session streams of nodes named prefix-i at base, 64 at
// a time, each read up to its subscribed event. The streams are returned
// with an error too: those that opened, for the caller to close.
func openIdle(ctx context.Context, base string, d rawhttp.Dialer, n int, prefix string) ([]*rawhttp.Stream, error) {
	streams := make([]*rawhttp.Stream, n)
	err := parallel(min(64, n), n, func(i int) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		s, err := d.Subscribe(base, prefix+"-"+strconv.Itoa(i))
		streams[i] = s
		return err
	})
	return streams, err
}

func closeStreams(streams []*rawhttp.Stream) {
	for _, s := range streams {
		if s != nil {
			s.Close()
		}
	}
}

func measurePings(ctx context.Context, base string, o PingOptions, ping time.Duration) (PingResult, error) {
	n := o.Sessions
	cpu := MetricsCPU(base, o.Dialer)
	start := time.Now()
	streams, err := openIdle(ctx, base, o.Dialer, n, "pings-"+runID())
	var readers sync.WaitGroup
	var stopping atomic.Bool
	defer func() {
		stopping.Store(true)
		closeStreams(streams)
		readers.Wait()
	}()
	if err != nil {
		return PingResult{}, fmt.Errorf("opening %d session streams: %w", n, err)
	}
	if o.Opened != nil {
		o.Opened(ping, time.Since(start))
	}
	want := strconv.FormatInt(ping.Milliseconds(), 10)
	for _, s := range streams {
		if got := s.Header().Get(api.PingHeader); got != want {
			return PingResult{}, fmt.Errorf("the server announces %s: %q ms, not %s", api.PingHeader, got, want)
		}
	}
	// Each stream's reader counts its pings, and every byte read, from
	// the subscribed event on.
	pings := make([]atomic.Int64, n)
	var bytes, other, ended atomic.Int64
	var firstOther atomic.Value
	for i, s := range streams {
		readers.Go(func() {
			for {
				line, err := s.Line()
				if err != nil {
					if !stopping.Load() {
						ended.Add(1)
					}
					return
				}
				bytes.Add(int64(len(line)))
				switch string(line) {
				case ": ping\n":
					pings[i].Add(1)
				case "\n":
				default:
					if other.Add(1) == 1 {
						firstOther.Store(string(line))
					}
				}
			}
		})
	}
	sleep := func(d time.Duration) error {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if err := sleep(o.Settle); err != nil {
		return PingResult{}, err
	}
	window := PingWindow(ping, o.Window)
	snapshot := func() []int64 {
		v := make([]int64, n)
		for i := range pings {
			v[i] = pings[i].Load()
		}
		return v
	}
	// The pings are counted over [t0, t1]; the server's CPU is read just
	// outside it (a scrape takes a few ms), this process's at its ends.
	cpu0, err := cpu()
	if err != nil {
		return PingResult{}, fmt.Errorf("the server's CPU: %w", err)
	}
	self0, t0 := selfCPU(), time.Now()
	p0, b0 := snapshot(), bytes.Load()
	if err := sleep(window); err != nil {
		return PingResult{}, err
	}
	p1, b1 := snapshot(), bytes.Load()
	self1, t1 := selfCPU(), time.Now()
	cpu1, err := cpu()
	if err != nil {
		return PingResult{}, fmt.Errorf("the server's CPU: %w", err)
	}
	secs := t1.Sub(t0).Seconds()
	r := PingResult{IntervalMS: float64(ping.Microseconds()) / 1e3, Streams: n, Seconds: secs,
		ServerCPU: (cpu1 - cpu0).Seconds() / secs * 100, BenchCPU: (self1 - self0).Seconds() / secs * 100,
		Bytes: b1 - b0, Expected: float64(n) / ping.Seconds(), FewestPings: -1}
	for i := range p0 {
		d := p1[i] - p0[i]
		r.Pings += d
		if r.FewestPings < 0 || d < r.FewestPings {
			r.FewestPings = d
		}
		r.MostPings = max(r.MostPings, d)
	}
	r.Rate, r.BytesPerSecond = float64(r.Pings)/secs, float64(r.Bytes)/secs
	r.BytesPerStream = r.BytesPerSecond / float64(n)
	if r.Pings > 0 {
		r.PingBytes = float64(r.Bytes) / float64(r.Pings)
		r.ServerCPUPerPing = (cpu1 - cpu0).Seconds() * 1e6 / float64(r.Pings)
	}
	switch {
	case ended.Load() > 0:
		return r, fmt.Errorf("%d of %d streams ended during the measurement", ended.Load(), n)
	case other.Load() > 0:
		return r, fmt.Errorf("an idle stream carried %d lines other than pings, the first %q", other.Load(), firstOther.Load())
	case r.FewestPings == 0:
		return r, fmt.Errorf("a stream got no ping in %v (%.0f intervals): %d pings in all", window, window.Seconds()/ping.Seconds(), r.Pings)
	case r.Rate < r.Expected/2:
		return r, fmt.Errorf("%.0f pings/s, under half the %.0f expected", r.Rate, r.Expected)
	}
	return r, nil
}
