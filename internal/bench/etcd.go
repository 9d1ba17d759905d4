package bench

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"
)

// StartEtcd runs a one-member etcd on free 127.0.0.1 ports, with its data in
// a temporary directory, until stop is called.
func StartEtcd() (endpoint string, stop func(), err error) {
	client, err := freeAddr()
	if err != nil {
		return "", nil, err
	}
	peer, err := freeAddr()
	if err != nil {
		return "", nil, err
	}
	dir, err := os.MkdirTemp("", "dlock-bench-etcd")
	if err != nil {
		return "", nil, err
	}
	cmd := exec.Command("etcd", "--name", "bench", "--data-dir", dir,
		"--listen-client-urls", "http://"+client, "--advertise-client-urls", "http://"+client,
		"--listen-peer-urls", "http://"+peer, "--initial-advertise-peer-urls", "http://"+peer,
		"--initial-cluster", "bench=http://"+peer, "--log-level", "error")
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return "", nil, err
	}
	stop = func() { cmd.Process.Kill(); cmd.Wait(); os.RemoveAll(dir) }
	if err := waitFor(func() bool {
		c, err := net.Dial("tcp", client)
		if err == nil {
			c.Close()
		}
		return err == nil
	}); err != nil {
		stop()
		return "", nil, fmt.Errorf("etcd did not start: %w", err)
	}
	return "http://" + client, stop, nil
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
