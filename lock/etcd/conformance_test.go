package etcd_test

import (
	"sync"
	"testing"

	"go.uber.org/goleak"

	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/etcd"
	"github.com/dlock/dlock/lock/locktest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(etcdtest.M(m), etcdtest.GoleakOptions()...)
}

// TestConformance holds the etcd backend to the rules every backend
// follows (package locktest), on an embedded etcd. A restart within a test
// opens the same data set again (its prefix). The timer rules run on the
// wall clock and on etcd's lease clock, which a testing/synctest bubble
// cannot fake; timers_test.go checks them in real time.
func TestConformance(t *testing.T) {
	srv := etcdtest.Shared(t)
	var mu sync.Mutex
	prefixes := map[*testing.T]string{}
	locktest.Run(t, func(t *testing.T, cfg locktest.Config) lock.Backend {
		mu.Lock()
		p, ok := prefixes[t]
		if !ok {
			p = etcdtest.Prefix(t)
			prefixes[t] = p
		}
		mu.Unlock()
		cli := srv.Client(t)
		b, err := etcd.New(t.Context(), cli, etcd.Config{Rules: cfg.Rules, Prefix: p, RefCounting: cfg.RefCounting})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}, locktest.WithoutFakeTime("its timers follow the wall clock and etcd's lease TTLs, which run in the etcd server"))
}
