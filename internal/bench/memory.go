package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dlock/dlock/internal/rawhttp"
)

// ServerRSS reads the server's resident memory (MiB) from its /metrics.
func ServerRSS(base string, d rawhttp.Dialer) (float64, error) {
	v, err := scrape(base, d, "process_resident_memory_bytes")
	if err != nil {
		return 0, err
	}
	return v["process_resident_memory_bytes"] / (1 << 20), nil
}

// StartServer starts a dlock server for one memory measurement and
// returns its base URL and a func that stops it. The RSS of a server that
// has done other work says little about what the measured state costs:
// `dlock bench` starts a fresh `dlock serve` for each.
type StartServer func(ctx context.Context) (base string, stop func(), err error)

// MemoryOptions are the memory scenario's.
type MemoryOptions struct {
	Held      int // locks held in held-ttl and in held-session (0: neither)
	HeldNodes int // held-session: nodes, each with a session, holding them
	Sessions  int // idle-sessions: streams kept open (0: not run)
	Conns     int // connections that take the locks
	// Start gives each measurement its server.
	Start  StartServer
	Dialer rawhttp.Dialer
	// Done, if set, is called with each result as it comes.
	Done func(Result)
}

// Memory measures the server's resident memory in three states, each on
// a server of its own from Start: idle-sessions, held-session, held-ttl.
// That order leaves the ttl leases, which outlive the run, last when
// Start hands out one server for all three.
func Memory(ctx context.Context, o MemoryOptions) ([]Result, error) {
	type step struct {
		n   int
		run func(base string) (Result, error)
	}
	steps := []step{
		{o.Sessions, func(base string) (Result, error) { return OpenSessions(ctx, base, o.Dialer, o.Sessions) }},
		{o.Held, func(base string) (Result, error) {
			return HeldSessionLocks(ctx, base, o.Dialer, o.Held, o.HeldNodes, o.Conns)
		}},
		{o.Held, func(base string) (Result, error) { return HeldLocks(ctx, base, o.Dialer, o.Held, o.Conns) }},
	}
	var results []Result
	for _, s := range steps {
		if s.n <= 0 {
			continue
		}
		base, stop, err := o.Start(ctx)
		if err != nil {
			return results, fmt.Errorf("starting a server: %w", err)
		}
		r, err := s.run(base)
		stop()
		if err != nil {
			return results, err
		}
		if o.Done != nil {
			o.Done(r)
		}
		results = append(results, r)
	}
	return results, nil
}

// memoryResult fills in the RSS figures of a memory scenario.
func memoryResult(r Result, before, after float64) Result {
	r.RSSMiB, r.EmptyRSSMiB = after, before
	if r.Ops > 0 {
		r.RSSBytesPerOp = (after - before) * (1 << 20) / float64(r.Ops)
	}
	if r.Seconds > 0 {
		r.Rate = float64(r.Ops) / r.Seconds
	}
	return r
}

// takeLocks takes n locks on distinct keys over conns connections; lock
// appends the i-th lock's body, taken on connection w, to b.
func takeLocks(ctx context.Context, base string, d rawhttp.Dialer, n, conns int, lock func(b []byte, w, i int) []byte) error {
	cs := make([]*rawhttp.Conn, conns)
	defer func() {
		for _, c := range cs {
			if c != nil {
				c.Close()
			}
		}
	}()
	for i := range cs {
		var err error
		if cs[i], err = d.Dial(base); err != nil {
			return err
		}
	}
	var next atomic.Int64
	return parallel(conns, conns, func(w int) error {
		c := cs[w]
		var body []byte
		for {
			i := next.Add(1) - 1
			if i >= int64(n) || ctx.Err() != nil {
				return ctx.Err()
			}
			body = lock(body[:0], w, int(i))
			if st, err := c.Post("/lock", body); err != nil || st != 200 {
				return fmt.Errorf("lock: %d %v %s", st, err, c.Body)
			}
			if !bytes.Contains(c.Body, []byte(`"acquired":true`)) {
				return fmt.Errorf("lock of a free key not granted: %s", c.Body)
			}
		}
	})
}

