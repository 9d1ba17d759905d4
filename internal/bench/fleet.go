package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dlock/dlock/internal/rawhttp"
)

// FleetOptions are the fleet scenario's (docs/BENCHMARKS.md, "Fleet scale
// on etcd"): a fleet of nodes, each with its session stream open, spread
// over several dlock servers on one etcd.
type FleetOptions struct {
	Servers int // dlock servers on the one etcd, at least 2
	Nodes   int // nodes, node i's stream on server i mod Servers
	Holders int // of them, nodes that hold a session-leased lock when a server is killed
	Held    int // locks then held with session leases by the nodes (0: not measured)
	Opening int // session streams opening at once
	Conns   int // connections to each server that take locks and queue waiters
	// Idle is how long etcd's CPU is read while the sessions idle.
	Idle time.Duration
	// Recheck, if positive, is how long after the kill the holds are
	// checked again: past the servers' --session-grace, it shows the moved
	// sessions outlived the killed server's keepalives.
	Recheck time.Duration
	// Start starts one more server on the one etcd, all of them on one
	// data set; the stop it returns must kill it at once, as SIGKILL does.
	Start StartServer
	// Floor, if set, starts a server with no etcd (the memory backend):
	// the opening is first timed on o.Servers of them (fleet-open-floor),
	// what the streams and the nodes alone cost on this machine.
	Floor StartServer
	// EtcdEndpoint is the etcd's client URL (its /metrics: the database's
	// size), and EtcdCPU reads its CPU time (ProcCPU).
	EtcdEndpoint string
	EtcdCPU      CPUProbe
	Dialer       rawhttp.Dialer
	// Log, if set, is told what each step found, as it goes.
	Log func(string)
}

// fleetNode is one node of the fleet: its stream, on which server, and
// the last event id it read.
type fleetNode struct {
	name   string
	server atomic.Int32
	lastID atomic.Pointer[string]
	broken chan struct{} // closed when the current stream ends
	s      *rawhttp.Stream
	held   string // the key it holds through the kill, "" none
	token  uint64
	told   atomic.Int64 // the fan-out: ns after its unlock that it read operation_completed
}

// fleet is a run of the scenario.
type fleet struct {
	o       FleetOptions
	id      string
	bases   []string
	stops   []func()
	alive   []bool
	nodes   []*fleetNode
	readers sync.WaitGroup
	// fanKey is the fan-out's key while it runs, and fanAt its unlock.
	fanKey atomic.Pointer[string]
	fanAt  atomic.Int64
}

// Fleet runs the fleet scenario: it starts o.Servers servers, opens
// o.Nodes session streams over them and reads etcd's CPU and each
// server's RSS while they idle; o.Holders nodes take a lock each; one
// server is SIGKILLed and its nodes move to the others with Last-Event-ID,
// timed, and every hold is checked; every node then waits on one key and
// is told of its success (the fan-out); finally the nodes hold o.Held
// locks, and each server's RSS and etcd's database size are read. One
// result per step: fleet-open, fleet-failover, fleet-fanout, fleet-held.
func Fleet(ctx context.Context, o FleetOptions) ([]Result, error) {
	if o.Servers < 2 || o.Nodes < o.Servers || o.Start == nil || o.Holders > o.Nodes {
		return nil, errors.New("fleet: at least 2 servers, a node per server, a Start, and no more holders than nodes")
	}
	o.Opening, o.Conns = max(1, o.Opening), max(1, o.Conns)
	var results []Result
	if o.Floor != nil {
		r, err := openFloor(ctx, o)
		if err != nil {
			return nil, err
		}
		results = append(results, r)
	}
	f := &fleet{o: o, id: runID()}
	defer f.close()
	if err := f.start(ctx, o.Start); err != nil {
		return results, err
	}
	for _, step := range []func(context.Context) (Result, error){f.open, f.failover, f.fanout, f.hold} {
		r, err := step(ctx)
		if err != nil {
			return results, err
		}
		if r.Scenario == "" {
			continue // a step left out
		}
		f.log(r.Scenario + ": " + r.Note)
		results = append(results, r)
	}
	return results, nil
}

