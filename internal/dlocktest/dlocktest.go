// Package dlocktest runs a real dlock server for a test: the server of
// `dlock serve` over the in-memory backend, on 127.0.0.1 or on in-memory
// connections inside a testing/synctest bubble. A test can restart it (a new
// epoch; durable references kept), wait for the state it needs
// (WaitQueued), and act on its connections through kit.Hooks: kill them,
// stall or refuse a node's session stream. With Options.Auth it checks
// identities as `dlock serve --token-file --tls-cert --tls-key
// --client-ca` does (docs/SECURITY.md); a test reads what the server saw
// in its metrics (Metric) and its accepted connections (Connections).
package dlocktest

import (
	"context"
	"crypto/tls"
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/auth"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/memory"
	"github.com/dlock/dlock/refcount"
	"github.com/dlock/dlock/server"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// Options of Start; the zero value is a default server on 127.0.0.1.
type Options struct {
	// Config changes the lock manager's defaults.
	Config func(*memory.Config)
	// Server changes the server's options. PingInterval is 200 ms unless
	// it sets another; Tokens and TLS are Auth's, loaded already.
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
	// Auth, when set, gives the server identities to check.
	Auth *Auth
	// Share, when set, serves Share's lock state instead of a new one:
	// servers of one lock service on one backend, as several servers on
	// one etcd are (docs/DESIGN.md, "The Backend seam"). They share the
	// epoch, the sessions and the event ids; Config and RefCount are
	// Share's. Any of them may stop or restart, in any order: the state
	// lives until the last one stops, and a server that restarts while
	// another runs serves it again.
	Share *Server
}

// state is the lock state of the servers that share it (Options.Share).
type state struct {
	mu      sync.Mutex
	m       *memory.Backend // nil while no server runs
	store   *refcount.ServerStore
	servers int // the servers running on m
}

// Auth is what `dlock serve` reads from --token-file, --tls-cert,
// --tls-key and --client-ca (docs/SECURITY.md). Start writes the files
// and the server loads them with the server's loaders, again at each
// Restart: the identities survive it.
//
// Over TLS the Hooks see encrypted bytes: KillAll and Connections work,
// the stream hooks (KillStreams, BlockStreams, RefuseStreams,
// StreamsOpened) see no stream.
type Auth struct {
	// PKI, when set, issues the server's certificate: the server speaks
	// HTTPS only, and URL is https://. Inside a synctest bubble, make it
	// in the bubble.
	PKI *PKI
	// ClientCA makes PKI's CA the client CA: every request but GET
	// /healthz needs a client certificate it signed, and may name only a
	// node the certificate names. A request without one is answered 401
	// (the handshake asks for a certificate but does not require one).
	ClientCA bool
	// Tokens, when set, is the token file: token → node, "*" for an
	// operator. A token has auth.MinTokenLen characters at least.
	Tokens map[string]string
}

// inMemoryHost is the host of an InMemory server, in its URL and its
// certificate.
const inMemoryHost = "dlock.test"

// authFiles are the files of an Auth, written once by Start.
type authFiles struct {
	tokens            string // the token file, "" without Tokens
	cert, key, client string // the server's certificate and key, the client CA
}

func (s *Server) writeAuth() {
	a := s.opts.Auth
	if a.ClientCA && a.PKI == nil {
		s.t.Fatal("dlocktest: Auth.ClientCA needs Auth.PKI: client certificates are checked in the TLS handshake")
	}
	if a.Tokens != nil {
		var b strings.Builder
		b.WriteString("# dlocktest: TOKEN NODE_ID\n")
		for _, tok := range slices.Sorted(maps.Keys(a.Tokens)) {
			fmt.Fprintf(&b, "%s %s\n", tok, a.Tokens[tok])
		}
		s.auth.tokens = filepath.Join(s.t.TempDir(), "tokens")
		if err := os.WriteFile(s.auth.tokens, []byte(b.String()), 0o600); err != nil {
			s.t.Fatal(err)
		}
	}
	if a.PKI != nil {
		// Files of its own: a test may issue PKI.ServerCert for itself.
		s.auth.cert, s.auth.key = a.PKI.ServerCert()
		if a.ClientCA {
			s.auth.client = a.PKI.CAFile
		}
	}
}

// loadAuth reads the Auth's files into so, as dlock serve does at start.
func (s *Server) loadAuth(so *server.Options) {
	if s.auth.tokens != "" {
		tk, err := auth.LoadTokens(s.auth.tokens)
		if err != nil {
			s.t.Fatal(err)
		}
		so.Tokens = tk
	}
	if s.auth.cert != "" {
		c, err := auth.LoadCerts(s.auth.cert, s.auth.key, s.auth.client)
		if err != nil {
			s.t.Fatal(err)
		}
		so.TLS = c
	}
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
	Memory  *memory.Backend
	Handler *server.Server

	t       testing.TB
	opts    Options
	dataDir string
	auth    authFiles
	state   *state
	hs      *http.Server
	done    chan struct{}
	tr      *http.Transport

	mu     sync.Mutex
	pipe   *kit.PipeListener    // the listener Dial reaches, when InMemory
	reg    *prometheus.Registry // the running server's metrics
	probes int                  // Connections' own connections
}

// Start runs a server until the test ends.
func Start(t testing.TB, opts Options) *Server {
	t.Helper()
	s := &Server{t: t, opts: opts, state: &state{}}
	if opts.Share != nil {
		if opts.RefCount || opts.Config != nil {
			t.Fatal("dlocktest: Options.Share serves another server's lock state: its Config and RefCount are Share's")
		}
		s.state = opts.Share.state
		s.opts.Config = opts.Share.opts.Config
	}
	if opts.RefCount {
		s.dataDir = t.TempDir()
	}
	if opts.Auth != nil {
		s.writeAuth()
	}
	s.tr = &http.Transport{DialContext: s.Dial, MaxIdleConnsPerHost: 64, TLSClientConfig: s.clientTLS()}
	var ln net.Listener
	if opts.InMemory {
		s.Addr = inMemoryHost + ":80"
		if s.https() {
			s.Addr = inMemoryHost + ":443"
		}
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

// https reports whether the server speaks HTTPS.
func (s *Server) https() bool { return s.opts.Auth != nil && s.opts.Auth.PKI != nil }

// clientTLS is what a client needs to trust the server; nil over HTTP.
func (s *Server) clientTLS() *tls.Config {
	if !s.https() {
		return nil
	}
	return &tls.Config{RootCAs: s.opts.Auth.PKI.Pool, MinVersion: tls.VersionTLS12}
}

// URL is the server's base URL: https:// when it speaks HTTPS.
func (s *Server) URL() string {
	if s.https() {
		return "https://" + s.Addr
	}
	return "http://" + s.Addr
}

// HTTPClient returns a client of the server, the only way to reach it when
// InMemory. Over HTTPS it trusts the PKI's CA and shows no client
// certificate. Its idle connections are closed when the test ends.
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
	cfg := memory.DefaultConfig()
	if s.opts.Config != nil {
		s.opts.Config(&cfg)
	}
	st := s.state
	st.mu.Lock()
	if st.m == nil {
		if s.dataDir != "" {
			store, err := refcount.OpenServerStore(filepath.Join(s.dataDir, "refcount.db"))
			if err != nil {
				st.mu.Unlock()
				s.t.Fatal(err)
			}
			st.store = store
			cfg.RefStore = store
		}
		m, err := memory.New(context.Background(), cfg)
		if err != nil {
			st.mu.Unlock()
			s.t.Fatal(err)
		}
		st.m = m
	}
	if st.store != nil {
		cfg.RefStore = st.store
	}
	st.servers++
	m := st.m
	st.mu.Unlock()
	// The event loop as dlock serve has it: on unless references are
	// saved to disk inside the calls it would make.
	so := server.Options{PingInterval: 200 * time.Millisecond, EventLoop: cfg.RefStore == nil}
	s.loadAuth(&so)
	if s.opts.Server != nil {
		s.opts.Server(&so)
	}
	if so.Registry == nil {
		// What server.New makes of a nil Registry, kept for Metric.
		so.Registry = prometheus.NewRegistry()
		so.Registry.MustRegister(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), collectors.NewGoCollector())
	}
	srv := server.New(m, so)
	s.Backend, s.Memory, s.Handler = m, m, srv
	s.mu.Lock()
	s.reg = so.Registry
	s.mu.Unlock()
	s.hs = &http.Server{Handler: srv}
	ln = s.Listen(ln)
	s.done = make(chan struct{})
	hs, done := s.hs, s.done
	if s.opts.Wrap != nil {
		hs.Handler = s.opts.Wrap(srv)
		if so.TLS != nil {
			// Serve would take the TLS handshake itself.
			ln = tls.NewListener(ln, so.TLS.Config())
		}
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
	st := s.state
	st.mu.Lock()
	if st.servers--; st.servers == 0 {
		st.m.Close()
		if st.store != nil {
			st.store.Close()
		}
		st.m, st.store = nil, nil
	}
	st.mu.Unlock()
	s.Backend, s.Memory = nil, nil
}

// Restart replaces the server by a new one on the same address: a new
// epoch, every hold and session forgotten, references kept, and the
// identities of Options.Auth too (the new server reads the same files).
// A server whose state another running server shares (Options.Share)
// comes back on that state instead: one server of a lock service restarts.
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

// Metric reads the running server's metric name (server/metrics.go and
// server/auth.go define them; GET /metrics serves them), summed over its series whose labels include labels, given as
// name, value pairs: a counter's or a gauge's value, a histogram's count
// of observations. So Metric("dlock_http_request_duration_seconds",
// "endpoint", "/lock") counts the /lock requests answered, and
// Metric("dlock_auth_refusals_total") every request refused by the
// identity checks. A name or labels the server has no series of fail the
// test, so that a typo cannot pass for a zero. Restart starts from zero.
func (s *Server) Metric(name string, labels ...string) float64 {
	s.t.Helper()
	if len(labels)%2 != 0 {
		s.t.Fatalf("dlocktest: Metric(%q): labels come in name, value pairs: %q", name, labels)
	}
	s.mu.Lock()
	reg := s.reg
	s.mu.Unlock()
	mfs, err := reg.Gather()
	if err != nil {
		s.t.Fatal(err)
	}
	var sum float64
	found := false
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for i := 0; i < len(labels); i += 2 {
				if v, ok := have[labels[i]]; !ok || v != labels[i+1] {
					continue series
				}
			}
			found = true
			switch {
			case m.GetCounter() != nil:
				sum += m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				sum += m.GetGauge().GetValue()
			case m.GetHistogram() != nil:
				sum += float64(m.GetHistogram().GetSampleCount())
			case m.GetUntyped() != nil:
				sum += m.GetUntyped().GetValue()
			}
		}
	}
	if !found {
		s.t.Fatalf("dlocktest: the server has no metric %s with labels %q", name, labels)
	}
	return sum
}

