package etcd_test

import (
	"context"
	"flag"
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/dlock/dlock/internal/bench"
	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/etcd"
)

// What one server keeps in memory per held lock and per session
// (docs/BENCHMARKS.md, "What a server on etcd keeps per key"). The etcd
// here is Debian's etcd in a process of its own (etcdtest.StartCluster),
// so that the live heap measured is the dlock server's alone, as the
// embedded etcd's would not be. Run each once:
//
//	TMPDIR=/dev/shm go test ./lock/etcd/ -run '^$' -bench Memory -benchtime 1x
//
// DLOCK_BENCH_HELD and DLOCK_BENCH_SESSIONS change how many locks and
// sessions are measured (20,000 and 5,000); DLOCK_BENCH_HEAPPROFILE names a
// file for heap profiles (one a benchmark, its name appended) taken while
// they are held (-memprofile's comes
// after the server closed).

// BenchmarkMemoryHeld reports the live heap of one server per lock held
// with a session lease, taken through that server by 100 nodes whose
// session streams it keeps open (as `dlock bench --scenario memory`'s
// held-session): the keys' records in the cache of its watch, the timers'
// table and heap, and the lock_assigned events in the sessions' replay
// logs. The sessions themselves are open before the first measurement.
func BenchmarkMemoryHeld(b *testing.B) {
	const nodes = 100
	n := benchCount(b, "DLOCK_BENCH_HELD", 20000)
	be, streams := memoryServer(b, nodes)
	ctx := context.Background()
	before := liveHeap()
	var next atomic.Int64
	g, gctx := errgroup.WithContext(ctx)
	for range 16 {
		g.Go(func() error {
			for {
				i := int(next.Add(1)) - 1
				if i >= n || gctx.Err() != nil {
					return nil
				}
				req := lock.LockRequest{Type: lock.Pull, Resource: fmt.Sprintf("sha256:held-%d", i), Node: memNode(i % nodes), Lease: lock.LeaseSession}
				r, err := be.TryLock(gctx, req)
				if err != nil {
					return err
				}
				if !r.Acquired {
					return fmt.Errorf("%s: not acquired: %+v", req.Resource, r)
				}
			}
		})
	}
	if err := g.Wait(); err != nil {
		b.Fatal(err)
	}
	// Every grant's lock_assigned reached its stream: the watch has
	// applied every one of them.
	streams.waitEvents(b, n)
	after := liveHeap()
	heapProfile(b)
	b.ReportMetric(float64(int64(after)-int64(before))/float64(n), "B/lock")
	b.ReportMetric(float64(n), "locks")
}

// BenchmarkMemorySessions reports the live heap of one server per idle
// session stream open on it (as `dlock bench --scenario memory`'s
// idle-sessions): the stream, the session's entries in the watch, its
// cache and the keeper.
func BenchmarkMemorySessions(b *testing.B) {
	n := benchCount(b, "DLOCK_BENCH_SESSIONS", 5000)
	be, _ := memoryServer(b, 0)
	before := liveHeap()
	streams := openStreams(b, be, n)
	after := liveHeap()
	heapProfile(b)
	b.ReportMetric(float64(int64(after)-int64(before))/float64(n), "B/session")
	b.ReportMetric(float64(len(streams.all)), "sessions")
}

func benchCount(b *testing.B, env string, def int) int {
	if s := os.Getenv(env); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			b.Fatalf("%s=%q: not a count", env, s)
		}
		return n
	}
	return def
}

func memNode(i int) string { return fmt.Sprintf("mem-node-%d", i) }

// memoryServer starts an etcd of its own and one server on it, with the
// session streams of nodes nodes open.
func memoryServer(b *testing.B, nodes int) (*etcd.Backend, *memStreams) {
	_, be := ownServer(b)
	return be, openStreams(b, be, nodes)
}

// ownServer starts an etcd member process of its own and one server on it.
func ownServer(b *testing.B) (*etcdtest.Cluster, *etcd.Backend) {
	c := etcdtest.StartCluster(b, 1)
	cfg := etcd.DefaultConfig()
	cfg.Prefix = "/mem/"
	be, err := etcd.New(b.Context(), c.Client(b), cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { be.Close() })
	return c, be
}

// memStreams drains session streams as a server does, through Notify and
// without a goroutine each (whose memory would count as the session's),
// and counts what they received.
type memStreams struct {
	all    []lock.Stream
	ready  []atomic.Bool // all[i] has items waiting
	wake   chan struct{}
	events atomic.Int64
	wg     sync.WaitGroup
}