// start starts o.Servers servers with start.
func (f *fleet) start(ctx context.Context, start StartServer) error {
	for range f.o.Servers {
		base, stop, err := start(ctx)
		if err != nil {
			return fmt.Errorf("starting server %d: %w", len(f.bases)+1, err)
		}
		f.bases, f.stops, f.alive = append(f.bases, base), append(f.stops, stop), append(f.alive, true)
	}
	return nil
}

// openFloor times the opening on o.Servers servers of o.Floor, each on
// its own: the same nodes, the same streams, no etcd. A first round, on
// servers of its own and not timed, warms this process (its heap, its
// goroutines' stacks): the nodes of a real fleet are processes that run
// long, on machines of their own, and the floor and fleet-open then find
// the nodes alike.
func openFloor(ctx context.Context, o FleetOptions) (Result, error) {
	o.EtcdCPU, o.Idle = nil, 0
	var r Result
	for _, timed := range []bool{false, true} {
		f := &fleet{o: o, id: runID()}
		err := f.start(ctx, o.Floor)
		if err == nil {
			r, err = f.open(ctx)
		}
		f.close()
		if err != nil {
			return Result{}, fmt.Errorf("the floor: %w", err)
		}
		if !timed && o.Log != nil {
			o.Log("fleet-open-floor: the nodes warmed in a first round (not timed): " + r.Note)
		}
	}
	r.Scenario = "fleet-open-floor"
	r.Note = "no etcd (the memory backend, each server on its own), after a first round not timed: " + r.Note
	if o.Log != nil {
		o.Log(r.Scenario + ": " + r.Note)
	}
	return r, nil
}

func (f *fleet) log(s string) {
	if f.o.Log != nil {
		f.o.Log(s)
	}
}

func (f *fleet) close() {
	for _, n := range f.nodes {
		if n != nil && n.s != nil {
			n.s.Close()
		}
	}
	f.readers.Wait()
	for i, stop := range f.stops {
		if f.alive[i] {
			stop()
		}
	}
}

// read reads n's stream s as a node does, until it ends: it keeps the last
// event id for a resume, and notes the fan-out's operation_completed.
func (f *fleet) read(n *fleetNode, s *rawhttp.Stream) {
	broken := make(chan struct{})
	n.broken = broken
	n.s = s
	f.readers.Go(func() {
		defer close(broken)
		for {
			name, data, err := s.Next()
			if err != nil {
				return
			}
			if id := s.ID(); id != "" {
				n.lastID.Store(&id)
			}
			if name != "operation_completed" {
				continue
			}
			if k := f.fanKey.Load(); k != nil && bytes.Contains(data, []byte(`"resource_id":"`+*k+`"`)) {
				n.told.CompareAndSwap(0, time.Now().UnixNano()-f.fanAt.Load())
			}
		}
	})
}

// open opens every node's stream, then reads the servers' RSS and, over
// o.Idle, etcd's CPU and the servers'.
func (f *fleet) open(ctx context.Context) (Result, error) {
	o := f.o
	var empty []float64
	for _, base := range f.bases {
		rss, err := ServerRSS(base, o.Dialer)
		if err != nil {
			return Result{}, err
		}
		empty = append(empty, rss)
	}
	f.nodes = make([]*fleetNode, o.Nodes)
	lat := &latencies{}
	var retries atomic.Int64
	// Where the opening's time goes: on a machine of few cores the
	// nodes (this process), etcd and the servers share them.
	probes := f.cpuProbes()
	cpu0 := readCPU(probes)
	start := time.Now()
	err := parallel(min(o.Opening, o.Nodes), o.Nodes, func(i int) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		n := &fleetNode{name: fmt.Sprintf("fleet-%s-%d", f.id, i)}
		n.server.Store(int32(i % o.Servers))
		t0 := time.Now()
		// A node tries again after a refusal (503: the server is
		// busy making sessions), as a client does, for a minute.
		var s *rawhttp.Stream
		for {
			var err error
			if s, err = o.Dialer.Subscribe(f.bases[i%o.Servers], n.name); err == nil {
				break
			}
			if time.Since(t0) > time.Minute || ctx.Err() != nil {
				return fmt.Errorf("node %d's stream: %w", i, err)
			}
			retries.Add(1)
			time.Sleep(100*time.Millisecond + time.Duration(rand.IntN(100))*time.Millisecond)
		}
		lat.add([]time.Duration{time.Since(t0)})
		f.nodes[i] = n
		f.read(n, s)
		return nil
	})
	elapsed := time.Since(start)
	cpu1 := readCPU(probes)
	if err != nil {
		return Result{}, fmt.Errorf("opening %d streams over %d servers: %w", o.Nodes, o.Servers, err)
	}
	r := lat.result("fleet-open", "dlock", "session open", o.Opening, elapsed)
	rss, err := f.rss()
	if err != nil {
		return Result{}, err
	}
	r.RSSMiB = maxOf(rss)
	r.Note = fmt.Sprintf("%d nodes' session streams over %d servers, %d opening at once: all open in %s (%d refusals tried again); servers' RSS %s MiB (empty %s)",
		o.Nodes, o.Servers, o.Opening, fmtDur(float64(elapsed.Microseconds())), retries.Load(), mibList(rss), mibList(empty))
	r.Note += "; CPU while opening, in seconds: " + cpuSpent(probes, cpu0, cpu1, func(d time.Duration) string {
		return fmt.Sprintf("%.2f", d.Seconds())
	})
	if o.Idle > 0 {
		r.Note += "; " + f.idle(ctx)
	}
	return r, nil
}

