package bench

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"
)

// StartEtcd runs a one-member etcd (bin, or etcd in PATH when bin is empty)
// on free 127.0.0.1 ports, with its data in a temporary directory, until
// stop is called.
func StartEtcd(bin string) (endpoint string, stop func(), err error) {
	e, err := LaunchEtcd(bin)
	if err != nil {
		return "", nil, err
	}
	return e.Endpoint, e.Stop, nil
}

// Etcd is an etcd that bench started, and its setup, which every number
// measured on it is reported with (docs/BENCHMARKS.md, "dlock on etcd"):
// `--compare etcd` measures etcd's own concurrency.Mutex on it and
// `--backend etcd` the dlock servers it starts on it.
type Etcd struct {
	Endpoint string // the client URL, http://127.0.0.1:PORT
	Binary   string // the etcd that runs
	Version  string // the server's version, from its /version
	DataDir  string
	// Disk is the device and file system the data dir is on: etcd
	// fsyncs its write-ahead log there on every commit (bench never
	// passes --unsafe-no-fsync), so it bounds every write.
	Disk string
	PID  int // the etcd process: its CPU is read from /proc (ProcCPU)
	stop func()
}

// Stop kills the etcd and removes its data.
func (e *Etcd) Stop() { e.stop() }

// String is the setup in one line.
func (e *Etcd) String() string {
	return fmt.Sprintf("etcd %s (%s), one member at %s, fsync on (no --unsafe-no-fsync), data dir %s on %s, default snapshot, heartbeat and election settings",
		e.Version, e.Binary, e.Endpoint, e.DataDir, e.Disk)
}

// LaunchEtcd runs a one-member etcd on free 127.0.0.1 ports, with its data
// in a temporary directory, until its Stop.
func LaunchEtcd(bin string) (*Etcd, error) {
	client, err := freeAddr()
	if err != nil {
		return nil, err
	}
	peer, err := freeAddr()
	if err != nil {
		return nil, err
	}
	if bin == "" {
		if bin, err = exec.LookPath("etcd"); err != nil {
			return nil, err
		}
	}
	dir, err := os.MkdirTemp("", "dlock-bench-etcd")
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, "--name", "bench", "--data-dir", dir,
		"--listen-client-urls", "http://"+client, "--advertise-client-urls", "http://"+client,
		"--listen-peer-urls", "http://"+peer, "--initial-advertise-peer-urls", "http://"+peer,
		"--initial-cluster", "bench=http://"+peer, "--log-level", "error")
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	e := &Etcd{Endpoint: "http://" + client, Binary: bin, DataDir: dir, PID: cmd.Process.Pid,
		stop: func() { cmd.Process.Kill(); cmd.Wait(); os.RemoveAll(dir) }}
	if err := waitFor(func() bool {
		v, err := etcdVersion(e.Endpoint)
		e.Version = v
		return err == nil
	}); err != nil {
		e.Stop()
		return nil, fmt.Errorf("etcd did not start: %w", err)
	}
	e.Disk = "an unknown disk"
	if mi, err := os.ReadFile("/proc/self/mountinfo"); err == nil {
		if real, err := filepath.EvalSymlinks(dir); err == nil {
			e.Disk = diskOf(real, string(mi))
		}
	}
	return e, nil
}

// etcdVersion reads the server's version from its /version.
func etcdVersion(endpoint string) (string, error) {
	hc := &http.Client{Timeout: 2 * time.Second}
	resp, err := hc.Get(endpoint + "/version")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	var v struct {
		Server string `json:"etcdserver"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&v); err != nil || v.Server == "" {
		return "", fmt.Errorf("%s/version: %s, %v", endpoint, resp.Status, err)
	}
	return v.Server, nil
}

// diskOf names the mount that path is on, from /proc/self/mountinfo's
// text: "SOURCE (FSTYPE at MOUNTPOINT)". A tmpfs there would make etcd's
// fsyncs free, and the comparison meaningless.
func diskOf(path, mountinfo string) string {
	best, bestLen := "an unknown disk", -1
	for line := range strings.Lines(mountinfo) {
		// id parent major:minor root mountpoint options [optional...] - fstype source superoptions
		pre, post, ok := strings.Cut(strings.TrimSpace(line), " - ")
		if !ok {
			continue
		}
		f, g := strings.Fields(pre), strings.Fields(post)
		if len(f) < 5 || len(g) < 2 {
			continue
		}
		mp := strings.ReplaceAll(f[4], `\040`, " ")
		if !(path == mp || mp == "/" || strings.HasPrefix(path, mp+"/")) || len(mp) <= bestLen {
			continue
		}
		best, bestLen = fmt.Sprintf("%s (%s at %s)", g[1], g[0], mp), len(mp)
	}
	return best
}

// EtcdCalls reads an etcd's count of answered gRPC calls by method (Range,
// Txn, Put, DeleteRange, LeaseGrant, ...) and of its WAL fsyncs ("fsync")
// from its /metrics: read before and after a run, the difference per op is
// the round trips an op costs on that etcd (EtcdCallsPerOp).
func EtcdCalls(endpoint string) (map[string]float64, error) {
	hc := &http.Client{Timeout: 30 * time.Second}
	resp, err := hc.Get(endpoint + "/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s/metrics: %s", endpoint, resp.Status)
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	return parseEtcdCalls(string(b)), nil
}

// parseEtcdCalls sums grpc_server_handled_total over its codes, by
// grpc_method, and takes etcd_disk_wal_fsync_duration_seconds_count as
// "fsync". Streams (Watch, LeaseKeepAlive) count once each, when they end.
func parseEtcdCalls(text string) map[string]float64 {
	calls := map[string]float64{}
	for line := range strings.Lines(text) {
		line = strings.TrimSpace(line)
		switch {
		case strings.HasPrefix(line, "grpc_server_handled_total{"):
			labels, value, ok := strings.Cut(strings.TrimPrefix(line, "grpc_server_handled_total{"), "} ")
			if !ok {
				continue
			}
			_, m, ok := strings.Cut(labels, `grpc_method="`)
			if !ok {
				continue
			}
			method, _, _ := strings.Cut(m, `"`)
			if f, err := strconv.ParseFloat(strings.Fields(value)[0], 64); err == nil {
				calls[method] += f
			}
		case strings.HasPrefix(line, "etcd_disk_wal_fsync_duration_seconds_count "):
			if f, err := strconv.ParseFloat(strings.Fields(line)[1], 64); err == nil {
				calls["fsync"] = f
			}
		}
	}
	return calls
}