// HeldLocks (held-ttl) takes n locks on distinct keys with ttl leases and
// reports the server's resident memory while they are held.
func HeldLocks(ctx context.Context, base string, d rawhttp.Dialer, n, conns int) (Result, error) {
	id := runID()
	before, err := ServerRSS(base, d)
	if err != nil {
		return Result{}, err
	}
	start := time.Now()
	err = takeLocks(ctx, base, d, n, conns, func(b []byte, w, i int) []byte {
		return fmt.Appendf(b, `{"type":"pull","resource_id":"sha256:held-%s-%d","node_id":"holder-%d","lease":"ttl"}`, id, i, w)
	})
	if err != nil {
		return Result{}, err
	}
	elapsed := time.Since(start)
	after, err := ServerRSS(base, d)
	if err != nil {
		return Result{}, err
	}
	r := memoryResult(Result{Scenario: "held-ttl", System: "dlock", Concurrency: conns, Ops: int64(n), Seconds: elapsed.Seconds(), Unit: "lock held"}, before, after)
	r.Note = fmt.Sprintf("%d locks held, ttl leases: server RSS %.1f MiB, %.1f MiB empty: %.0f B per lock", n, after, before, r.RSSBytesPerOp)
	return r, nil
}

// HeldSessionLocks (held-session) takes n locks on distinct keys for nodes
// nodes, each with its session stream open, with session leases, and
// reports the server's resident memory while they are held. Each node's
// stream is read as a node would: a direct grant sends it lock_assigned,
// and a stream left unread would fill up and be closed as slow.
func HeldSessionLocks(ctx context.Context, base string, d rawhttp.Dialer, n, nodes, conns int) (Result, error) {
	if nodes < 1 {
		return Result{}, fmt.Errorf("held-session needs a node at least, not %d", nodes)
	}
	id := runID()
	before, err := ServerRSS(base, d)
	if err != nil {
		return Result{}, err
	}
	node := func(j int) string { return fmt.Sprintf("hs-%s-%d", id, j) }
	streams := make([]*rawhttp.Stream, nodes)
	var readers sync.WaitGroup
	defer func() {
		for _, s := range streams {
			if s != nil {
				s.Close()
			}
		}
		readers.Wait()
	}()
	start := time.Now()
	if err := parallel(min(64, nodes), nodes, func(j int) error {
		s, err := d.Subscribe(base, node(j))
		if err != nil {
			return err
		}
		streams[j] = s
		readers.Go(func() {
			for {
				if _, _, err := s.Next(); err != nil {
					return
				}
			}
		})
		return nil
	}); err != nil {
		return Result{}, fmt.Errorf("opening %d session streams: %w", nodes, err)
	}
	err = takeLocks(ctx, base, d, n, conns, func(b []byte, _, i int) []byte {
		return fmt.Appendf(b, `{"type":"pull","resource_id":"sha256:held-%s-%d","node_id":"%s","lease":"session"}`, id, i, node(i%nodes))
	})
	if err != nil {
		return Result{}, err
	}
	elapsed := time.Since(start)
	after, err := ServerRSS(base, d)
	if err != nil {
		return Result{}, err
	}
	r := memoryResult(Result{Scenario: "held-session", System: "dlock", Concurrency: conns, Ops: int64(n), Seconds: elapsed.Seconds(), Unit: "lock held"}, before, after)
	r.Note = fmt.Sprintf("%d locks held by %d nodes with open session streams, session leases: server RSS %.1f MiB, %.1f MiB empty: %.0f B per lock (the sessions included)",
		n, nodes, after, before, r.RSSBytesPerOp)
	return r, nil
}

// OpenSessions (idle-sessions) opens n session streams, keeps them open
// while it reads the server's resident memory, then closes them. It
// reports the server's CPU time per stream opened, and this process's:
// on a machine the nodes and the server share, the time to open them all
// is theirs together, and a server with cores of its own opens as many
// a second as one core has its CPU time per stream.
func OpenSessions(ctx context.Context, base string, d rawhttp.Dialer, n int) (Result, error) {
	id := runID()
	before, err := ServerRSS(base, d)
	if err != nil {
		return Result{}, err
	}
	cpu := startCPU(MetricsCPU(base, d))
	start := time.Now()
	prefix := "idle-" + id
	idle, err := d.OpenIdle(ctx, base, n, 64, func(i int) string { return prefix + "-" + strconv.Itoa(i) })
	if errors.Is(err, rawhttp.ErrNotPlain) {
		var streams []*rawhttp.Stream
		streams, err = openIdle(ctx, base, d, n, prefix)
		defer closeStreams(streams)
	} else if idle != nil {
		defer idle.Close()
	}
	if err != nil {
		return Result{}, err
	}
	elapsed := time.Since(start)
	cpu.stop()
	after, err := ServerRSS(base, d)
	if err != nil {
		return Result{}, err
	}
	r := memoryResult(Result{Scenario: "idle-sessions", System: "dlock", Concurrency: 64, Ops: int64(n), Seconds: elapsed.Seconds(), Unit: "session open"}, before, after)
	r.Note = fmt.Sprintf("%d idle session streams open: server RSS %.1f MiB, %.1f MiB empty: %.0f B per session", n, after, before, r.RSSBytesPerOp)
	cpu.report(&r)
	return r, nil
}
