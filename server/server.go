// Package server is dlock's HTTP + JSON API with Server-Sent Events for
// waiters (SPEC §3). It holds no lock state: every request is one call into
// the lock manager.
package server

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dlock/dlock/internal/wire"
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
	// the smaller of 15 s and the manager's lock TTL / 4.
	PingInterval time.Duration
}

// Server serves the dlock API for one lock manager.
type Server struct {
	m        *lock.Manager
	log      *slog.Logger
	mux      *http.ServeMux
	metrics  *metrics
	ping     time.Duration
	epoch    []string
	draining atomic.Bool

	// streams is closed by Drain: every open event stream ends.
	streams     chan struct{}
	drainOnce   sync.Once
	openStreams sync.WaitGroup

	// fastLatency holds the latency histograms of the lean loop's paths,
	// resolved once: a label lookup per request is measurable.
	fastLatency map[string]prometheus.Observer

	// The lean HTTP/1.1 loop's state (fast.go), guarded by mu.
	mu        sync.Mutex
	closing   bool
	listeners []net.Listener
	handoffs  []*handoffListener
	fastConns map[*fastConn]struct{}
	fastWG    sync.WaitGroup
}

// New returns a Server for m.
func New(m *lock.Manager, opts Options) *Server {
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
		ping = min(15*time.Second, m.Config().LockTTL/4)
	}
	s := &Server{
		m:       m,
		log:     log,
		mux:     http.NewServeMux(),
		metrics: newMetrics(reg, m),
		ping:    ping,
		streams: make(chan struct{}),
		epoch:   []string{m.Epoch()},
	}
	s.fastLatency = make(map[string]prometheus.Observer)
	for p := range fastPaths {
		s.fastLatency[p] = s.metrics.latency.WithLabelValues(p)
	}
	s.route("/lock", http.MethodPost, s.handleLock)
	s.route("/unlock", http.MethodPost, s.handleUnlock)
	s.route("/cancel", http.MethodPost, s.handleCancel)
	s.route("/status", http.MethodGet, s.handleStatus)
	s.route("/subscribe", http.MethodGet, s.handleSubscribe)
	s.route("/lock/subscribe", http.MethodGet, s.handleSubscribe)
	s.route("/refcount", http.MethodGet, s.handleRefCount)
	s.route("/refcount/add", http.MethodPost, s.handleRefAdd)
	s.route("/refcount/release", http.MethodPost, s.handleRefRelease)
	s.route("/healthz", http.MethodGet, s.handleHealthz)
	s.routeUI()
	metricsHandler := promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
	s.route("/metrics", http.MethodGet, func(w http.ResponseWriter, r *http.Request) error {
		metricsHandler.ServeHTTP(w, r)
		return nil
	})
	s.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		s.writeError(w, r, wire.ErrNotFound)
	})
	return s
}

// ServeHTTP stamps every response with the epoch and routes it.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header()[wire.EpochHeader] = s.epoch // shared, never modified
	s.mux.ServeHTTP(w, r)
}

// Drain makes /healthz answer 503 and ends every open event stream, so that
// the server can then be closed. It waits until the streams have returned.
func (s *Server) Drain() {
	s.draining.Store(true)
	s.drainOnce.Do(func() { close(s.streams) })
	s.openStreams.Wait()
}

type handler func(w http.ResponseWriter, r *http.Request) error

// route registers h for path and method; another method gets a JSON 405.
// The mux's own method patterns would answer 405 in plain text.
func (s *Server) route(path, method string, h handler) {
	hist := s.metrics.latency.WithLabelValues(path)
	s.mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		var err error
		if r.Method != method {
			w.Header().Set("Allow", method)
			err = wire.ErrMethodNotAllowed
		} else {
			err = h(w, r)
		}
		if err != nil {
			s.writeError(w, r, err)
		}
		hist.Observe(time.Since(start).Seconds())
	})
}

func (s *Server) writeError(w http.ResponseWriter, r *http.Request, err error) {
	status, body := wire.ErrorBody(err)
	if status >= 500 {
		s.log.Error("request failed", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	writeJSON(w, status, body)
}

var contentTypeJSON = []string{"application/json"}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		b = []byte(`{"error":"encoding the answer failed","code":"internal","message":"encoding the answer failed"}`)
		status = http.StatusInternalServerError
	}
	writeRaw(w, status, append(b, '\n'))
}

// writeRaw writes a JSON body. Header values are set directly: they are
// canonical already and shared, which saves the hot path its allocations.
func writeRaw(w http.ResponseWriter, status int, b []byte) {
	h := w.Header()
	h["Content-Type"] = contentTypeJSON
	h["Content-Length"] = []string{strconv.Itoa(len(b))}
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

var bufPool = sync.Pool{New: func() any { b := make([]byte, 0, 1024); return &b }}

// readBody reads at most wire.MaxBody bytes into a pooled buffer; the caller
// gives it back with putBuf once the request is parsed.
func readBody(w http.ResponseWriter, r *http.Request) (*[]byte, error) {
	bp := bufPool.Get().(*[]byte)
	buf := bytes.NewBuffer((*bp)[:0])
	_, err := buf.ReadFrom(http.MaxBytesReader(w, r.Body, wire.MaxBody))
	*bp = buf.Bytes()
	if err != nil {
		putBuf(bp)
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			return nil, wire.ErrTooLarge
		}
		return nil, err
	}
	return bp, nil
}

