package server

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/rawhttp"
	"github.com/dlock/dlock/lock/memory"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"
)

// benchServer runs a real server on a loopback listener, with the ping
// interval of a default dlock serve.
func benchServer(b *testing.B) string {
	e := newEnvWith(b, envConfig{opts: Options{PingInterval: 15 * time.Second}})
	return e.ts.URL
}

func benchClient(conns int) *http.Client {
	return &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: conns, MaxConnsPerHost: conns, DisableCompression: true}}
}

func post(c *http.Client, url string, body []byte) error {
	resp, err := c.Post(url, "application/json", bytes.NewReader(body))
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		return fmt.Errorf("%s: %d", url, resp.StatusCode)
	}
	return nil
}

// BenchmarkHTTPPairs: lock + unlock(success) over HTTP/1.1 keep-alive from
// 32 concurrent connections on distinct keys. One op is one pair. The load
// comes from a minimal HTTP/1.1 client (internal/rawhttp) so that the numbers
// measure the server rather than net/http's client, which shares the cores.
func BenchmarkHTTPPairs(b *testing.B) {
	base := benchServer(b)
	const clients = 32
	var next atomic.Int64
	b.SetParallelism((clients + 1) / 2) // GOMAXPROCS is 2 here: 32 goroutines
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		g := next.Add(1)
		rc, err := rawhttp.Dial(base)
		if err != nil {
			b.Fatal(err)
		}
		defer rc.Close()
		i := 0
		var body []byte
		for pb.Next() {
			i++
			body = fmt.Appendf(body[:0], `{"type":"pull","resource_id":"sha256:%d-%d","node_id":"n%d"}`, g, i%1000, g)
			for _, path := range []string{"/lock", "/unlock"} {
				if st, err := rc.Post(path, body); err != nil || st != 200 {
					b.Fatalf("%s: %d %v", path, st, err)
				}
			}
		}
	})
}

// BenchmarkHTTPHandoff measures a failure hand-off end to end: from the
// holder's /unlock being sent to the waiter's lock_assigned read off its
// SSE stream. It reports p50 and p99 of that latency.
func BenchmarkHTTPHandoff(b *testing.B) {
	base := benchServer(b)
	c := benchClient(4)
	nodes := []string{"a", "b"}
	streams := make([]*kit.Stream, 2)
	for i, n := range nodes {
		streams[i] = kit.OpenStream(b, base+"/subscribe?node_id="+n, "")
		readEvent(b, streams[i], "subscribed")
	}
	lockBody := func(n string) []byte {
		return fmt.Appendf(nil, `{"type":"pull","resource_id":"hot","node_id":"%s"}`, n)
	}
	if err := post(c, base+"/lock", lockBody("a")); err != nil {
		b.Fatal(err)
	}
	readEvent(b, streams[0], "lock_assigned")
	var lat []time.Duration
	var mu sync.Mutex
	for i := 0; b.Loop(); i++ {
		h, w := i%2, (i+1)%2
		if err := post(c, base+"/lock", lockBody(nodes[w])); err != nil {
			b.Fatal(err)
		}
		start := time.Now()
		done := make(chan struct{})
		go func() {
			readEvent(b, streams[w], "lock_assigned")
			mu.Lock()
			lat = append(lat, time.Since(start))
			mu.Unlock()
			close(done)
		}()
		if err := post(c, base+"/unlock", fmt.Appendf(nil, `{"type":"pull","resource_id":"hot","node_id":"%s","error":"x"}`, nodes[h])); err != nil {
			b.Fatal(err)
		}
		<-done
		// The waiter confirms its hand-off grant, as a client does.
		if err := post(c, base+"/lock", lockBody(nodes[w])); err != nil {
			b.Fatal(err)
		}
	}
	slices.Sort(lat)
	if len(lat) > 0 {
		b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
		b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
	}
}

// readEvent reads s up to the next event called name.
func readEvent(b *testing.B, s *kit.Stream, name string) {
	for s.Next(b).Event != name {
	}
}

// memConn feeds the lean loop lock + unlock pairs from memory, one request
// a Read as a client waiting for each answer sends them, and discards the
// answers: what the loop costs without the kernel's share.
type memConn struct {
	n, pairs  int
	req, body []byte
	unlock    bool
}

func (c *memConn) Read(p []byte) (int, error) {
	if c.n >= c.pairs {
		return 0, io.EOF
	}
	path := "/lock"
	if c.unlock {
		path = "/unlock"
	}
	c.body = append(c.body[:0], `{"type":"pull","resource_id":"bench-`...)
	c.body = strconv.AppendInt(c.body, int64(c.n%4096), 10)
	c.body = append(c.body, `","node_id":"w1","lease":"ttl"}`...)
	c.req = append(append(append(c.req[:0], "POST "...), path...), " HTTP/1.1\r\nHost: 127.0.0.1:7380\r\nContent-Type: application/json\r\nContent-Length: "...)
	c.req = append(append(strconv.AppendInt(c.req, int64(len(c.body)), 10), "\r\n\r\n"...), c.body...)
	if c.unlock {
		c.n++
	}
	c.unlock = !c.unlock
	return copy(p, c.req), nil
}

