// Package etcdtest runs real etcd servers on 127.0.0.1 for tests: an
// embedded etcd in the test binary (StartEmbedded, or Shared for one server
// per test binary, stopped by the TestMain wrapper M), and a cluster of
// Debian's etcd binary as separate processes that a test can kill and
// restart member by member (StartCluster). Tests that share a server keep
// apart by a key prefix of their own (Prefix).
//
// Only test code imports this package.
package etcdtest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"google.golang.org/grpc"
)

// StartTimeout bounds how long a server or cluster may take to become ready.
const StartTimeout = 60 * time.Second

// Options of StartEmbeddedWith; the zero value is StartEmbedded's server.
type Options struct {
	// Dir is the data directory; empty means one in a new tb.TempDir().
	Dir string
	// AutoCompactionMode and AutoCompactionRetention are embed.Config's
	// ("revision" and "100", say); empty retention means no automatic
	// compaction, the default.
	AutoCompactionMode      string
	AutoCompactionRetention string
	// Config changes anything else in the configuration, last.
	Config func(*embed.Config)
}

// Server is an embedded one-member etcd on 127.0.0.1.
type Server struct {
	etcd      *embed.Etcd
	endpoints []string
	logPath   string
	log       *os.File

	mu      sync.Mutex
	clients []*clientv3.Client
	closed  bool
}

// StartEmbedded starts an embedded etcd with its data in tb.TempDir(); it is
// closed at tb's cleanup.
func StartEmbedded(tb testing.TB) *Server {
	tb.Helper()
	return StartEmbeddedWith(tb, Options{})
}

// StartEmbeddedWith is StartEmbedded with options.
func StartEmbeddedWith(tb testing.TB, o Options) *Server {
	tb.Helper()
	if o.Dir == "" {
		// A directory etcd makes itself, with the 0700 it wants.
		o.Dir = filepath.Join(tb.TempDir(), "data")
	}
	logPath := filepath.Join(tb.TempDir(), "etcd.log")
	s, err := startEmbedded(o, logPath)
	if err != nil {
		tb.Fatalf("etcdtest: %v\n%s", err, tail(logPath))
	}
	tb.Cleanup(func() {
		s.Close()
		if tb.Failed() {
			tb.Logf("etcdtest: the embedded server's log:\n%s", tail(logPath))
		}
	})
	return s
}

// loopback is 127.0.0.1 with port 0: the kernel picks a free port when
// embed listens, and the server reads the bound address back.
var loopback = url.URL{Scheme: "http", Host: "127.0.0.1:0"}

// startEmbedded starts a server that logs warnings and errors to logPath.
func startEmbedded(o Options, logPath string) (*Server, error) {
	start := time.Now()
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cfg := embed.NewConfig()
	cfg.Name = "etcdtest"
	cfg.Dir = o.Dir
	// Port 0 for both: one member needs no peer to reach it, and clients
	// take the listener's bound address (Endpoints). The advertised URLs
	// keep the :0, so a client must not sync its endpoints from the
	// member list (clientv3's AutoSyncInterval is off by default).
	cfg.ListenClientUrls = []url.URL{loopback}
	cfg.AdvertiseClientUrls = []url.URL{loopback}
	cfg.ListenPeerUrls = []url.URL{loopback}
	cfg.AdvertisePeerUrls = []url.URL{loopback}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.InitialClusterToken = "etcdtest-" + randomHex(8)
	// Tests do not survive a power cut; fsync only slows them.
	cfg.UnsafeNoFsync = true
	cfg.AutoCompactionMode = embed.CompactorModePeriodic
	cfg.AutoCompactionRetention = "0"
	if o.AutoCompactionRetention != "" {
		cfg.AutoCompactionMode = o.AutoCompactionMode
		cfg.AutoCompactionRetention = o.AutoCompactionRetention
	}
	// No purging of old snapshot and WAL files: etcd reads their
	// directories every 30 s and exits the process (zap's Fatal, into
	// this server's log file: a test binary that ends with "exit status
	// 1" and nothing else) when a read fails, and tests of this process
	// take every free descriptor for a moment (server's
	// TestHubPollAttackNoDescriptorForSlowWrite). A test's etcd lives
	// too short to need the purge.
	cfg.MaxSnapFiles = 0
	cfg.MaxWalFiles = 0
	// No HTTP/JSON gateway: tests speak gRPC through clientv3, and the
	// gateway is a gRPC client inside the server that nothing here uses.
	cfg.EnableGRPCGateway = false
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(fileLogger(logFile))
	if o.Config != nil {
		o.Config(cfg)
	}
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		logFile.Close()
		return nil, fmt.Errorf("start embedded etcd in %s: %w", o.Dir, err)
	}
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		e.Close()
		logFile.Close()
		return nil, fmt.Errorf("embedded etcd failed while starting: %v", err)
	case <-time.After(StartTimeout):
		e.Server.Stop()
		e.Close()
		logFile.Close()
		return nil, fmt.Errorf("embedded etcd not ready after %v", time.Since(start))
	}
	s := &Server{etcd: e, logPath: logPath, log: logFile}
	for _, l := range e.Clients {
		s.endpoints = append(s.endpoints, "http://"+l.Addr().String())
	}
	return s, nil
}

