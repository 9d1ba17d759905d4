// Package dlocktest runs a real dlock server for a test: the server of
// `dlock serve` over the in-memory backend, on 127.0.0.1 or on in-memory
// connections inside a testing/synctest bubble. A test can restart it (a new
// epoch; durable references kept), wait for the state it needs
// (WaitQueued), and act on its connections through kit.Hooks: kill them,
// stall or refuse a node's session stream.
package dlocktest

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/refcount"
	"github.com/dlock/dlock/server"
)

// Options of Start; the zero value is a default server on 127.0.0.1.
type Options struct {
	// Config changes the lock manager's defaults.
	Config func(*lock.Config)
	// Server changes the server's options. PingInterval is 200 ms unless
	// it sets another.
	Server func(*server.Options)
	// RefCount turns on server-side reference counting, durable in a
	// bbolt file that survives Restart.
	RefCount bool
	// InMemory serves over in-memory connections (net.Pipe) instead of
	// TCP, so that the server and its clients run inside a synctest bubble
	// in fake time. Clients must use HTTPClient; Start must be called
	// inside the bubble.
	InMemory bool
	// Wrap puts a handler in front of the server, to answer some requests
	// itself. The server is then served by net/http alone: its lean loop
	// answers hot requests without a handler.
	Wrap func(http.Handler) http.Handler
}

// Server is a dlock server for one test.
type Server struct {
	// Hooks act on the server's connections, across restarts.
	kit.Hooks
	// Addr is the server's host:port; a name only when InMemory.
	Addr string
	// Backend and Memory are the lock state (one value; Memory has Stats),
	// and Handler the HTTP server. Restart replaces them.
	Backend lock.Backend
	Memory  *lock.Memory
	Handler *server.Server

	t       testing.TB
	opts    Options
	dataDir string
	store   *refcount.ServerStore
	hs      *http.Server
	done    chan struct{}
	tr      *http.Transport

	mu   sync.Mutex
	pipe *kit.PipeListener // the listener Dial reaches, when InMemory
}

// Start runs a server until the test ends.
func Start(t testing.TB, opts Options) *Server {
	t.Helper()
	s := &Server{t: t, opts: opts}
	if opts.RefCount {
		s.dataDir = t.TempDir()
	}
	s.tr = &http.Transport{DialContext: s.Dial, MaxIdleConnsPerHost: 64}
	var ln net.Listener
	if opts.InMemory {
		s.Addr = "dlock.test:80"
		ln = s.newPipe()
	} else {
		var err error
		if ln, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
			t.Fatal(err)
		}
		s.Addr = ln.Addr().String()
	}
	s.serve(ln)
	t.Cleanup(func() {
		s.Stop()
		s.tr.CloseIdleConnections()
	})
	return s
}

// URL is the server's base URL.
func (s *Server) URL() string { return "http://" + s.Addr }

// HTTPClient returns a client of the server, the only way to reach it when
// InMemory. Its idle connections are closed when the test ends.
func (s *Server) HTTPClient() *http.Client { return &http.Client{Transport: s.tr} }

// Dial connects to the server, whatever addr says; it has
// http.Transport.DialContext's signature.
func (s *Server) Dial(ctx context.Context, network, _ string) (net.Conn, error) {
	if !s.opts.InMemory {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", s.Addr)
	}
	s.mu.Lock()
	p := s.pipe
	s.mu.Unlock()
	return p.Dial(ctx, network, s.Addr)
}

func (s *Server) newPipe() *kit.PipeListener {
	p := kit.NewPipeListener()
	s.mu.Lock()
	s.pipe = p
	s.mu.Unlock()
	return p
}

func (s *Server) serve(ln net.Listener) {
	cfg := lock.DefaultConfig()
	if s.opts.Config != nil {
		s.opts.Config(&cfg)
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
	so := server.Options{PingInterval: 200 * time.Millisecond}
	if s.opts.Server != nil {
		s.opts.Server(&so)
	}
	srv := server.New(m, so)
	s.Backend, s.Memory, s.Handler = m, m, srv
	s.hs = &http.Server{Handler: srv}
	ln = s.Listen(ln)
	s.done = make(chan struct{})
	hs, done := s.hs, s.done
	if s.opts.Wrap != nil {
		hs.Handler = s.opts.Wrap(srv)
		go func() {
			defer close(done)
			hs.Serve(ln)
		}()
		return
	}
	go func() {
		defer close(done)
		srv.Serve(ln, hs)
	}()
}

// Stop ends the server and its event streams, as dlock serve does at
// SIGTERM.
func (s *Server) Stop() {
	if s.Memory == nil {
		return
	}
	s.Handler.Drain()
	s.Handler.Close()
	s.hs.Close()
	<-s.done
	s.Memory.Close()
	if s.store != nil {
		s.store.Close()
	}
	s.Backend, s.Memory = nil, nil
}

// Restart replaces the server by a new one on the same address: a new
// epoch, every hold and session forgotten, references kept.
func (s *Server) Restart() {
	s.t.Helper()
	s.Stop()
	if s.opts.InMemory {
		s.serve(s.newPipe())
		return
	}
	var ln net.Listener
	// The port is free once the old listener is closed; the kernel may
	// take a moment to agree.
	kit.Await(s.t, "the server's port to be free again", func() error {
		var err error
		ln, err = net.Listen("tcp", s.Addr)
		return err
	})
	s.serve(ln)
}

// WaitQueued waits until n nodes wait in k's queue on the server: a
// barrier that puts what the test does next after its clients' requests,
// where a sleep would only make that likely. Call it from the test's
// goroutine.
func (s *Server) WaitQueued(t testing.TB, k lock.Key, n int) {
	t.Helper()
	kit.Await(t, fmt.Sprintf("%d waiters for %s", n, k), func() error {
		st, err := s.Backend.Status(context.Background(), k.Type, k.Resource, "")
		if err != nil {
			return err
		}
		if st.QueueLength != n {
			return fmt.Errorf("%d waiting behind %q", st.QueueLength, st.Holder)
		}
		return nil
	})
}