func (c *memConn) Write(p []byte) (int, error)      { return len(p), nil }
func (c *memConn) Close() error                     { return nil }
func (c *memConn) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (c *memConn) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (c *memConn) SetDeadline(time.Time) error      { return nil }
func (c *memConn) SetReadDeadline(time.Time) error  { return nil }
func (c *memConn) SetWriteDeadline(time.Time) error { return nil }

// BenchmarkLeanLoopPairs: the lean loop serving lock + unlock pairs on
// distinct keys from memory, without syscalls. One op is one pair; its
// allocations are the server's and the lock manager's.
func BenchmarkLeanLoopPairs(b *testing.B) {
	m, err := memory.New(context.Background(), memory.DefaultConfig())
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close()
	s := New(m, Options{})
	mc := &memConn{pairs: b.N}
	lc := &leanConn{Conn: mc}
	s.trackLean(lc, true, false)
	b.ReportAllocs()
	b.ResetTimer()
	s.serveLean(lc, newPassListener(mc.LocalAddr()), &http.Server{}, handover{})
}

// BenchmarkMemoryStreams reports what one server keeps per idle session
// stream (as `dlock bench --scenario memory`'s idle-sessions, on the
// memory engine): its live heap, its goroutine stacks and its goroutines,
// each a stream. "event loop" serves connections as dlock serve does on
// the memory engine, "goroutines" as it does on etcd (no event loop). The
// streams are opened from raw sockets, which keep nothing on this
// process's heap. DLOCK_BENCH_STREAMS sets how many (5,000 by default);
// DLOCK_BENCH_HEAPPROFILE=FILE writes a heap profile, every allocation
// sampled, to FILE.event-loop and FILE.goroutines while they are open.
func BenchmarkMemoryStreams(b *testing.B) {
	n := 5000
	if v := os.Getenv("DLOCK_BENCH_STREAMS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 1 {
			b.Fatalf("DLOCK_BENCH_STREAMS=%q: not a count", v)
		}
	}
	profile := os.Getenv("DLOCK_BENCH_HEAPPROFILE")
	if profile != "" {
		defer func(rate int) { runtime.MemProfileRate = rate }(runtime.MemProfileRate)
		runtime.MemProfileRate = 1
	}
	for _, loop := range loops {
		name := strings.ReplaceAll(loop.name, " ", "-")
		b.Run(name, func(b *testing.B) {
			profile := profile
			if profile != "" {
				profile += "." + name
			}
			memoryStreams(b, n, loop.goroutines, profile)
		})
	}
}

// BenchmarkStreamOpen opens b.N session streams from raw sockets, 8 at a
// time, each read up to its subscribed event, and reports what opening one
// allocates and costs on the memory engine: "event loop" as dlock serve
// opens them there, "goroutines" as it does on etcd (no event loop). The
// allocations include the benchmark's own (a 1 KiB read buffer and the
// request, a stream).
func BenchmarkStreamOpen(b *testing.B) {
	for _, loop := range loops {
		b.Run(strings.ReplaceAll(loop.name, " ", "-"), func(b *testing.B) { streamOpen(b, loop.goroutines) })
	}
}

// streamOpen is BenchmarkStreamOpen on one server, with or without the
// event loop.
func streamOpen(b *testing.B, goroutines bool) {
	e := newEnvWith(b, envConfig{mod: func(c *memory.Config) { c.Rules.MaxSessions = b.N + 64 },
		goroutines: goroutines, opts: Options{PingInterval: time.Minute}})
	addr := e.ts.Listener.Addr().(*net.TCPAddr)
	rawStreams(b, addr, "warm", 1)
	b.ReportAllocs()
	b.ResetTimer()
	rawStreams(b, addr, "open", b.N)
}

// memoryStreams is BenchmarkMemoryStreams on one server, with or without
// the event loop, writing a heap profile to profile unless it is "".
func memoryStreams(b *testing.B, n int, goroutines bool, profile string) {
	// The ping interval of a default dlock serve.
	e := newEnvWith(b, envConfig{mod: func(c *memory.Config) { c.Rules.MaxSessions = n + 64 },
		goroutines: goroutines, opts: Options{PingInterval: time.Second}})
	addr := e.ts.Listener.Addr().(*net.TCPAddr)
	// One stream first: the hub's writers, pinger and poller, the pools,
	// start with it and are not a stream's.
	rawStreams(b, addr, "warm", 1)
	workers := e.srv.leanWorkers.Load()
	before, stacksBefore, gBefore := liveMemory()
	fds := rawStreams(b, addr, "idle", n)
	after, stacks, g := liveMemory()
	// The lean goroutines that opened the streams wait for the next
	// connection (leanWorker), the server's and not a stream's.
	g -= int(e.srv.leanWorkers.Load() - workers)
	if profile != "" {
		f, err := os.Create(profile)
		if err != nil {
			b.Fatal(err)
		}
		defer f.Close()
		if err := pprof.Lookup("heap").WriteTo(f, 0); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(int64(after)-int64(before))/float64(len(fds)), "heap-B/stream")
	b.ReportMetric(float64(int64(stacks)-int64(stacksBefore))/float64(len(fds)), "stack-B/stream")
	b.ReportMetric(float64(g-gBefore)/float64(len(fds)), "goroutines/stream")
}

