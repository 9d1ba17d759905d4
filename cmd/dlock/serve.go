package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/dlock/dlock/internal/datadir"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/memory"
	"github.com/dlock/dlock/refcount"
	"github.com/dlock/dlock/server"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// connConfig bounds client connections (docs/API.md, limits).
type connConfig struct {
	max      int // 0: from the fd limit (defaultMaxConns)
	read     time.Duration
	write    time.Duration
	shutdown time.Duration
	ping     time.Duration // --ping-interval
	deadPeer time.Duration // --dead-peer-timeout
}

// serveConfig is everything `dlock serve` can be told.
type serveConfig struct {
	listen   string
	rules    lock.Rules
	shards   int    // the memory engine's (docs/DESIGN.md, "The memory engine")
	backend  string // memory or etcd
	etcd     etcdConfig
	refcount string
	dataDir  string
	logLevel slog.Level
	debug    string // pprof listen address, "" for none
	// eventLoop serves plain-TCP keep-alive connections from one epoll
	// set (docs/DESIGN.md, "The fast path"); never with refcount=server.
	eventLoop bool
	conns     connConfig
	creds     credConfig
	// ready, when set, receives the bound address once the server accepts.
	ready func(net.Addr)
	// reload, when set, replaces SIGHUP as the signal to re-read the
	// credentials (tests).
	reload <-chan os.Signal
}

// useEventLoop reports whether the server takes the event loop. It answers
// requests inline; with refcount=server an /unlock may wait for its
// references to reach the disk, and every connection of the loop with it.
// The etcd backend's calls wait on etcd, so it never takes the loop either.
func (c serveConfig) useEventLoop() bool {
	return c.eventLoop && c.refcount != "server" && c.backend == "memory"
}

func defaultDataDir() string {
	if os.Geteuid() == 0 {
		return "/var/lib/dlock"
	}
	if d := os.Getenv("XDG_STATE_HOME"); d != "" {
		return filepath.Join(d, "dlock")
	}
	if h, err := os.UserHomeDir(); err == nil {
		return filepath.Join(h, ".local", "state", "dlock")
	}
	return "dlock-state"
}