// fileLogger logs warnings and errors to f as JSON lines. (A server's
// normal shutdown logs errors too: "use of closed network connection".)
func fileLogger(f *os.File) *zap.Logger {
	enc := zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig())
	return zap.New(zapcore.NewCore(enc, zapcore.Lock(f), zapcore.WarnLevel))
}

// LogPath is the file the server logs its warnings and errors to.
func (s *Server) LogPath() string { return s.logPath }

// Endpoints are the client URLs, http://127.0.0.1:PORT.
func (s *Server) Endpoints() []string { return append([]string(nil), s.endpoints...) }

// Etcd is the embedded server itself, for what this type does not offer.
func (s *Server) Etcd() *embed.Etcd { return s.etcd }

// Client connects a new client to the server, dialled with opts too (a
// test's interceptors, which hold back, count or change its calls); it is
// closed at tb's cleanup or when the server closes, whichever is first.
func (s *Server) Client(tb testing.TB, opts ...grpc.DialOption) *clientv3.Client {
	tb.Helper()
	c, err := newClient(s.endpoints, opts...)
	if err != nil {
		tb.Fatalf("etcdtest: %v", err)
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		c.Close()
		tb.Fatalf("etcdtest: Client of a closed server")
	}
	s.clients = append(s.clients, c)
	s.mu.Unlock()
	tb.Cleanup(func() { c.Close() })
	return c
}

// Close closes the server's clients and then the server; later calls do
// nothing.
func (s *Server) Close() {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.closed = true
	clients := s.clients
	s.clients = nil
	s.mu.Unlock()
	for _, c := range clients {
		c.Close() // a second Close of a client is harmless
	}
	s.etcd.Close()
	<-s.etcd.Server.StopNotify()
	s.log.Close()
}

// newClient is a client of endpoints, dialled with opts, that logs
// nothing.
func newClient(endpoints []string, opts ...grpc.DialOption) (*clientv3.Client, error) {
	c, err := clientv3.New(clientv3.Config{
		Endpoints:   endpoints,
		DialTimeout: 5 * time.Second,
		// The client's retries and reconnections are the test's business.
		Logger:      zap.NewNop(),
		DialOptions: opts,
	})
	if err != nil {
		return nil, fmt.Errorf("client of %v: %w", endpoints, err)
	}
	return c, nil
}

// Prefix is a fresh key prefix, "/dlock-test-<16 hex digits>/", so that
// tests sharing a server do not see each other's keys.
func Prefix(tb testing.TB) string {
	tb.Helper()
	return "/dlock-test-" + randomHex(8) + "/"
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b) // never fails (crypto/rand)
	return hex.EncodeToString(b)
}

// linearizableGet is one linearizable read of key through c.
func linearizableGet(ctx context.Context, c *clientv3.Client, key string) error {
	_, err := c.Get(ctx, key)
	return err
}

// tail is the end of the file at path, for a failure's message.
func tail(path string) string {
	const max = 8 << 10
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	if len(b) > max {
		b = b[len(b)-max:]
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			b = b[i+1:]
		}
		return fmt.Sprintf("(the last %d bytes of %s)\n%s", len(b), path, b)
	}
	return fmt.Sprintf("(%s)\n%s", path, b)
}
