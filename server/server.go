// Package server is dlock's HTTP + JSON API with Server-Sent Events for
// waiters (SPEC §3). It holds no lock state: every request is one call into
// the lock manager.
package server

import (
	"bytes"
	"encoding/json"
	"errors"
	"log/slog"
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
// http.Server.Shutdown can finish. It waits until the streams have returned.
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
	data, err := readBody(w, r)
	if err != nil {
		return err
	}
	req, err := wire.ParseLock(*data)
	if err != nil {
		putBuf(data)
		return err
	}
	res, err := s.m.TryLock(r.Context(), req)
	if err != nil {
		putBuf(data)
		return err
	}
	out := wire.AppendLockResponse((*data)[:0], wire.LockResponse{
		Acquired: res.Acquired, Queued: res.Queued, Skip: res.Skip,
		Token: res.Token, Holder: res.Holder, Position: res.Position,
	})
	writeRaw(w, http.StatusOK, append(out, '\n'))
	*data = out
	putBuf(data)
	return nil
}

func (s *Server) handleUnlock(w http.ResponseWriter, r *http.Request) error {
	data, err := readBody(w, r)
	if err != nil {
		return err
	}
	req, err := wire.ParseUnlock(*data)
	if err != nil {
		putBuf(data)
		return err
	}
	res, err := s.m.Unlock(r.Context(), req)
	if err != nil {
		putBuf(data)
		return err
	}
	out := wire.AppendUnlockResponse((*data)[:0], wire.UnlockResponse{Released: true, NextHolder: res.NextHolder, Replayed: res.Replayed})
	writeRaw(w, http.StatusOK, append(out, '\n'))
	*data = out
	putBuf(data)
	return nil
}

func (s *Server) handleCancel(w http.ResponseWriter, r *http.Request) error {
	data, err := readBody(w, r)
	if err != nil {
		return err
	}
	k, node, err := wire.ParseKey(*data)
	putBuf(data)
	if err != nil {
		return err
	}
	res, err := s.m.Cancel(r.Context(), k.Type, k.Resource, node)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, wire.CancelResponse{Dequeued: res.Dequeued, Released: res.Released})
	return nil
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
