// Package server is dlock's HTTP + JSON API with Server-Sent Events for
// waiters (docs/API.md). It holds no lock state: every request is one call into
// the lock manager.
package server

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/internal/auth"
	"github.com/dlock/dlock/lock"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Options configures a Server.
type Options struct {
	// Logger for request errors and stream events; nil discards.
	Logger *slog.Logger
	// Registry receives the server's metrics; nil creates a private one.
	Registry *prometheus.Registry
	// PingInterval is the longest an event stream stays silent; zero means
	// DefaultPingInterval, or the backend's lock TTL / 4 if that is less.
	// Clients learn it from the stream's Dlock-Ping-Ms header and leave a
	// stream silent past twice it for another server; a peer that
	// vanished is noticed within it plus Listen's deadPeer.
	PingInterval time.Duration
	// MaxConns bounds the open client connections; past it a new one is
	// answered 503 overloaded and closed. Zero: no bound.
	MaxConns int
	// ReadTimeout is the time a request's headers and body have to arrive,
	// on every code path; zero means DefaultReadTimeout.
	ReadTimeout time.Duration
	// WriteTimeout is the longest a write to a client that does not read
	// may block: an answer, or an event on a stream. Zero means
	// DefaultWriteTimeout.
	WriteTimeout time.Duration
	// Tokens, when set, is the token file: every request but GET /healthz and /readyz
	// needs one of its bearer tokens, and may name only its token's node
	// (docs/SECURITY.md).
	Tokens *auth.Tokens
	// TLS, when set, makes Serve speak HTTPS only, with its certificates;
	// when it has a client CA, every request but GET /healthz and /readyz needs a
	// client certificate, and may name only a node the certificate names.
	TLS *auth.Certs
	// EventLoop serves plain-TCP connections between requests from event
	// loops that answer /lock, /unlock and /cancel themselves (poller.go),
	// for less CPU per request. Set it only for a backend whose TryLock,
	// Unlock and Cancel never wait, as memory.Backend without a RefStore:
	// one that waited would hold up every connection of its loop.
	// Without it, a listener of Listen still puts new connections in an
	// event loop (accept.go), which answers none of their requests.
	EventLoop bool
}

// Defaults of the Options' timeouts.
const (
	DefaultReadTimeout  = 10 * time.Second
	DefaultWriteTimeout = 10 * time.Second
	// DefaultPingInterval and DefaultDeadPeer (Listen) notice a peer
	// that vanished within 4 s, so that its session's grace starts then
	// (docs/DESIGN.md, "Leases"). A ping costs an idle stream 8 bytes
	// and about 14 µs of server CPU an interval: 10,000 idle streams at
	// 1 s, 13–14 % of one core and 80 kB/s (docs/BENCHMARKS.md).
	DefaultPingInterval = time.Second
	DefaultDeadPeer     = 3 * time.Second
)

