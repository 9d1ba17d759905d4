package etcdtest

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

// The test binary's shared server: started by the first Shared, stopped by
// StopShared (which M's Run calls after the tests).
var shared struct {
	mu      sync.Mutex
	managed bool // M wraps the binary's tests, so someone stops the server
	server  *Server
	dir     string
	err     error
}

// M wraps a TestMain's m so that its Run, after the tests, stops the shared
// server that Shared started, if any. With goleak:
//
//	func TestMain(m *testing.M) {
//		goleak.VerifyTestMain(etcdtest.M(m), etcdtest.GoleakOptions()...)
//	}
func M(m *testing.M) interface{ Run() int } {
	shared.mu.Lock()
	shared.managed = true
	shared.mu.Unlock()
	return runner{m}
}

type runner struct{ m *testing.M }

func (r runner) Run() int {
	code := r.m.Run()
	if err := StopShared(); err != nil {
		fmt.Fprintln(os.Stderr, "etcdtest:", err)
		if code == 0 {
			code = 1
		}
	}
	return code
}

// Shared is the test binary's one embedded server, started on first use
// with its data in a temporary directory; tests keep apart with Prefix. The
// package's TestMain must run its tests through M, else Shared fails the
// test: nothing would stop the server.
func Shared(tb testing.TB) *Server {
	tb.Helper()
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if !shared.managed {
		tb.Fatal("etcdtest.Shared: the package's TestMain must run its tests through etcdtest.M(m), which stops the shared server at the end")
	}
	if shared.server == nil && shared.err == nil {
		shared.dir, shared.err = os.MkdirTemp("", "etcdtest-shared-")
		if shared.err == nil {
			logPath := filepath.Join(shared.dir, "etcd.log")
			shared.server, shared.err = startEmbedded(Options{Dir: filepath.Join(shared.dir, "data")}, logPath)
			if shared.err != nil {
				shared.err = fmt.Errorf("%w\n%s", shared.err, tail(logPath))
			}
			if shared.err != nil {
				os.RemoveAll(shared.dir)
			}
		}
	}
	if shared.err != nil {
		tb.Fatalf("etcdtest: the shared server: %v", shared.err)
	}
	return shared.server
}

// StopShared stops the shared server, if Shared started one, and removes
// its data. M's Run calls it after the tests; Shared fails after it.
func StopShared() error {
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if shared.server == nil {
		return nil
	}
	shared.server.Close()
	shared.server = nil
	shared.err = fmt.Errorf("StopShared stopped it already")
	return os.RemoveAll(shared.dir)
}