// TestMemoryStreamsBenchmarkRuns runs BenchmarkMemoryStreams small, as
// docs/BENCHMARKS.md shows it run: each way must measure and report, and
// an idle plain-TCP stream must keep no goroutine.
func TestMemoryStreamsBenchmarkRuns(t *testing.T) {
	// Once each, as -benchtime 1x: a benchmark that takes under the
	// default second would be run again with a larger b.N, which this
	// one does not use.
	old := flag.Lookup("test.benchtime").Value.String()
	if err := flag.Set("test.benchtime", "1x"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = flag.Set("test.benchtime", old) })
	for _, loop := range loops {
		r := testing.Benchmark(func(b *testing.B) { memoryStreams(b, 20, loop.goroutines, "") })
		_, heap := r.Extra["heap-B/stream"]
		if g, ok := r.Extra["goroutines/stream"]; r.N != 1 || !heap || !ok || g != 0 {
			t.Errorf("%s: %d runs, metrics %v; want one run reporting heap-B/stream, and 0 goroutines/stream", loop.name, r.N, r.Extra)
		}
	}
}

// TestStreamOpenBenchmarkRuns runs BenchmarkStreamOpen small, as
// docs/BENCHMARKS.md shows it run, and holds the lean loop to its pooled
// buffers: a stream it opens (goroutines) allocates about what one the
// event loop opens does, not 8 KiB more for a reader and a writer of its
// own (11.3 KB a stream before the pools, 3.3 KB for the event loop's).
// The two are compared, not held to a fixed count: under -race sync.Pool
// drops a quarter of what it is given, and every P adds allocations of its
// own.
func TestStreamOpenBenchmarkRuns(t *testing.T) {
	old := flag.Lookup("test.benchtime").Value.String()
	if err := flag.Set("test.benchtime", "500x"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = flag.Set("test.benchtime", old) })
	perStream := map[bool]int64{}
	for _, loop := range loops {
		r := testing.Benchmark(func(b *testing.B) { streamOpen(b, loop.goroutines) })
		if r.N != 500 {
			t.Fatalf("%s: %d streams opened, want 500", loop.name, r.N)
		}
		perStream[loop.goroutines] = r.AllocedBytesPerOp()
	}
	if extra := perStream[true] - perStream[false]; extra >= 5<<10 {
		t.Errorf("a stream opened without the event loop allocated %d B, %d B more than with it: the lean loop's buffers are not pooled", perStream[true], extra)
	}
}

// liveMemory is the heap in use after two collections (what is
// reachable), the goroutine stacks in use and the goroutines.
func liveMemory() (heap, stacks uint64, goroutines int) {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc, m.StackInuse, runtime.NumGoroutine()
}

// rawStreams opens n session streams on addr, for nodes prefix-i, each from
// a socket of its own read up to its subscribed event, and closes them when
// b ends. The sockets are raw descriptors, blocking, outside Go's netpoller.
func rawStreams(b *testing.B, addr *net.TCPAddr, prefix string, n int) []int {
	fds := make([]int, n)
	for i := range fds {
		fds[i] = -1
	}
	b.Cleanup(func() {
		for _, fd := range fds {
			if fd >= 0 {
				unix.Close(fd)
			}
		}
	})
	var ip [4]byte
	copy(ip[:], addr.IP.To4())
	var g errgroup.Group
	g.SetLimit(8)
	for i := range fds {
		g.Go(func() error {
			fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				return err
			}
			fds[i] = fd
			if err := unix.Connect(fd, &unix.SockaddrInet4{Port: addr.Port, Addr: ip}); err != nil {
				return err
			}
			req := fmt.Appendf(nil, "GET /subscribe?node_id=%s-%d HTTP/1.1\r\nHost: %s\r\n\r\n", prefix, i, addr)
			if _, err := unix.Write(fd, req); err != nil {
				return err
			}
			var got []byte
			buf := make([]byte, 1024)
			for !bytes.Contains(got, []byte("event: subscribed\n")) {
				m, err := unix.Read(fd, buf)
				if err != nil || m == 0 {
					return fmt.Errorf("stream %d: read %d bytes %q: %v", i, m, got, err)
				}
				got = append(got, buf[:m]...)
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		b.Fatal(err)
	}
	return fds
}