// Server serves the dlock API for one lock backend.
type Server struct {
	b            lock.Backend
	info         lock.Info
	inspect      lock.Inspector // nil: no /ui (ui.go)
	log          *slog.Logger
	routes       map[string]*route
	metrics      *metrics
	ping         time.Duration
	readTimeout  time.Duration
	writeTimeout time.Duration
	maxConns     int
	epoch        []string
	overloaded   []byte // the answer to a connection over MaxConns
	draining     atomic.Bool

	// Identities (auth.go): guarded when tokens or mtls is on.
	tokens  *auth.Tokens
	certs   *auth.Certs
	mtls    bool
	guarded bool
	am      *authMetrics
	// certGen ends at every reload of the TLS files: the event streams
	// opened with a client certificate check it again then.
	certGen atomic.Pointer[generation]
	// sameOrigin refuses requests a browser sends for another site.
	sameOrigin *http.CrossOriginProtection
	// observers counts the key observer streams of each node credential.
	obsMu     sync.Mutex
	observers map[string]int
	// h2Peers holds the client certificate of an h2 connection from the
	// lean loop's handshake until net/http takes the connection.
	h2Peers sync.Map // *tls.Conn → *auth.Peer

	// drained is cancelled by Drain: every open event stream ends.
	drained     context.Context
	drain       context.CancelFunc
	openStreams sync.WaitGroup
	// hub writes the event streams of taken-over connections (hub.go).
	hub *hub

	// conns counts open client connections; refusing, the refused ones
	// still being answered.
	conns    atomic.Int64
	refusing atomic.Int64

	// The lean HTTP/1.1 loop's state (leanhttp.go, conns.go), guarded by
	// mu; closed is closed when closing is set.
	mu        sync.Mutex
	closing   atomic.Bool
	closed    chan struct{}
	listeners []net.Listener
	passes    []*passListener
	https     []*http.Server
	leanConns map[*leanConn]struct{}
	// forced is set when Shutdown's context ended and it closed the
	// lean connections unfinished: none is taken after it.
	forced bool
	// owing are the descriptors of connections an event loop could not
	// hand over, whose owed answers are written without a net.Conn
	// (poller.handTo): Shutdown's forced close reaches them through it.
	owing  map[int]struct{}
	leanWG sync.WaitGroup
	// leanWaiting are the lean goroutines waiting for a connection
	// (leanWorker), each by the channel startLean hands it one on;
	// leanWorkers counts the lean goroutines, waiting or not.
	leanMu      sync.Mutex
	leanWaiting []chan leanJob // guarded by leanMu; the last waited least
	leanWorkers atomic.Int32
	leanIdleFor time.Duration // how long one waits before it ends
	// The event loop's pollers (poller.go), started by the first
	// connection they take; guarded by mu.
	eventLoop  bool
	pollers    []*poller
	nextPoller int
}

// New returns a Server for b. The server holds no lock state: every rule is
// b's (docs/DESIGN.md).
func New(b lock.Backend, opts Options) *Server {
	info := b.Info()
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	reg := opts.Registry
	if reg == nil {
		reg = prometheus.NewRegistry()
		reg.MustRegister(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), collectors.NewGoCollector())
	}
	ping := opts.PingInterval
	if ping <= 0 {
		ping = min(DefaultPingInterval, info.LockTTL/4)
	}
	s := &Server{
		b:            b,
		info:         info,
		log:          log,
		routes:       make(map[string]*route),
		metrics:      newMetrics(reg, b),
		ping:         ping,
		readTimeout:  cmp.Or(opts.ReadTimeout, DefaultReadTimeout),
		writeTimeout: cmp.Or(opts.WriteTimeout, DefaultWriteTimeout),
		maxConns:     opts.MaxConns,
		epoch:        []string{info.Epoch},
		closed:       make(chan struct{}),
		leanIdleFor:  leanIdleTimeout,
		tokens:       opts.Tokens,
		certs:        opts.TLS,
		eventLoop:    opts.EventLoop,
	}
	s.mtls = s.certs != nil && s.certs.ClientAuth()
	s.guarded = s.tokens != nil || s.mtls
	if s.tokens != nil || s.certs != nil {
		s.am = newAuthMetrics(reg)
	}
	s.certGen.Store(newGeneration())
	s.sameOrigin = http.NewCrossOriginProtection()
	s.observers = make(map[string]int)
	s.drained, s.drain = context.WithCancel(context.Background())
	s.hub = newHub(s)
	s.overloaded = overloadedAnswer(info.Epoch)
	s.metrics.watchConns(reg, &s.conns)
	s.core("/lock", s.lockAnswer)
	s.core("/unlock", s.unlockAnswer)
	s.core("/cancel", s.cancelAnswer)
	s.route("/status", http.MethodGet, s.handleStatus)
	s.route("/subscribe", http.MethodGet, s.handleSubscribe)
	s.routes[streamPath].stream = s.leanStream // the lean loop's (parseHead)
	s.route("/lock/subscribe", http.MethodGet, s.handleSubscribe)
	s.route("/refcount", http.MethodGet, s.handleRefCount)
	s.route("/refcount/add", http.MethodPost, s.handleRefAdd)
	s.route("/refcount/release", http.MethodPost, s.handleRefRelease)
	s.route("/healthz", http.MethodGet, s.handleHealthz)
	s.route("/readyz", http.MethodGet, s.handleReadyz)
	s.routeUI()
	metricsHandler := promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
	s.route("/metrics", http.MethodGet, func(w http.ResponseWriter, r *http.Request) error {
		metricsHandler.ServeHTTP(w, r)
		return nil
	})
	s.setAccess()
	for p := range leanPaths {
		if rt := s.routes[p]; rt == nil || rt.core == nil || rt.method != http.MethodPost {
			panic("server: lean path " + p + " has no POST core")
		}
	}
	return s
}