func openStreams(b *testing.B, be *etcd.Backend, n int) *memStreams {
	s := &memStreams{all: make([]lock.Stream, n), ready: make([]atomic.Bool, n), wake: make(chan struct{}, 1)}
	stop := make(chan struct{})
	b.Cleanup(func() {
		close(stop)
		s.wg.Wait()
		for _, st := range s.all {
			if st != nil {
				st.Close()
			}
		}
	})
	var g errgroup.Group
	g.SetLimit(16)
	for i := range n {
		g.Go(func() error {
			st, _, err := be.Subscribe(context.Background(), lock.SubscribeRequest{Node: memNode(i)})
			if err != nil {
				return fmt.Errorf("session %d: %w", i, err)
			}
			s.all[i] = st
			st.Notify(func() {
				s.ready[i].Store(true)
				select {
				case s.wake <- struct{}{}:
				default:
				}
			})
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		b.Fatal(err)
	}
	s.wg.Go(func() {
		var buf []lock.Delivery
		for {
			select {
			case <-s.wake:
			case <-stop:
				return
			}
			for i, st := range s.all {
				if s.ready[i].Swap(false) {
					buf = st.Take(buf[:0])
					s.events.Add(int64(len(buf)))
				}
			}
		}
	})
	return s
}

// waitEvents waits until the streams received n events; a stream closed
// as slow fails the benchmark.
func (s *memStreams) waitEvents(b *testing.B, n int) {
	deadline := time.Now().Add(2 * time.Minute)
	for s.events.Load() < int64(n) {
		if time.Now().After(deadline) {
			b.Fatalf("after 2 minutes, %d of %d events received", s.events.Load(), n)
		}
		for _, st := range s.all {
			select {
			case <-st.Done():
				b.Fatalf("a stream ended (slow: %v) with %d of %d events received", st.Slow(), s.events.Load(), n)
			default:
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// heapProfile writes the heap profile DLOCK_BENCH_HEAPPROFILE asks for.
func heapProfile(b *testing.B) {
	path := os.Getenv("DLOCK_BENCH_HEAPPROFILE")
	if path == "" {
		return
	}
	f, err := os.Create(path + "." + b.Name())
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	if err := pprof.Lookup("heap").WriteTo(f, 0); err != nil {
		b.Fatal(err)
	}
}

// liveHeap is the heap in use after two collections: what is reachable.
func liveHeap() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// TestMemoryBenchmarksRun runs the benchmarks of this file small, as
// docs/BENCHMARKS.md shows them run: each must measure and report.
func TestMemoryBenchmarksRun(t *testing.T) {
	etcdtest.EtcdBinary(t)
	t.Setenv("DLOCK_BENCH_HELD", "60")
	t.Setenv("DLOCK_BENCH_SESSIONS", "20")
	// Once each, as -benchtime 1x: a benchmark that takes under the
	// default second would be run again with a larger b.N, which these
	// do not use.
	old := flag.Lookup("test.benchtime").Value.String()
	if err := flag.Set("test.benchtime", "1x"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = flag.Set("test.benchtime", old) })
	for _, c := range []struct {
		name, unit string
		fn         func(*testing.B)
	}{
		{"BenchmarkMemoryHeld", "B/lock", BenchmarkMemoryHeld},
		{"BenchmarkMemorySessions", "B/session", BenchmarkMemorySessions},
		{"BenchmarkSessionsOpen", "cpu-µs/session", BenchmarkSessionsOpen},
	} {
		r := testing.Benchmark(c.fn)
		if _, ok := r.Extra[c.unit]; r.N != 1 || !ok {
			t.Errorf("%s: %d runs, metrics %v; want one run reporting %s", c.name, r.N, r.Extra, c.unit)
		}
	}
}

// BenchmarkSessionsOpen opens b.N sessions on one server, 64 at once, as
// a fleet's streams reach it, on an etcd of its own process, and reports
// the server's CPU per session (getrusage: every goroutine of this
// process, the benchmark's own included) and etcd's, which a fleet's
// opening spends (docs/BENCHMARKS.md, "Fleet scale on etcd"). Run it with
// -benchtime 10000x -count 6.
func BenchmarkSessionsOpen(b *testing.B) {
	c, be := ownServer(b)
	all := make([]lock.Stream, b.N)
	b.Cleanup(func() {
		for _, st := range all {
			if st != nil {
				st.Close()
			}
		}
	})
	etcdCPU := bench.ProcCPU(c.Pid(0))
	etcdBefore, err := etcdCPU()
	if err != nil {
		b.Fatal(err)
	}
	reqs0, txns0 := etcd.WriteRequestsForTest(be)
	before := cpuTime(b)
	b.ReportAllocs()
	b.ResetTimer()
	var g errgroup.Group
	g.SetLimit(64)
	for i := range b.N {
		g.Go(func() error {
			st, _, err := be.Subscribe(context.Background(), lock.SubscribeRequest{Node: memNode(i)})
			all[i] = st
			return err
		})
	}
	if err := g.Wait(); err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	b.ReportMetric(float64((cpuTime(b)-before).Microseconds())/float64(b.N), "cpu-µs/session")
	etcdAfter, err := etcdCPU()
	if err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64((etcdAfter-etcdBefore).Microseconds())/float64(b.N), "etcd-cpu-µs/session")
	reqs, txns := etcd.WriteRequestsForTest(be)
	b.ReportMetric(float64(txns-txns0)/float64(max(1, reqs-reqs0)), "txns/request")
}

// cpuTime is the CPU time this process has used, user and system.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