// serveFlags defines dlock serve's flags on fs, bound to the returned
// config.
func serveFlags(fs *pflag.FlagSet) *serveConfig {
	c := &serveConfig{rules: lock.DefaultRules(), shards: memory.DefaultConfig().Shards}
	fs.StringVar(&c.listen, "listen", "127.0.0.1:7380", "address to listen on")
	fs.StringVar(&c.backend, "backend", "memory", "where lock state lives: memory (this process) or etcd (an etcd cluster that any number of dlock servers share)")
	c.etcd.flags(fs)
	fs.IntVar(&c.shards, "shards", c.shards, "number of lock-manager shards")
	fs.BoolVar(&c.rules.AllowMultiNodeDownload, "allow-multi-node-download", c.rules.AllowMultiNodeDownload, "queue nodes that ask for a held lock (false: refuse them with 409 lock_held)")
	fs.BoolVar(&c.rules.UpdateRequiresNoRef, "update-requires-no-ref", false, "refuse updates of referenced resources (refcount=server)")
	fs.StringVar(&c.refcount, "refcount", "off", "reference counting: off or server")
	fs.DurationVar(&c.rules.CompletedRetention, "completed-retention", c.rules.CompletedRetention, "how long completion records are kept")
	fs.DurationVar(&c.rules.SessionGrace, "session-grace", c.rules.SessionGrace, "how long a session outlives its last event stream")
	fs.DurationVar(&c.rules.LockTTL, "lock-ttl", c.rules.LockTTL, "life of a ttl-leased hold or queue entry after its last renewal")
	fs.DurationVar(&c.rules.ClaimTimeout, "claim-timeout", c.rules.ClaimTimeout, "time a hand-off grant waits for the new holder's /lock (0: off)")
	fs.DurationVar(&c.rules.MaxHold, "max-hold", 0, "longest any grant may be held (0: unlimited)")
	fs.DurationVar(&c.rules.LockDelay, "lock-delay", 0, "how long a key stays reserved after a hold's lease ran out (ttl expired, session lost) before it is handed on: a margin for a holder that may still be running (0: off)")
	fs.IntVar(&c.rules.CompletedMax, "completed-max", c.rules.CompletedMax, "most completion records kept")
	fs.IntVar(&c.rules.MaxSessions, "max-sessions", c.rules.MaxSessions, "most sessions, streaming or in grace (429 too_many_sessions beyond; 0: no limit)")
	fs.IntVar(&c.rules.MaxSessionsPerNode, "max-sessions-per-node", c.rules.MaxSessionsPerNode, "most open event streams of one node id (429 too_many_sessions beyond; 0: no limit)")
	fs.IntVar(&c.rules.MaxQueue, "max-queue", c.rules.MaxQueue, "most waiters of one key (429 queue_full beyond; 0: no limit)")
	fs.IntVar(&c.rules.MaxWatchers, "max-watchers", c.rules.MaxWatchers, "most streams that watch without a session: key observers and /ui/events (429 too_many_watchers beyond; 0: no limit)")
	fs.IntVar(&c.rules.MaxKeys, "max-keys", c.rules.MaxKeys, "most keys with state: held, queued or with a completion record (503 too_many_keys beyond; 0: no limit)")
	fs.IntVar(&c.rules.SessionLogBytes, "session-log-bytes", c.rules.SessionLogBytes, "bytes of recent events a session keeps for a reconnect's replay")
	fs.StringVar(&c.dataDir, "data-dir", defaultDataDir(), "directory of durable state, one server each: the token ceiling, and references with refcount=server (\"\": none; tokens then rest on the wall clock)")
	fs.TextVar(&c.logLevel, "log-level", slog.LevelInfo, "log level: debug, info, warn or error")
	fs.StringVar(&c.debug, "debug-listen", "", "serve Go's pprof profiles on this address (e.g. 127.0.0.1:6060); off by default")
	fs.BoolVar(&c.eventLoop, "event-loop", true, "answer plain-TCP keep-alive connections' requests from one event loop (epoll) instead of a goroutine each; always off with --refcount=server, whose unlocks may wait for the disk, and on etcd (off, the loop still holds new connections until their first request)")
	fs.IntVar(&c.conns.max, "max-conns", 0, fmt.Sprintf("most open client connections; past it a new one is answered 503 overloaded (0: the open-file limit minus %d, at most %d)", connsReserve, maxConnsCap))
	fs.DurationVar(&c.conns.read, "read-timeout", server.DefaultReadTimeout, "time a request's headers and body have to arrive")
	fs.DurationVar(&c.conns.write, "write-timeout", server.DefaultWriteTimeout, "longest a write (an answer or an event) waits for a client that does not read")
	fs.StringVar(&c.creds.tokenFile, "token-file", "", "file of bearer tokens, lines \"TOKEN NODE_ID\" (NODE_ID * for an operator); every request but /healthz then needs one (re-read on SIGHUP)")
	fs.StringVar(&c.creds.tlsCert, "tls-cert", "", "serve HTTPS only, with this certificate chain (PEM; re-read on SIGHUP)")
	fs.StringVar(&c.creds.tlsKey, "tls-key", "", "the private key (PEM) of --tls-cert")
	fs.StringVar(&c.creds.clientCA, "client-ca", "", "CA certificates (PEM) that sign client certificates: every request but /healthz then needs one, and acts only as a node it names (CN or DNS SAN; re-read on SIGHUP)")
	fs.DurationVar(&c.conns.ping, "ping-interval", server.DefaultPingInterval, "longest an event stream stays silent: a ping is sent when nothing else was; clients leave a stream silent for twice it")
	fs.DurationVar(&c.conns.deadPeer, "dead-peer-timeout", server.DefaultDeadPeer, "a connection whose sent data stays unacknowledged this long is dropped (TCP_USER_TIMEOUT): a node that vanished is noticed within --ping-interval plus this")
	fs.DurationVar(&c.conns.shutdown, "shutdown-timeout", 10*time.Second, "longest a shutdown waits for requests in progress before it closes every connection")
	return c
}

// check validates the flags, the environment applied.
func (c *serveConfig) check() error {
	if c.refcount != "off" && c.refcount != "server" {
		return fmt.Errorf("--refcount must be off or server, not %q", c.refcount)
	}
	switch c.backend {
	case "memory":
		if c.etcd.set() {
			return errors.New("the --etcd-… flags need --backend etcd")
		}
		if c.refcount == "server" && c.dataDir == "" {
			return errors.New("--refcount=server needs a --data-dir")
		}
	case "etcd":
		if err := c.etcd.validate(); err != nil {
			return err
		}
	default:
		return fmt.Errorf("--backend must be memory or etcd, not %q", c.backend)
	}
	if c.rules.UpdateRequiresNoRef && c.refcount != "server" {
		return errors.New("--update-requires-no-ref needs --refcount=server")
	}
	if c.conns.max < 0 || c.conns.read <= 0 || c.conns.write <= 0 || c.conns.shutdown <= 0 {
		return errors.New("--max-conns must not be negative, and --read-timeout, --write-timeout and --shutdown-timeout must be positive")
	}
	if c.conns.ping < 10*time.Millisecond || c.conns.deadPeer < 100*time.Millisecond {
		return fmt.Errorf("--ping-interval must be at least 10ms and --dead-peer-timeout at least 100ms, not %v and %v", c.conns.ping, c.conns.deadPeer)
	}
	if err := c.creds.validate(); err != nil {
		return err
	}
	if err := (memory.Config{Rules: c.rules, Shards: c.shards}).Validate(); err != nil {
		return err
	}
	if _, _, err := net.SplitHostPort(c.listen); err != nil {
		return fmt.Errorf("--listen %q: %v", c.listen, err)
	}
	return nil
}