// ServeHTTP serves a request net/http read.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	aw := &answerWriter{ResponseWriter: w, start: time.Now(), timeout: s.writeTimeout}
	defer func() {
		if p := recover(); p != nil {
			if p == http.ErrAbortHandler {
				panic(p)
			}
			s.panicked(p, r.RemoteAddr)
			if aw.began {
				// Part of an answer went out: only a close ends it.
				panic(http.ErrAbortHandler)
			}
			// The client gets an answer, and the connection closes after
			// it (docs/DESIGN.md, "When a server closes a connection").
			aw.Header().Set("Connection", "close")
			writeJSON(aw, http.StatusInternalServerError, panicBody)
		}
	}()
	aw.Header()[api.EpochHeader] = s.epoch // shared, never modified
	if s.closing.Load() {
		// The lean loops finish before http.Server.Shutdown starts, which
		// then closes this connection once idle: say so now, or the
		// client's next request meets the close (docs/DESIGN.md, "When a
		// server closes a connection").
		aw.Header().Set("Connection", "close")
	}
	rq := request{method: r.Method, path: r.URL.Path, w: aw, r: r}
	if s.mtls {
		rq.peer = peerOf(r)
	}
	s.serveRequest(&rq, nil)
}

// panicBody answers a request whose handling panicked.
var panicBody = api.ErrorBody{Error: "the server failed serving this request", Code: api.CodeInternal, Message: "the server failed serving this request; it was logged"}

// answerWriter is the ResponseWriter of a request net/http serves. Its
// write deadline runs from when the answer begins, not from when the
// request came: a backend call may wait on etcd for longer than the write
// timeout, and its answer must still go out (docs/DESIGN.md, "When a server
// closes a connection"). It also knows whether an answer began, for a
// panic's.
type answerWriter struct {
	http.ResponseWriter
	start   time.Time
	timeout time.Duration
	began   bool
}

// begin moves the write deadline when the handler took a while: net/http
// set it, from the end of the request's headers, before the handler ran.
func (w *answerWriter) begin() {
	if w.began {
		return
	}
	w.began = true
	if w.timeout > 0 && time.Since(w.start) > w.timeout/4 {
		_ = http.NewResponseController(w.ResponseWriter).SetWriteDeadline(time.Now().Add(w.timeout))
	}
}

func (w *answerWriter) WriteHeader(status int) {
	w.begin()
	w.ResponseWriter.WriteHeader(status)
}

func (w *answerWriter) Write(b []byte) (int, error) {
	w.begin()
	return w.ResponseWriter.Write(b)
}

// Hijack is the event streams' (sse.go): the connection is theirs.
func (w *answerWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	w.began = true
	return http.NewResponseController(w.ResponseWriter).Hijack()
}