// Connections is how many connections clients have opened to the server
// since Start, across restarts: over TLS, each began with a handshake. A
// connection opened before the call is counted, accepted or not yet: it
// first opens one of its own and waits for the server's answer on it
// (the server accepts connections in the order they came), which it
// leaves out of the count.
func (s *Server) Connections() int {
	s.t.Helper()
	tr := &http.Transport{DialContext: s.Dial, DisableKeepAlives: true, TLSClientConfig: s.clientTLS()}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr}).Get(s.URL() + "/healthz")
	if err != nil {
		s.t.Fatalf("dlocktest: Connections: %v", err)
	}
	resp.Body.Close()
	s.mu.Lock()
	s.probes++
	probes := s.probes
	s.mu.Unlock()
	return s.Accepted() - probes
}

// RewriteAnswers is a Wrap (Options.Wrap) that lets the real server answer
// the requests to path and hands each answer's status and body to edit,
// which returns the body to send instead: a server that says what a sane
// one never would, for the tests that play against one.
func RewriteAnswers(path string, edit func(status int, body []byte) []byte) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != path {
				next.ServeHTTP(w, r)
				return
			}
			rec := httptest.NewRecorder()
			next.ServeHTTP(rec, r)
			body := edit(rec.Code, rec.Body.Bytes())
			for k, v := range rec.Header() {
				w.Header()[k] = v
			}
			w.Header().Del("Content-Length")
			w.WriteHeader(rec.Code)
			w.Write(body)
		})
	}
}