// cpuProbe is one process whose CPU the fleet reads.
type cpuProbe struct {
	name  string
	probe CPUProbe
}

// cpuProbes are etcd's (if known), each server's and this process's, the
// nodes'.
func (f *fleet) cpuProbes() []cpuProbe {
	var ps []cpuProbe
	if f.o.EtcdCPU != nil {
		ps = append(ps, cpuProbe{"etcd", f.o.EtcdCPU})
	}
	for i, base := range f.bases {
		if f.alive[i] {
			ps = append(ps, cpuProbe{fmt.Sprintf("server %d", i+1), MetricsCPU(base, f.o.Dialer)})
		}
	}
	return append(ps, cpuProbe{"the nodes (bench)", ProcCPU(os.Getpid())})
}

// readCPU reads every probe; one that fails reads as -1.
func readCPU(ps []cpuProbe) []time.Duration {
	out := make([]time.Duration, len(ps))
	for i, p := range ps {
		v, err := p.probe()
		if err != nil {
			v = -1
		}
		out[i] = v
	}
	return out
}

// cpuSpent says what each probe spent between two readings, as
// format does with the seconds (or percent of a core) of each.
func cpuSpent(ps []cpuProbe, before, after []time.Duration, format func(time.Duration) string) string {
	var parts []string
	for i, p := range ps {
		if before[i] < 0 || after[i] < 0 {
			continue
		}
		parts = append(parts, p.name+" "+format(after[i]-before[i]))
	}
	return strings.Join(parts, ", ")
}

// idle reads, over o.Idle, the CPU etcd and each server use while the
// sessions idle: their keepalives, the pings.
func (f *fleet) idle(ctx context.Context) string {
	probes := f.cpuProbes()
	before := readCPU(probes)
	t0 := time.Now()
	select {
	case <-time.After(f.o.Idle):
	case <-ctx.Done():
	}
	secs := time.Since(t0).Seconds()
	after := readCPU(probes)
	return fmt.Sprintf("idle for %.0f s, CPU in %% of one core: %s", secs, cpuSpent(probes, before, after, func(d time.Duration) string {
		return fmt.Sprintf("%.1f%%", 100*d.Seconds()/secs)
	}))
}