// Unwrap lets http.ResponseController reach net/http's writer.
func (w *answerWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// request is what the entry point sees of a request, whichever loop read
// it: enough to route it, and to authenticate it once for both loops.
type request struct {
	method string
	path   string // without the query
	// Read by net/http: the answer is written to w.
	w http.ResponseWriter
	r *http.Request
	// Read by the lean loop: the answer is returned. head is the request
	// line and headers as parseHead took them (valid until the request is
	// answered), body the whole body.
	head []byte
	body []byte
	conn interface{ RemoteAddr() net.Addr }
	// peer is the client certificate, with mTLS.
	peer *auth.Peer
	// A /subscribe of the lean loop or an event loop: its raw query, and
	// the connection its event stream takes (leanStream), which took then
	// says.
	query string
	take  *streamConn
	took  bool
}

// streamConn is the connection an event stream the lean loop opens takes:
// conn, or from an event loop (poller.go) the socket fd alone.
type streamConn struct {
	conn net.Conn
	fd   int
}

// header returns the first value of the named header.
func (rq *request) header(name string) string {
	if rq.r != nil {
		return rq.r.Header.Get(name)
	}
	return string(leanHeader(rq.head, name))
}

// remoteAddr is the client's address, host:port.
func (rq *request) remoteAddr() string {
	if rq.r != nil {
		return rq.r.RemoteAddr
	}
	return addrOf(rq.conn.RemoteAddr())
}

// tlsState is the connection's TLS state, nil without TLS.
func (rq *request) tlsState() *tls.ConnectionState {
	if rq.r != nil {
		return rq.r.TLS
	}
	if tc, ok := rq.conn.(interface{ ConnectionState() tls.ConnectionState }); ok {
		st := tc.ConnectionState()
		return &st
	}
	return nil
}

// serveRequest is the one entry point of every request, from the lean loop
// and from net/http alike: whatever must hold for every request is checked
// here, once for both. A request read by net/http is answered through rq.w
// and serveRequest returns 0 and nil; one read by the lean loop is answered
// with the status and the body, appended to buf.
func (s *Server) serveRequest(rq *request, buf []byte) (int, []byte) {
	start := time.Now()
	rt := s.routes[rq.path]
	var err error
	ctx := context.Background()
	err = s.crossSite(rq, rt)
	if err == nil && s.guarded && (rt == nil || rt.access != accessOpen) {
		var who *caller
		if who, err = s.identify(rq, rt); err == nil {
			if rq.r != nil {
				rq.r = rq.r.WithContext(context.WithValue(rq.r.Context(), callerKey{}, who))
			} else {
				ctx = context.WithValue(ctx, callerKey{}, who)
			}
		}
	}
	switch {
	case err != nil:
	case rt == nil:
		err = api.ErrNotFound
	case rq.method != rt.method:
		if rq.w != nil {
			rq.w.Header().Set("Allow", rt.method)
		}
		err = api.ErrMethodNotAllowed
	case rt.core != nil && rq.w == nil:
		status, out := rt.core(ctx, rq.body, buf)
		rt.hist.Observe(time.Since(start).Seconds())
		return status, out
	case rt.core != nil:
		err = s.answer(rq.w, rq.r, rt.core)
	case rt.stream != nil && rq.take != nil:
		err = rt.stream(ctx, rq)
	case rq.w == nil:
		err = errLeanRoute
	default:
		err = rt.h(rq.w, rq.r)
	}
	var status int
	var out []byte
	if err != nil {
		if rq.w != nil {
			if errors.Is(err, api.ErrUnauthorized) {
				s.challenge(rq.w.Header(), rq, rt)
			}
			s.writeError(rq.w, rq.r, err)
		} else {
			status, out = s.errorAnswer(err, buf)
		}
	}
	if rt != nil {
		rt.hist.Observe(time.Since(start).Seconds())
	}
	return status, out
}

// errLeanRoute is a route without a core reached from the lean loop, which
// parseHead never lets happen.
var errLeanRoute = errors.New("server: the lean loop cannot serve this path")

type handler func(w http.ResponseWriter, r *http.Request) error

// route is one path's handling. A core answers from the request body alone
// and serves both loops; a handler serves net/http only; stream opens the
// event stream of a request the lean loop or an event loop read, on the
// connection it takes (rq.take).
type route struct {
	method string
	core   func(ctx context.Context, body, buf []byte) (int, []byte)
	h      handler
	stream func(ctx context.Context, rq *request) error
	hist   prometheus.Observer
	access access // who may use it when identities are checked (auth.go)
}

// route registers h for path and method; another method gets a JSON 405.
func (s *Server) route(path, method string, h handler) {
	s.routes[path] = &route{method: method, h: h, hist: s.metrics.latency.WithLabelValues(path)}
}

// core registers a POST answered by core on both loops.
func (s *Server) core(path string, core func(context.Context, []byte, []byte) (int, []byte)) {
	s.routes[path] = &route{method: http.MethodPost, core: core, hist: s.metrics.latency.WithLabelValues(path)}
}

// Drain makes /healthz answer 503 and ends every open event stream, so that
// the server can then be closed. It waits until the streams have returned.
func (s *Server) Drain() {
	s.startDrain()
	s.openStreams.Wait()
}

func (s *Server) startDrain() {
	s.draining.Store(true)
	s.hub.stop()
	s.drain()
}

func (s *Server) writeError(w http.ResponseWriter, r *http.Request, err error) {
	status, body := api.ErrorResponse(err)
	if status >= 500 {
		s.log.Error("request failed", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	writeJSON(w, status, body)
}

var contentTypeJSON = []string{"application/json"}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := jsonLine(v)
	if err != nil {
		b = []byte(`{"error":"encoding the answer failed","code":"internal","message":"encoding the answer failed"}` + "\n")
		status = http.StatusInternalServerError
	}
	writeRaw(w, status, b)
}

// jsonLine is v in JSON and a newline, as every answer body.
func jsonLine(v any) ([]byte, error) {
	b, err := json.Marshal(v)
	return append(b, '\n'), err
}

// writeRaw writes a JSON body. Header values are set directly: they are
// canonical already and shared, which saves the hot path its allocations.
func writeRaw(w http.ResponseWriter, status int, b []byte) {
	h := w.Header()
	h["Content-Type"] = contentTypeJSON
	h["Content-Length"] = []string{strconv.Itoa(len(b))}
	if ra := api.RetryAfterStatus(status); ra > 0 {
		h["Retry-After"] = []string{strconv.Itoa(ra)}
	}
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

var bufPool = sync.Pool{New: func() any { b := make([]byte, 0, 1024); return &b }}

// readBody reads at most api.MaxBody bytes into a pooled buffer; the caller
// gives it back with putBuf once the request is parsed.
func readBody(w http.ResponseWriter, r *http.Request) (*[]byte, error) {
	bp := bufPool.Get().(*[]byte)
	buf := bytes.NewBuffer((*bp)[:0])
	_, err := buf.ReadFrom(http.MaxBytesReader(w, r.Body, api.MaxBody))
	*bp = buf.Bytes()
	if err != nil {
		putBuf(bp)
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			return nil, api.ErrTooLarge
		}
		// Malformed chunks, or a client too slow for the read timeout: its
		// fault, and no words an old client would retry on (docs/API.md).
		return nil, errBadBody
	}
	return bp, nil
}

var errBadBody = fmt.Errorf("%w: the body could not be read", lock.ErrInvalid)

func putBuf(bp *[]byte) {
	if cap(*bp) <= 64<<10 {
		*bp = (*bp)[:0]
		bufPool.Put(bp)
	}
}

// answer serves, for net/http, a POST whose answer a core writes: the
// same cores serve the lean loop (leanhttp.go).
func (s *Server) answer(w http.ResponseWriter, r *http.Request, core func(context.Context, []byte, []byte) (int, []byte)) error {
	data, err := readBody(w, r)
	if err != nil {
		return err
	}
	status, out := core(r.Context(), *data, (*data)[:0])
	writeRaw(w, status, out)
	*data = out
	putBuf(data)
	return nil
}

// errorAnswer appends err's JSON body to buf.
func (s *Server) errorAnswer(err error, buf []byte) (int, []byte) {
	status, body := api.ErrorResponse(err)
	if status >= 500 {
		s.log.Error("request failed", "err", err)
	}
	b, merr := json.Marshal(body)
	if merr != nil {
		return http.StatusInternalServerError, append(buf, `{"error":"encoding the answer failed","code":"internal","message":"encoding the answer failed"}`+"\n"...)
	}
	return status, append(append(buf, b...), '\n')
}

// lockAnswer serves /lock: body is the request, buf the space for the
// answer (it may share body's memory: body is fully parsed first).
func (s *Server) lockAnswer(ctx context.Context, body, buf []byte) (int, []byte) {
	req, err := api.ParseLock(body)
	if err == nil {
		err = s.mayActAs(ctx, req.Node)
	}
	if err != nil {
		return s.errorAnswer(err, buf)
	}
	res, err := s.b.TryLock(ctx, req)
	if err != nil {
		return s.errorAnswer(err, buf)
	}
	lr := api.LockResponse{
		Acquired: res.Acquired, Queued: res.Queued, Skip: res.Skip,
		Token: res.Token, Holder: res.Holder, Position: res.Position,
	}
	if res.Acquired {
		lr.GuaranteedMs = api.Millis(res.Guaranteed)
	}
	out := api.AppendLockResponse(buf, lr)
	return http.StatusOK, append(out, '\n')
}

func (s *Server) unlockAnswer(ctx context.Context, body, buf []byte) (int, []byte) {
	req, err := api.ParseUnlock(body)
	if err == nil {
		err = s.mayActAs(ctx, req.Node)
	}
	if err != nil {
		return s.errorAnswer(err, buf)
	}
	res, err := s.b.Unlock(ctx, req)
	if err != nil {
		return s.errorAnswer(err, buf)
	}
	out := api.AppendUnlockResponse(buf, api.UnlockResponse{Released: true, NextHolder: res.NextHolder, Replayed: res.Replayed})
	return http.StatusOK, append(out, '\n')
}

func (s *Server) cancelAnswer(ctx context.Context, body, buf []byte) (int, []byte) {
	k, node, err := api.ParseKey(body)
	if err == nil {
		err = s.mayActAs(ctx, node)
	}
	if err != nil {
		return s.errorAnswer(err, buf)
	}
	res, err := s.b.Cancel(ctx, k.Type, k.Resource, node)
	if err != nil {
		return s.errorAnswer(err, buf)
	}
	b, _ := json.Marshal(api.CancelResponse{Dequeued: res.Dequeued, Released: res.Released})
	return http.StatusOK, append(append(buf, b...), '\n')
}

func (s *Server) handleStatus(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	t, err := lock.ParseType(q.Get("type"))
	if err != nil {
		return err
	}
	node := q.Get("node_id")
	if node != "" {
		// A /status naming a node renews its ttl leases (docs/API.md).
		if err := s.mayActAs(r.Context(), node); err != nil {
			return err
		}
	}
	st, err := s.b.Status(r.Context(), t, q.Get("resource_id"), node)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, api.Status(st, node))
	return nil
}

func refCountBody(rc lock.RefCount) api.RefCountResponse {
	nodes := rc.Nodes
	if nodes == nil {
		nodes = []string{}
	}
	return api.RefCountResponse{ResourceID: rc.Resource, Count: len(nodes), Nodes: nodes}
}

func (s *Server) handleRefCount(w http.ResponseWriter, r *http.Request) error {
	rc, err := s.b.RefCount(r.Context(), r.URL.Query().Get("resource_id"))
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, refCountBody(rc))
	return nil
}

