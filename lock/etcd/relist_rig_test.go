package etcd

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
)

// relistRig is three servers of one data set whose watches a test can
// end, and the chaos that makes them list the state again while nodes
// change it (TestAttackKeptQueues, TestAttackMarksMatchEtcd).
type relistRig struct {
	t     *testing.T
	srv   *etcdtest.Server
	cfg   Config
	setup func(*Backend)                 // more for each server opened
	more  []grpc.StreamClientInterceptor // after the watch killer's
	// relists counts the servers' watches compacted past, each followed
	// by a list of the state (watch.go follow).
	relists atomic.Int64

	mu      sync.Mutex
	servers []*rigServer
}

// rigServer is a server with a client whose watch streams the test can end.
type rigServer struct {
	b *Backend
	k *watchKiller
}

// newRelistRig opens three servers on srv with cfg (its Logger counts
// the relists), each set up with setup and its client's streams passed
// through more after the watch killer.
func newRelistRig(t *testing.T, srv *etcdtest.Server, cfg Config, setup func(*Backend), more ...grpc.StreamClientInterceptor) *relistRig {
	g := &relistRig{t: t, srv: srv, cfg: cfg, setup: setup, more: more, servers: make([]*rigServer, 3)}
	g.cfg.Logger = slog.New(relistCounter{slog.DiscardHandler, &g.relists})
	for i := range g.servers {
		if g.servers[i] = g.open(); g.servers[i] == nil {
			t.FailNow()
		}
	}
	return g
}

func (g *relistRig) open() *rigServer {
	t := g.t
	k := &watchKiller{}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   g.srv.Endpoints(),
		DialTimeout: 5 * time.Second,
		Logger:      zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithChainStreamInterceptor(append([]grpc.StreamClientInterceptor{k.intercept}, g.more...)...)},
	})
	if err != nil {
		t.Error(err)
		return nil
	}
	t.Cleanup(func() { cli.Close() })
	b, err := New(t.Context(), cli, g.cfg)
	if err != nil {
		t.Errorf("opening a server: %v", err)
		return nil
	}
	t.Cleanup(func() { b.Close() })
	HoldRequestsForTest(b, 2*time.Millisecond) // transactions of several keys share requests
	if g.setup != nil {
		g.setup(b)
	}
	return &rigServer{b, k}
}

// keysOf is every key of the types on each of the resources: the keys
// the racing nodes share, where the types of one resource meet (a pull's
// success erases a delete's record).
func keysOf(resources []string, types ...lock.Type) []lock.Key {
	var keys []lock.Key
	for _, res := range resources {
		for _, typ := range types {
			keys = append(keys, lock.Key{Type: typ, Resource: res})
		}
	}
	return keys
}

// pick is one of the servers, at random.
func (g *relistRig) pick(r *rand.Rand) *rigServer {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.servers[r.IntN(len(g.servers))]
}

// now is the servers as they are.
func (g *relistRig) now() []*rigServer {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.servers)
}

// race runs nodes nodes until ctx ends, each calling op again and again
// on a server and a key of keys drawn at random; an error that the race
// does not explain (racingErr) fails the test.
func (g *relistRig) race(ctx context.Context, wg *sync.WaitGroup, nodes int, keys []lock.Key, op func(r *rand.Rand, b *Backend, k lock.Key, node string) error) {
	for i := range nodes {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(i), uint64(time.Now().UnixNano())))
			node := fmt.Sprint("n", i)
			for ctx.Err() == nil {
				b := g.pick(r).b
				k := keys[r.IntN(len(keys))]
				if err := op(r, b, k, node); !racingErr(ctx, err) {
					g.t.Errorf("%s on %v: %v", node, k, err)
				}
			}
		})
	}
}

// relist, until ctx ends, every 100 to 400 ms ends one server's watch and
// has etcd compacted past it before it opens again (follow waits 100 ms),
// so that the server lists the state again; one time in replaceOneIn it
// first replaces a server by a new one, which lists the state while the
// others change it. cli writes under prefix.
func (g *relistRig) relist(ctx context.Context, cli *clientv3.Client, prefix string, replaceOneIn int) {
	r := rand.New(rand.NewPCG(99, uint64(time.Now().UnixNano())))
	for ctx.Err() == nil {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Duration(100+r.IntN(300)) * time.Millisecond):
		}
		if r.IntN(replaceOneIn) == 0 {
			i := r.IntN(len(g.servers))
			g.mu.Lock()
			old := g.servers[i]
			g.mu.Unlock()
			old.b.Close()
			if nb := g.open(); nb != nil {
				g.mu.Lock()
				g.servers[i] = nb
				g.mu.Unlock()
			}
		}
		g.pick(r).k.kill()
		for range 2 {
			if _, err := cli.Put(ctx, prefix+"bump", ""); err != nil {
				return
			}
		}
		resp, err := cli.Get(ctx, prefix+"bump")
		if err != nil {
			return
		}
		if _, err := cli.Compact(ctx, resp.Header.Revision); err != nil && ctx.Err() == nil && !errors.Is(err, rpctypes.ErrCompacted) {
			g.t.Errorf("compacting: %v", err)
		}
	}
}

// racingErr reports whether err, from a call of a node racing others on
// a few keys, is one a lock service answers such a race with (or the
// run's end), and not a fault.
func racingErr(ctx context.Context, err error) bool {
	switch {
	case err == nil, ctx.Err() != nil, errors.Is(err, lock.ErrClosed):
	case errors.Is(err, lock.ErrNotHolder), errors.Is(err, lock.ErrInUse), errors.Is(err, lock.ErrDeleting),
		errors.Is(err, lock.ErrUpdating), errors.Is(err, lock.ErrLockHeld):
	default:
		return false
	}
	return true
}

// relistCounter counts a backend's watches compacted past (each is
// followed by a list of the state: watch.go follow).
type relistCounter struct {
	slog.Handler
	n *atomic.Int64
}

func (h relistCounter) Handle(ctx context.Context, r slog.Record) error {
	if strings.Contains(r.Message, "compacted past") {
		h.n.Add(1)
	}
	return nil
}

func (h relistCounter) Enabled(context.Context, slog.Level) bool { return true }
