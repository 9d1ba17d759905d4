package bench

import (
	"bytes"
	"context"
	"fmt"
	"github.com/dlock/dlock/internal/rawhttp"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Pairs: uncontended lock + unlock(success) on distinct keys.
func Pairs(ctx context.Context, base string, opts Options) (Result, error) {
	id := runID()
	lat, elapsed, err := runWorkers(ctx, opts, opts.Concurrency, func(ctx context.Context, w int, ops *atomic.Int64, lat *[]time.Duration) error {
		c, err := opts.Dialer.Dial(base)
		if err != nil {
			return err
		}
		defer c.Close()
		var body []byte
		for i := 0; ctx.Err() == nil; i++ {
			body = fmt.Appendf(body[:0], `{"type":"pull","resource_id":"bench-%s-%d-%d","node_id":"w%d","lease":"ttl"}`, id, w, i%4096, w)
			t0 := time.Now()
			if st, err := c.Post("/lock", body); err != nil || st != 200 {
				return fmt.Errorf("lock: %d %v %s", st, err, c.Body)
			}
			if st, err := c.Post("/unlock", body); err != nil || st != 200 {
				return fmt.Errorf("unlock: %d %v %s", st, err, c.Body)
			}
			*lat = append(*lat, time.Since(t0))
			ops.Add(1)
		}
		return nil
	})
	return lat.result("pairs", "dlock", "lock+unlock", opts.Concurrency, elapsed), err
}

// Handoff: W nodes on one key; each holder unlocks with failure, so the key
// passes FIFO. One op is one hand-off, timed from the old holder's unlock
// being sent to the new holder reading lock_assigned off its stream.
func Handoff(ctx context.Context, base string, opts Options) (Result, error) {
	key := "bench-handoff-" + runID()
	var sentAt atomic.Int64 // when the last unlock was sent, ns since start
	start := time.Now()
	lat, elapsed, err := runWorkers(ctx, opts, opts.Concurrency, func(ctx context.Context, w int, ops *atomic.Int64, lat *[]time.Duration) error {
		node := fmt.Sprint("h", w)
		s, err := opts.Dialer.Subscribe(base, node)
		if err != nil {
			return err
		}
		context.AfterFunc(ctx, func() { s.Close() })
		c, err := opts.Dialer.Dial(base)
		if err != nil {
			return err
		}
		defer c.Close()
		lockBody := fmt.Appendf(nil, `{"type":"pull","resource_id":"%s","node_id":"%s"}`, key, node)
		// Leave the key as found: no queue entry or hold outlives the run.
		defer c.Post("/cancel", lockBody)
		unlockBody := fmt.Appendf(nil, `{"type":"pull","resource_id":"%s","node_id":"%s","success":false,"error":"bench"}`, key, node)
		for ctx.Err() == nil {
			st, err := c.Post("/lock", lockBody)
			if err != nil || st != 200 {
				return fmt.Errorf("lock: %d %v %s", st, err, c.Body)
			}
			granted := bytes.Contains(c.Body, []byte(`"acquired":true`))
			for {
				if !granted {
					if err := awaitGrant(s, node); err != nil {
						if ctx.Err() != nil {
							return nil
						}
						return err
					}
				}
				// A holder that unlocks at once needs no confirming /lock:
				// the unlock shows it is alive. It is refused, though,
				// when the lock_assigned read was the echo of an earlier
				// direct grant; then wait for the real one.
				at := time.Since(start).Nanoseconds()
				prev := sentAt.Swap(at)
				st, err := c.Post("/unlock", unlockBody)
				if err != nil {
					return fmt.Errorf("unlock: %v", err)
				}
				if st == 200 {
					if !granted {
						*lat = append(*lat, time.Duration(at-prev))
						ops.Add(1)
					}
					break
				}
				if st != 403 {
					return fmt.Errorf("unlock: %d %s", st, c.Body)
				}
				sentAt.Store(prev)
				granted = false
			}
		}
		return nil
	})
	return lat.result("handoff", "dlock", "hand-off", opts.Concurrency, elapsed), err
}

// awaitGrant reads the stream until this node's lock_assigned.
func awaitGrant(s *rawhttp.Stream, node string) error {
	want := []byte(`"node_id":"` + node + `"`)
	for {
		name, data, err := s.Next()
		if err != nil {
			return err
		}
		if name == "lock_assigned" && bytes.Contains(data, want) {
			return nil
		}
	}
}

// Fanout: N waiters, each with its own session, queued on one key; the
// holder succeeds. One op is one waiter told, timed from the holder's unlock
// being sent; the p100 (max) is when the last waiter knew. The result's
// Frame is the operation_completed event as the first waiter's stream
// carried it, for Floor.
func Fanout(ctx context.Context, base string, opts Options) (Result, error) {
	n := opts.Waiters
	id := runID()
	streams := make([]eventStream, n)
	defer func() {
		for _, s := range streams {
			if s != nil {
				s.Close()
			}
		}
	}()
	if err := parallel(min(64, n), n, func(i int) error {
		node := fmt.Sprintf("f%s-%d", id, i)
		if i == 0 {
			s, err := subscribeFrames(opts.Dialer, base, node)
			if s != nil {
				streams[i] = s
			}
			return err
		}
		s, err := opts.Dialer.Subscribe(base, node)
		if s != nil {
			streams[i] = s
		}
		return err
	}); err != nil {
		return Result{}, fmt.Errorf("opening %d streams: %w", n, err)
	}
	conns := make([]*rawhttp.Conn, min(32, n))
	for i := range conns {
		c, err := opts.Dialer.Dial(base)
		if err != nil {
			return Result{}, err
		}
		defer c.Close()
		conns[i] = c
	}
	renewConn, err := opts.Dialer.Dial(base)
	if err != nil {
		return Result{}, err
	}
	defer renewConn.Close()
	lat := &latencies{}
	// The server's CPU is counted from the unlock to the last waiter
	// told, not while the waiters queue: the events' cost.
	cpu := &cpuWindow{probe: opts.ServerCPU}
	deadline := time.Now().Add(opts.Duration)
	var elapsed time.Duration
	var roundMax, unlocks []time.Duration
	for len(roundMax) == 0 || (time.Now().Before(deadline) && ctx.Err() == nil) {
		round := len(roundMax) + 1
		key := fmt.Sprintf("bench-fanout-%s-%d", id, round)
		holder := fmt.Appendf(nil, `{"type":"pull","resource_id":"%s","node_id":"holder-%s"}`, key, id)
		if st, err := conns[0].Post("/lock", holder); err != nil || st != 200 {
			return Result{}, fmt.Errorf("holder lock: %d %v", st, err)
		}
		// Queue every waiter, one connection per worker. The holder
		// renews its ttl lease meanwhile (a /lock again, docs/API.md):
		// on a backend whose writes wait on etcd, queueing 10,000
		// waiters can outlast --lock-ttl.
		stopRenew := make(chan struct{})
		var renewErr error
		var renew sync.WaitGroup
		renew.Go(func() {
			t := time.NewTicker(5 * time.Second)
			defer t.Stop()
			for {
				select {
				case <-stopRenew:
					return
				case <-t.C:
				}
				if st, err := renewConn.Post("/lock", holder); err != nil || st != 200 {
					renewErr = fmt.Errorf("holder renewing its lock: %d %v", st, err)
					return
				}
			}
		})
		var qi atomic.Int64
		var wg sync.WaitGroup
		errs := make(chan error, len(conns))
		for _, c := range conns {
			wg.Go(func() {
				for {
					i := int(qi.Add(1) - 1)
					if i >= n {
						return
					}
					body := fmt.Appendf(nil, `{"type":"pull","resource_id":"%s","node_id":"f%s-%d"}`, key, id, i)
					if st, err := c.Post("/lock", body); err != nil || st != 200 {
						errs <- fmt.Errorf("waiter lock: %d %v", st, err)
						return
					}
				}
			})
		}
		wg.Wait()
		close(stopRenew)
		renew.Wait()
		close(errs)
		if err := <-errs; err != nil {
			return Result{}, err
		}
		if renewErr != nil {
			return Result{}, renewErr
		}
		cpu.restart()
		told := make([]time.Duration, n)
		var broke error
		var brokeOnce sync.Once
		var rw sync.WaitGroup
		var t0 time.Time
		ready := make(chan struct{})
		for i, s := range streams {
			rw.Go(func() {
				<-ready
				for {
					name, _, err := s.Next()
					if err != nil {
						told[i] = -1
						brokeOnce.Do(func() { broke = fmt.Errorf("waiter %d's stream broke after %v: %w", i, time.Since(t0), err) })
						return
					}
					if name == "operation_completed" {
						told[i] = time.Since(t0)
						return
					}
				}
			})
		}
		t0 = time.Now()
		close(ready)
		unlock := fmt.Appendf(nil, `{"type":"pull","resource_id":"%s","node_id":"holder-%s","success":true}`, key, id)
		if st, err := conns[0].Post("/unlock", unlock); err != nil || st != 200 {
			return Result{}, fmt.Errorf("holder unlock: %d %v", st, err)
		}
		unlocks = append(unlocks, time.Since(t0))
		rw.Wait()
		cpu.stop()
		if slices.Contains(told, -1) {
			n, last := 0, time.Duration(0)
			for _, d := range told {
				if d > 0 {
					n, last = n+1, max(last, d)
				}
			}
			return Result{}, fmt.Errorf("%w; %d of %d waiters had been told, the last %v after the unlock", broke, n, len(told), last)
		}
		roundMax = append(roundMax, slices.Max(told))
		elapsed += slices.Max(told)
		lat.add(told)
		if opts.Progress != nil {
			opts.Progress(int64(round * n))
		}
	}
	r := lat.result("fanout", "dlock", "waiter told", n, elapsed)
	r.Rate = float64(r.Ops) / elapsed.Seconds()
	r.Rounds, r.RoundMedian = len(roundMax), median(roundMax)
	r.Frame = slices.Clone(streams[0].(*frameStream).frame)
	r.Note = strconv.Itoa(r.Rounds) + " rounds of " + strconv.Itoa(n) + " waiters; max = all told; the holder's unlock answered in " +
		time.Duration(median(unlocks)*1e3).Round(time.Microsecond).String() + " (median round)"
	cpu.report(&r)
	return r, nil
}

// median is the median of the durations, in µs.
func median(d []time.Duration) float64 {
	if len(d) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(d))
	m := s[len(s)/2]
	if len(s)%2 == 0 {
		m = (s[len(s)/2-1] + m) / 2
	}
	return float64(m.Nanoseconds()) / 1e3
}

// Sessions: open a session stream, read its subscribed event, close it.
func Sessions(ctx context.Context, base string, opts Options) (Result, error) {
	id := runID()
	lat, elapsed, err := runWorkers(ctx, opts, opts.Concurrency, func(ctx context.Context, w int, ops *atomic.Int64, lat *[]time.Duration) error {
		for i := 0; ctx.Err() == nil; i++ {
			t0 := time.Now()
			s, err := opts.Dialer.Subscribe(base, fmt.Sprintf("s%s-%d-%d", id, w, i))
			if err != nil {
				return err
			}
			s.Close()
			*lat = append(*lat, time.Since(t0))
			ops.Add(1)
		}
		return nil
	})
	return lat.result("sessions", "dlock", "open+close", opts.Concurrency, elapsed), err
}

// parallel runs f(0..n-1) on k workers.
func parallel(k, n int, f func(i int) error) error {
	var next atomic.Int64
	var wg sync.WaitGroup
	var mu sync.Mutex
	var first error
	for range k {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				if err := f(i); err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
					return
				}
			}
		})
	}
	wg.Wait()
	return first
}