func (s *Server) handleRefAdd(w http.ResponseWriter, r *http.Request) error {
	if !s.info.RefCounting {
		return lock.ErrRefCountOff
	}
	data, err := readBody(w, r)
	if err != nil {
		return err
	}
	req, err := api.ParseRef(*data, false)
	putBuf(data)
	if err == nil {
		err = s.mayActAs(r.Context(), req.NodeID)
	}
	if err != nil {
		return err
	}
	rc, err := s.b.RefAdd(r.Context(), req.ResourceID, req.NodeID)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, refCountBody(rc))
	return nil
}

func (s *Server) handleRefRelease(w http.ResponseWriter, r *http.Request) error {
	if !s.info.RefCounting {
		return lock.ErrRefCountOff
	}
	data, err := readBody(w, r)
	if err != nil {
		return err
	}
	req, err := api.ParseRef(*data, true)
	putBuf(data)
	if err == nil {
		err = s.mayActAs(r.Context(), req.NodeID)
	}
	if err != nil {
		return err
	}
	if req.ResourceID == "" {
		n, err := s.b.RefReleaseNode(r.Context(), req.NodeID)
		if err != nil {
			return err
		}
		writeJSON(w, http.StatusOK, api.ReleaseNodeResponse{NodeID: req.NodeID, Released: n})
		return nil
	}
	rc, err := s.b.RefRelease(r.Context(), req.ResourceID, req.NodeID)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, refCountBody(rc))
	return nil
}

// handleReadyz is /healthz and, for a backend that can tell (lock.Checker:
// an etcd backend), whether it can serve calls now: a probe that sends
// nodes only to servers that can answer them (docs/API.md).
func (s *Server) handleReadyz(w http.ResponseWriter, r *http.Request) error {
	if s.draining.Load() {
		return api.ErrUnavailable
	}
	if c, ok := s.b.(lock.Checker); ok {
		if err := c.Ready(); err != nil {
			return err
		}
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ready", "epoch": s.info.Epoch})
	return nil
}

func (s *Server) handleHealthz(w http.ResponseWriter, r *http.Request) error {
	if s.draining.Load() {
		return api.ErrUnavailable
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok", "epoch": s.info.Epoch})
	return nil
}
