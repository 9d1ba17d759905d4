// Package dlocktest runs a real dlock server on 127.0.0.1 for tests, which
// can restart it on the same address (a new epoch) and keep its durable
// references across the restart.
package dlocktest

import (
	"context"
	"net"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/refcount"
	"github.com/dlock/dlock/server"
)

// Server is a dlock server for one test.
type Server struct {
	t       testing.TB
	Addr    string
	cfg     func(*lock.Config)
	dataDir string

	M     *lock.Memory
	srv   *server.Server
	hs    *http.Server
	store *refcount.ServerStore
	done  chan struct{}
}

// Options of Start.
type Options struct {
	// Config changes the lock manager's defaults.
	Config func(*lock.Config)
	// RefCount turns on server-side reference counting, durable in a
	// bbolt file that survives Restart.
	RefCount bool
}

// Start runs a server until the test ends.
func Start(t testing.TB, opts Options) *Server {
	t.Helper()
	s := &Server{t: t, cfg: opts.Config}
	if opts.RefCount {
		s.dataDir = t.TempDir()
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s.Addr = ln.Addr().String()
	s.serve(ln)
	t.Cleanup(s.Stop)
	return s
}

// URL is the server's base URL.
func (s *Server) URL() string { return "http://" + s.Addr }

func (s *Server) serve(ln net.Listener) {
	cfg := lock.DefaultConfig()
	if s.cfg != nil {
		s.cfg(&cfg)
	}
	if s.dataDir != "" {
		store, err := refcount.OpenServerStore(filepath.Join(s.dataDir, "refcount.db"))
		if err != nil {
			s.t.Fatal(err)
		}
		s.store = store
		cfg.RefStore = store
	}
	m, err := lock.NewMemory(context.Background(), cfg)
	if err != nil {
		s.t.Fatal(err)
	}
	s.M = m
	s.srv = server.New(m, server.Options{PingInterval: 200 * time.Millisecond})
	s.hs = &http.Server{Handler: s.srv}
	s.done = make(chan struct{})
	srv, hs := s.srv, s.hs
	go func() {
		defer close(s.done)
		srv.Serve(ln, hs)
	}()
}

// Stop ends the server (and its event streams).
func (s *Server) Stop() {
	if s.M == nil {
		return
	}
	s.srv.Drain()
	s.srv.Close()
	s.hs.Close()
	<-s.done
	s.M.Close()
	if s.store != nil {
		s.store.Close()
	}
	s.M = nil
}

// Restart replaces the server by a new one on the same address: a new
// epoch, every hold and session forgotten, references kept.
func (s *Server) Restart() {
	s.Stop()
	var ln net.Listener
	var err error
	for range 100 {
		if ln, err = net.Listen("tcp", s.Addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		s.t.Fatal(err)
	}
	s.serve(ln)
}