// rss reads the RSS of every live server.
func (f *fleet) rss() ([]float64, error) {
	var out []float64
	for i, base := range f.bases {
		if !f.alive[i] {
			continue
		}
		v, err := ServerRSS(base, f.o.Dialer)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, nil
}

// conns dials o.Conns connections to each live server.
func (f *fleet) conns() (map[int][]*rawhttp.Conn, func(), error) {
	cs := map[int][]*rawhttp.Conn{}
	closeAll := func() {
		for _, l := range cs {
			for _, c := range l {
				c.Close()
			}
		}
	}
	for i, base := range f.bases {
		if !f.alive[i] {
			continue
		}
		for range f.o.Conns {
			c, err := f.o.Dialer.Dial(base)
			if err != nil {
				closeAll()
				return nil, nil, err
			}
			cs[i] = append(cs[i], c)
		}
	}
	return cs, closeAll, nil
}

// onServers runs do(i) for i in 0..n-1, each on a connection to node
// i mod Nodes's server, o.Conns at a time per server.
func (f *fleet) onServers(ctx context.Context, n int, do func(c *rawhttp.Conn, i int) error) error {
	cs, closeAll, err := f.conns()
	if err != nil {
		return err
	}
	defer closeAll()
	// A queue of work per server, each drained by its connections.
	work := map[int]chan int{}
	for s := range cs {
		work[s] = make(chan int, n)
	}
	for i := range n {
		work[int(f.nodes[i%len(f.nodes)].server.Load())] <- i
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var first error
	for s, l := range cs {
		close(work[s])
		for _, c := range l {
			wg.Go(func() {
				for i := range work[s] {
					if ctx.Err() != nil {
						return
					}
					if err := do(c, i); err != nil {
						mu.Lock()
						first = cmpErr(first, err)
						mu.Unlock()
						return
					}
				}
			})
		}
	}
	wg.Wait()
	return cmpErr(first, ctx.Err())
}

func cmpErr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

// lockAs takes key for node over c, with lease, and returns its token.
func lockAs(c *rawhttp.Conn, key, node, lease string) (uint64, error) {
	st, err := c.Post("/lock", fmt.Appendf(nil, `{"type":"pull","resource_id":%q,"node_id":%q,"lease":%q}`, key, node, lease))
	var a lockAnswer
	if err != nil || st != 200 || json.Unmarshal(c.Body, &a) != nil || !a.Acquired {
		return 0, fmt.Errorf("lock %s for %s: %d %v %s", key, node, st, err, c.Body)
	}
	return a.Token, nil
}

// failover: holders take their locks; server 0 is killed; its nodes move
// to the others with Last-Event-ID, each on its own, as nodes do; the holds
// are checked once every node moved, and again at o.Recheck.
func (f *fleet) failover(ctx context.Context) (Result, error) {
	o := f.o
	var holders []*fleetNode
	if o.Holders > 0 {
		step := o.Nodes / o.Holders
		for i := 0; i < o.Nodes && len(holders) < o.Holders; i += step {
			n := f.nodes[i]
			n.held = fmt.Sprintf("fleet-%s-held-%d", f.id, i)
			holders = append(holders, n)
		}
	}
	// Holders take their keys on their own servers.
	if err := f.onServers(ctx, o.Nodes, func(c *rawhttp.Conn, i int) error {
		n := f.nodes[i]
		if n.held == "" {
			return nil
		}
		var err error
		n.token, err = lockAs(c, n.held, n.name, "session")
		return err
	}); err != nil {
		return Result{}, err
	}
	var moving []*fleetNode
	for _, n := range f.nodes {
		if n.server.Load() == 0 {
			moving = append(moving, n)
		}
	}
	heldMoving := 0
	for _, n := range moving {
		if n.held != "" {
			heldMoving++
		}
	}
	var others []int
	for i := 1; i < o.Servers; i++ {
		others = append(others, i)
	}
	t0 := time.Now()
	f.stops[0]()
	f.alive[0] = false
	lat := &latencies{}
	deadline := t0.Add(30 * time.Second)
	if err := parallel(len(moving), len(moving), func(k int) error {
		n := moving[k]
		<-n.broken // the node sees its stream end
		last := ""
		if p := n.lastID.Load(); p != nil {
			last = *p
		}
		for try := 0; ; try++ {
			s := others[(k+try)%len(others)]
			st, err := o.Dialer.Resume(f.bases[s], n.name, last)
			if err == nil {
				lat.add([]time.Duration{time.Since(t0)})
				n.server.Store(int32(s))
				f.read(n, st)
				return nil
			}
			if time.Now().After(deadline) || ctx.Err() != nil {
				return fmt.Errorf("%s could not resume on the other servers within 30 s: %w", n.name, err)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}); err != nil {
		return Result{}, err
	}
	moved := time.Since(t0)
	r := lat.result("fleet-failover", "dlock", "node moved", len(moving), moved)
	r.Rate = 0
	kept, problems := f.checkHolds(holders)
	keptText := fmt.Sprintf("holds kept %d/%d (%d of them on the killed server's nodes)", kept, len(holders), heldMoving)
	if o.Recheck > 0 {
		select {
		case <-time.After(time.Until(t0.Add(o.Recheck))):
		case <-ctx.Done():
			return Result{}, ctx.Err()
		}
		kept2, p2 := f.checkHolds(holders)
		keptText += fmt.Sprintf(", and %d/%d %v after the kill", kept2, len(holders), o.Recheck)
		problems = append(problems, p2...)
	}
	r.Note = fmt.Sprintf("server 1 of %d SIGKILLed under %d nodes' streams: all resumed on the other %d with Last-Event-ID within %s of the kill (p50 %s); %s",
		o.Servers, len(moving), o.Servers-1, fmtDur(float64(moved.Microseconds())), fmtDur(r.P50), keptText)
	if len(problems) > 0 {
		r.Note += "; FAILED: " + strings.Join(problems[:min(5, len(problems))], "; ")
	}
	return r, nil
}

// checkHolds asks a live server whether each holder still holds its key
// with its token.
func (f *fleet) checkHolds(holders []*fleetNode) (int, []string) {
	cs, closeAll, err := f.conns()
	if err != nil {
		return 0, []string{err.Error()}
	}
	defer closeAll()
	var all []*rawhttp.Conn
	for _, l := range cs {
		all = append(all, l...)
	}
	var kept atomic.Int64
	var mu sync.Mutex
	var problems []string
	// A worker per connection, each asking about every len(all)-th holder.
	_ = parallel(len(all), len(all), func(w int) error {
		c := all[w]
		for i := w; i < len(holders); i += len(all) {
			n := holders[i]
			var st struct {
				Holder string `json:"holder"`
				Token  uint64 `json:"token"`
			}
			code, err := c.Get("/status?type=pull&resource_id=" + url.QueryEscape(n.held))
			if err == nil && code == 200 && json.Unmarshal(c.Body, &st) == nil && st.Holder == n.name && st.Token == n.token {
				kept.Add(1)
				continue
			}
			mu.Lock()
			problems = append(problems, fmt.Sprintf("%s lost %s: %d %v holder %q token %d, was %d", n.name, n.held, code, err, st.Holder, st.Token, n.token))
			mu.Unlock()
			if err != nil {
				return nil // this connection is gone
			}
		}
		return nil
	})
	return int(kept.Load()), problems
}

// fanout: every node waits on one key, queued through its own server; the
// holder succeeds, and each node's stream tells it.
func (f *fleet) fanout(ctx context.Context) (Result, error) {
	o := f.o
	key := fmt.Sprintf("fleet-%s-fanout", f.id)
	holder := "fleet-" + f.id + "-holder"
	cs, closeAll, err := f.conns()
	if err != nil {
		return Result{}, err
	}
	defer closeAll()
	var hc *rawhttp.Conn
	for _, l := range cs {
		hc = l[0]
		break
	}
	if _, err := lockAs(hc, key, holder, "ttl"); err != nil {
		return Result{}, err
	}
	// The holder renews its ttl lease while the waiters queue (Fanout).
	rc, err := f.o.Dialer.Dial(f.bases[len(f.bases)-1])
	if err != nil {
		return Result{}, err
	}
	defer rc.Close()
	stopRenew := make(chan struct{})
	var renew sync.WaitGroup
	renew.Go(func() {
		t := time.NewTicker(5 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-stopRenew:
				return
			case <-t.C:
				lockAs(rc, key, holder, "ttl")
			}
		}
	})
	qStart := time.Now()
	err = f.onServers(ctx, o.Nodes, func(c *rawhttp.Conn, i int) error {
		st, err := c.Post("/lock", fmt.Appendf(nil, `{"type":"pull","resource_id":%q,"node_id":%q}`, key, f.nodes[i].name))
		if err != nil || st != 200 {
			return fmt.Errorf("waiter %d: %d %v %s", i, st, err, c.Body)
		}
		return nil
	})
	close(stopRenew)
	renew.Wait()
	if err != nil {
		return Result{}, err
	}
	queued := time.Since(qStart)
	f.fanKey.Store(&key)
	t0 := time.Now()
	f.fanAt.Store(t0.UnixNano())
	st, err := hc.Post("/unlock", fmt.Appendf(nil, `{"type":"pull","resource_id":%q,"node_id":%q,"success":true}`, key, holder))
	if err != nil || st != 200 {
		return Result{}, fmt.Errorf("the holder's unlock: %d %v", st, err)
	}
	unlocked := time.Since(t0)
	deadline := t0.Add(time.Minute)
	for {
		told, broke := 0, 0
		for _, n := range f.nodes {
			if n.told.Load() > 0 {
				told++
				continue
			}
			select {
			case <-n.broken:
				broke++
			default:
			}
		}
		if told == len(f.nodes) {
			break
		}
		if broke > 0 || time.Now().After(deadline) || ctx.Err() != nil {
			return Result{}, fmt.Errorf("fan-out: %d of %d waiters told, %d streams broken, %v after the unlock", told, len(f.nodes), broke, time.Since(t0).Round(time.Millisecond))
		}
		time.Sleep(5 * time.Millisecond)
	}
	f.fanKey.Store(nil)
	lat := &latencies{}
	var last time.Duration
	for _, n := range f.nodes {
		d := time.Duration(n.told.Load())
		last = max(last, d)
		lat.add([]time.Duration{d})
	}
	r := lat.result("fleet-fanout", "dlock", "waiter told", o.Nodes, last)
	r.Note = fmt.Sprintf("%d waiters of one key, queued through the %d servers left in %s: all told within %s of the unlock (answered in %s)",
		o.Nodes, o.Servers-1, fmtDur(float64(queued.Microseconds())), fmtDur(float64(last.Microseconds())), fmtDur(float64(unlocked.Microseconds())))
	return r, nil
}

// hold: the nodes take o.Held locks with session leases, each through its
// own server; then every server's RSS and etcd's database size.
func (f *fleet) hold(ctx context.Context) (Result, error) {
	o := f.o
	if o.Held <= 0 {
		return Result{}, nil
	}
	start := time.Now()
	err := f.onServers(ctx, o.Held, func(c *rawhttp.Conn, i int) error {
		_, err := lockAs(c, fmt.Sprintf("sha256:fleet-%s-%d", f.id, i), f.nodes[i%len(f.nodes)].name, "session")
		return err
	})
	if err != nil {
		return Result{}, fmt.Errorf("taking %d locks: %w", o.Held, err)
	}
	elapsed := time.Since(start)
	rss, err := f.rss()
	if err != nil {
		return Result{}, err
	}
	r := Result{Scenario: "fleet-held", System: "dlock", Unit: "lock held", Concurrency: o.Conns * (o.Servers - 1), Ops: int64(o.Held),
		Seconds: elapsed.Seconds(), Rate: float64(o.Held) / elapsed.Seconds(), RSSMiB: maxOf(rss)}
	r.Note = fmt.Sprintf("%d locks held with session leases by the %d nodes, taken in %s: servers' RSS %s MiB",
		o.Held, o.Nodes, fmtDur(float64(elapsed.Microseconds())), mibList(rss))
	if o.EtcdEndpoint != "" {
		v, err := scrape(o.EtcdEndpoint, rawhttp.Dialer{}, "etcd_mvcc_db_total_size_in_bytes", "etcd_mvcc_db_total_size_in_use_in_bytes")
		if err != nil {
			r.Note += "; etcd's database size unknown: " + err.Error()
		} else {
			r.Note += fmt.Sprintf("; etcd's database %.1f MiB (%.1f MiB in use)", v["etcd_mvcc_db_total_size_in_bytes"]/(1<<20), v["etcd_mvcc_db_total_size_in_use_in_bytes"]/(1<<20))
		}
	}
	return r, nil
}

func maxOf(v []float64) float64 {
	m := 0.0
	for _, x := range v {
		m = max(m, x)
	}
	return m
}

func mibList(v []float64) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = fmt.Sprintf("%.1f", x)
	}
	return strings.Join(s, " / ")
}