func (e *cli) serveCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "serve [flags]",
		Short: "Run the lock server",
		Long: `serve runs the dlock server: the HTTP API of docs/API.md on --listen, with its
lock state in this process (--backend memory) or in an etcd cluster that
several servers share (--backend etcd; docs/HA.md).
--token-file, --tls-cert and --client-ca turn on identities
(docs/SECURITY.md); SIGHUP re-reads them. SIGINT or SIGTERM stops it,
finishing the requests in progress (--shutdown-timeout).`,
		Example: `  dlock serve --listen 127.0.0.1:7380
  dlock serve --listen :7380 --token-file /etc/dlock/tokens --tls-cert tls.crt --tls-key tls.key
  DLOCK_BACKEND=etcd DLOCK_ETCD_ENDPOINTS=http://127.0.0.1:2379 dlock serve`,
		Args: noArgs,
	}
	c := serveFlags(cmd.Flags())
	cmd.RunE = e.action(func(cmd *cobra.Command, _ []string) error {
		// SIGHUP is caught from here to the process's end: one that
		// comes while the server starts (a rotation script, systemctl
		// reload) is a reload once it has started, and one during
		// shutdown is nothing. Left to Go's default it would end the
		// process.
		hup := make(chan os.Signal, 1)
		signal.Notify(hup, syscall.SIGHUP)
		if err := c.check(); err != nil {
			return usageError{err}
		}
		if c.reload == nil {
			c.reload = hup
		}
		ctx, stop := signal.NotifyContext(e.ctx, syscall.SIGINT, syscall.SIGTERM)
		defer stop()
		return runServer(ctx, *c, e.stderr)
	})
	return cmd
}

func runServer(ctx context.Context, c serveConfig, stderr io.Writer) error {
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: c.logLevel}))
	mem := memory.Config{Rules: c.rules, Shards: c.shards, Logger: log}
	if c.backend == "etcd" {
		// Tokens and references live in etcd: no data dir is opened.
		c.dataDir = ""
	}
	if c.dataDir != "" {
		dir, err := datadir.Open(c.dataDir)
		if err != nil {
			return err
		}
		defer dir.Close()
		mem.TokenCeiling = dir.TokenCeiling()
	}
	if c.refcount == "server" && c.backend == "memory" {
		path := filepath.Join(c.dataDir, "refcount.db")
		store, err := refcount.OpenServerStore(path)
		if err != nil {
			return err
		}
		defer store.Close()
		mem.RefStore = store
	}
	m, closeBackend, err := openBackend(ctx, c, mem, log)
	if err != nil {
		return err
	}
	defer closeBackend()
	fdLimit, err := raiseFileLimit()
	if err != nil {
		log.Warn("open-file limit", "err", err)
	}
	if c.conns.max == 0 {
		c.conns.max = defaultMaxConns(fdLimit)
	}
	tokens, certs, err := c.creds.load(log)
	if err != nil {
		return err
	}
	srv := server.New(m, server.Options{Logger: log, PingInterval: c.conns.ping, MaxConns: c.conns.max, ReadTimeout: c.conns.read, WriteTimeout: c.conns.write, Tokens: tokens, TLS: certs, EventLoop: c.useEventLoop()})
	stopReload := reloadOn(c.reload, srv, log)
	defer stopReload()
	ln, err := server.Listen(ctx, c.listen, c.conns.ping, c.conns.deadPeer)
	if err != nil {
		return err
	}
	hs := &http.Server{ // read and write timeouts: from the Options, by Serve
		Handler:     srv,
		IdleTimeout: 2 * time.Minute,
		ErrorLog:    slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	attrs := []any{"addr", ln.Addr().String(), "epoch", m.Info().Epoch, "backend", c.backend}
	if c.backend == "memory" {
		attrs = append(attrs, "shards", c.shards) // the etcd engine has none
	}
	log.Info("dlock serving", append(attrs, "refcount", c.refcount, "multi_node_download", c.rules.AllowMultiNodeDownload,
		"max_conns", c.conns.max, "fd_limit", fdLimit, "data_dir", c.dataDir,
		"tls", certs != nil, "client_ca", c.creds.clientCA != "", "token_file", c.creds.tokenFile)...)
	if c.ready != nil {
		c.ready(ln.Addr())
	}
	if c.debug != "" {
		dbg, addr, err := startDebug(c.debug)
		if err != nil {
			return err
		}
		defer dbg.Close()
		// The address taken, not the one asked for: a port of 0 names none.
		log.Info("pprof profiles served", "addr", addr)
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln, hs) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	defer func() { <-errc }()
	log.Info("shutting down: closing event streams, finishing requests", "timeout", c.conns.shutdown)
	sctx, cancel := context.WithTimeout(context.Background(), c.conns.shutdown)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		// Every connection is closed all the same: the server stops.
		log.Warn("shutdown timed out", "err", err)
	}
	log.Info("stopped")
	return nil
}

// startDebug serves net/http/pprof on its own listener and mux, never on
// the API's, and returns the address it listens on.
func startDebug(addr string) (*http.Server, net.Addr, error) {
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, nil, fmt.Errorf("--debug-listen: %w", err)
	}
	s := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go s.Serve(ln)
	return s, ln.Addr(), nil
}