// EtcdCallsPerOp is (after - before) / ops for each count that moved.
func EtcdCallsPerOp(before, after map[string]float64, ops int64) map[string]float64 {
	if ops <= 0 {
		return nil
	}
	per := map[string]float64{}
	for k, a := range after {
		if d := a - before[k]; d > 0 {
			per[k] = d / float64(ops)
		}
	}
	return per
}

// EtcdCallsText is the counts per op in one line, the most frequent first:
// "Range 4.00, Txn 2.00, fsync 0.45".
func EtcdCallsText(per map[string]float64) string {
	keys := slices.Collect(maps.Keys(per))
	slices.SortFunc(keys, func(a, b string) int {
		if c := cmp.Compare(per[b], per[a]); c != 0 {
			return c
		}
		return strings.Compare(a, b)
	})
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %.2f", k, per[k]))
	}
	return strings.Join(parts, ", ")
}

// etcdSession connects one worker with a session (lease) of its own; stop
// closes both.
func etcdSession(endpoint string) (s *concurrency.Session, stop func(), err error) {
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{endpoint}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		return nil, nil, err
	}
	s, err = concurrency.NewSession(cli, concurrency.WithTTL(60))
	if err != nil {
		cli.Close()
		return nil, nil, err
	}
	return s, func() { s.Close(); cli.Close() }, nil
}

// EtcdPairs: concurrency.Mutex Lock + Unlock on distinct keys, one session
// (lease) per worker.
func EtcdPairs(ctx context.Context, endpoint string, opts Options) (Result, error) {
	id := runID()
	lat, elapsed, err := runWorkers(ctx, opts, opts.Concurrency, func(ctx context.Context, w int, ops *atomic.Int64, lat *[]time.Duration) error {
		s, stop, err := etcdSession(endpoint)
		if err != nil {
			return err
		}
		defer stop()
		for i := 0; ctx.Err() == nil; i++ {
			m := concurrency.NewMutex(s, fmt.Sprintf("/bench/%s/%d/%d", id, w, i%4096))
			t0 := time.Now()
			if err := m.Lock(ctx); err != nil {
				if ctx.Err() != nil {
					return nil
				}
				return err
			}
			if err := m.Unlock(context.WithoutCancel(ctx)); err != nil {
				return err
			}
			*lat = append(*lat, time.Since(t0))
			ops.Add(1)
		}
		return nil
	})
	return lat.result("pairs", "etcd", "lock+unlock", opts.Concurrency, elapsed), err
}

// EtcdHandoff: W sessions wait on one concurrency.Mutex; each holder unlocks
// and queues again. etcd's mutex is FIFO by creation revision and wakes only
// the next waiter, like dlock.
func EtcdHandoff(ctx context.Context, endpoint string, opts Options) (Result, error) {
	key := "/bench/handoff/" + runID()
	var sentAt atomic.Int64
	start := time.Now()
	lat, elapsed, err := runWorkers(ctx, opts, opts.Concurrency, func(ctx context.Context, w int, ops *atomic.Int64, lat *[]time.Duration) error {
		s, stop, err := etcdSession(endpoint)
		if err != nil {
			return err
		}
		defer stop()
		m := concurrency.NewMutex(s, key)
		for ctx.Err() == nil {
			if err := m.Lock(ctx); err != nil {
				if ctx.Err() != nil {
					return nil
				}
				return err
			}
			if at := sentAt.Load(); at > 0 {
				*lat = append(*lat, time.Duration(time.Since(start).Nanoseconds()-at))
				ops.Add(1)
			}
			sentAt.Store(time.Since(start).Nanoseconds())
			if err := m.Unlock(context.WithoutCancel(ctx)); err != nil {
				return err
			}
		}
		return nil
	})
	return lat.result("handoff", "etcd", "hand-off", opts.Concurrency, elapsed), err
}