func putBuf(bp *[]byte) {
	if cap(*bp) <= 64<<10 {
		*bp = (*bp)[:0]
		bufPool.Put(bp)
	}
}

func (s *Server) handleLock(w http.ResponseWriter, r *http.Request) error {
	return s.answer(w, r, s.lockAnswer)
}

func (s *Server) handleUnlock(w http.ResponseWriter, r *http.Request) error {
	return s.answer(w, r, s.unlockAnswer)
}

func (s *Server) handleCancel(w http.ResponseWriter, r *http.Request) error {
	return s.answer(w, r, s.cancelAnswer)
}

// answer serves a POST whose answer a core function writes: the same cores
// serve net/http here and the lean loop in fast.go.
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
	status, body := wire.ErrorBody(err)
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
	req, err := wire.ParseLock(body)
	if err != nil {
		return s.errorAnswer(err, buf)
	}
	res, err := s.m.TryLock(ctx, req)
	if err != nil {
		return s.errorAnswer(err, buf)
	}
	out := wire.AppendLockResponse(buf, wire.LockResponse{
		Acquired: res.Acquired, Queued: res.Queued, Skip: res.Skip,
		Token: res.Token, Holder: res.Holder, Position: res.Position,
	})
	return http.StatusOK, append(out, '\n')
}

func (s *Server) unlockAnswer(ctx context.Context, body, buf []byte) (int, []byte) {
	req, err := wire.ParseUnlock(body)
	if err != nil {
		return s.errorAnswer(err, buf)
	}
	res, err := s.m.Unlock(ctx, req)
	if err != nil {
		return s.errorAnswer(err, buf)
	}
	out := wire.AppendUnlockResponse(buf, wire.UnlockResponse{Released: true, NextHolder: res.NextHolder, Replayed: res.Replayed})
	return http.StatusOK, append(out, '\n')
}

func (s *Server) cancelAnswer(ctx context.Context, body, buf []byte) (int, []byte) {
	k, node, err := wire.ParseKey(body)
	if err != nil {
		return s.errorAnswer(err, buf)
	}
	res, err := s.m.Cancel(ctx, k.Type, k.Resource, node)
	if err != nil {
		return s.errorAnswer(err, buf)
	}
	b, _ := json.Marshal(wire.CancelResponse{Dequeued: res.Dequeued, Released: res.Released})
	return http.StatusOK, append(append(buf, b...), '\n')
}

func (s *Server) handleStatus(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	t, err := lock.ParseType(q.Get("type"))
	if err != nil {
		return err
	}
	st, err := s.m.Status(t, q.Get("resource_id"), q.Get("node_id"))
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, wire.Status(st))
	return nil
}

func refCountBody(rc lock.RefCount) wire.RefCountResponse {
	nodes := rc.Nodes
	if nodes == nil {
		nodes = []string{}
	}
	return wire.RefCountResponse{ResourceID: rc.Resource, Count: len(nodes), Nodes: nodes}
}

func (s *Server) handleRefCount(w http.ResponseWriter, r *http.Request) error {
	rc, err := s.m.RefCount(r.URL.Query().Get("resource_id"))
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, refCountBody(rc))
	return nil
}

func (s *Server) handleRefAdd(w http.ResponseWriter, r *http.Request) error {
	if !s.m.RefCounting() {
		return lock.ErrRefCountOff
	}
	data, err := readBody(w, r)
	if err != nil {
		return err
	}
	req, err := wire.ParseRef(*data, false)
	putBuf(data)
	if err != nil {
		return err
	}
	rc, err := s.m.RefAdd(r.Context(), req.ResourceID, req.NodeID)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, refCountBody(rc))
	return nil
}

func (s *Server) handleRefRelease(w http.ResponseWriter, r *http.Request) error {
	if !s.m.RefCounting() {
		return lock.ErrRefCountOff
	}
	data, err := readBody(w, r)
	if err != nil {
		return err
	}
	req, err := wire.ParseRef(*data, true)
	putBuf(data)
	if err != nil {
		return err
	}
	if req.ResourceID == "" {
		n, err := s.m.RefReleaseNode(r.Context(), req.NodeID)
		if err != nil {
			return err
		}
		writeJSON(w, http.StatusOK, wire.ReleaseNodeResponse{NodeID: req.NodeID, Released: n})
		return nil
	}
	rc, err := s.m.RefRelease(r.Context(), req.ResourceID, req.NodeID)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, refCountBody(rc))
	return nil
}

func (s *Server) handleHealthz(w http.ResponseWriter, r *http.Request) error {
	if s.draining.Load() {
		return wire.ErrUnavailable
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok", "epoch": s.m.Epoch()})
	return nil
}
