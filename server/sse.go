package server

import (
	"context"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/lock"
	"golang.org/x/sys/unix"
)

// handleSubscribe serves a node's session stream and/or an observer of one
// key as Server-Sent Events.
func (s *Server) handleSubscribe(w http.ResponseWriter, r *http.Request) error {
	first, src, err := s.openSubscription(r.Context(), r.URL.Query(), r.Header.Get("Last-Event-ID"))
	if err != nil {
		return err
	}
	return s.eventStream(w, r, first, src)
}

// openSubscription subscribes as a /subscribe request with query q and
// Last-Event-ID lastEventID asks, for the caller in ctx, and returns the
// stream's first events and its source. Both loops open streams with it:
// net/http (handleSubscribe) and the lean loop (leanStream).
func (s *Server) openSubscription(ctx context.Context, q url.Values, lastEventID string) ([]byte, source, error) {
	// Copies: a node id or resource cut from the request line would keep
	// all of that line for as long as the stream, or the session, lasts.
	node := strings.Clone(q.Get("node_id"))
	var observe *lock.Key
	if q.Has("type") || q.Has("resource_id") {
		t, err := lock.ParseType(q.Get("type"))
		if err != nil {
			return nil, nil, err
		}
		if err := lock.ValidateResource(q.Get("resource_id")); err != nil {
			return nil, nil, err
		}
		observe = &lock.Key{Type: t, Resource: strings.Clone(q.Get("resource_id"))}
	}
	if s.draining.Load() {
		return nil, nil, api.ErrUnavailable
	}
	if node != "" {
		// A node's stream keeps its session alive and replays its events.
		if err := s.mayActAs(ctx, node); err != nil {
			return nil, nil, err
		}
	}
	var lastID uint64
	hasLast := false
	if lastEventID != "" {
		if id, err := strconv.ParseUint(lastEventID, 10, 64); err == nil {
			lastID, hasLast = id, true
		}
	}
	var releaseSlot func()
	if observe != nil {
		var err error
		if releaseSlot, err = s.observerSlot(ctx); err != nil {
			return nil, nil, err
		}
	}
	// The slot, and the feed once there is one, go back unless the
	// stream's source has them: on an error, and on a panic too, which
	// the loops recover from and answer.
	var st lock.Stream
	opened := false
	defer func() {
		if opened {
			return
		}
		if st != nil {
			st.Close()
		}
		if releaseSlot != nil {
			releaseSlot()
		}
	}()
	st, sub, err := s.b.Subscribe(ctx, lock.SubscribeRequest{Node: node, Observe: observe, LastID: lastID, HasLast: hasLast})
	if err != nil {
		st = nil // a backend's error leaves nothing to close
		return nil, nil, err
	}
	first := make([]byte, 0, 512)
	first = appendFrame(first, sub.ID, "subscribed", func(b []byte) []byte {
		return api.AppendSubscribed(b, node, s.info.Epoch)
	})
	for _, d := range sub.Replay {
		first = appendDelivery(first, d)
	}
	opened = true
	return first, &feedSource[lock.Delivery]{f: st, appendItem: appendDelivery, release: releaseSlot}, nil
}

// leanStream serves rq, a /subscribe the lean loop read whole, as an event
// stream on rq.take: what eventStream does with a connection it takes over
// from net/http, without net/http's request, goroutine and buffers first
// (docs/DESIGN.md, "Event streams"). rq.took says that the stream has the
// connection; on an error it has not, and the lean loop answers.
func (s *Server) leanStream(ctx context.Context, rq *request) error {
	q, _ := url.ParseQuery(rq.query) // as net/http's URL.Query
	first, src, err := s.openSubscription(ctx, q, rq.header("Last-Event-ID"))
	if err != nil {
		return err
	}
	if err := s.admitStream(src); err != nil {
		return err
	}
	// Set first: from here the hub has the connection, or takeStream has
	// closed it, even if what follows panics (the loops' recovery then
	// leaves it alone).
	rq.took = true
	s.takeStream(ctx, *rq.take, first, src)
	return nil
}

// feedSource is the source of a feed whose items appendItem encodes. One
// allocation a stream: an idle server keeps thousands.
type feedSource[T any] struct {
	f          lock.Feed[T]
	appendItem func([]byte, T) []byte
	// release, if not nil, lets go what the request held besides the
	// feed (an observer's slot), after the feed's Close.
	release func()
	pending []T // fill's, between its calls
}

func (fs *feedSource[T]) notify(f func()) { fs.f.Notify(f) }
func (fs *feedSource[T]) ended() bool     { return fs.f.Ended() }

func (fs *feedSource[T]) channels() (ready, done <-chan struct{}) {
	return fs.f.Ready(), fs.f.Done()
}

func (fs *feedSource[T]) close() {
	fs.f.Close()
	if fs.release != nil {
		fs.release()
	}
}

func (fs *feedSource[T]) fill(b []byte) []byte {
	fs.pending = fs.f.Take(fs.pending[:0])
	for _, it := range fs.pending {
		b = fs.appendItem(b, it)
	}
	clear(fs.pending)
	if cap(fs.pending) > 64 {
		fs.pending = nil // let a burst's backing array go
	}
	return b
}

// eventStream serves a Server-Sent Events response: first, then src's
// events and a ping when it has been quiet, until src, the peer or the
// server ends; src's close is called once the stream has ended.
// /subscribe and /ui/events both use it.
//
// On HTTP/1.1 the connection is taken over and handed to the hub
// (hub.go): net/http's goroutine and buffers go away, and an idle stream
// keeps one small goroutine, which matters with thousands of idle
// sessions. Other protocols (HTTP/2 behind TLS) stream through the
// ResponseWriter, from the handler's goroutine.
func (s *Server) eventStream(w http.ResponseWriter, r *http.Request, first []byte, src source) error {
	if err := s.admitStream(src); err != nil {
		return err
	}
	if conn, brw, err := http.NewResponseController(w).Hijack(); err == nil {
		brw.Reader.Reset(nil)
		s.takeStream(r.Context(), streamConn{conn: conn, fd: -1}, first, src)
		return nil
	}
	defer s.openStreams.Done()
	defer s.metrics.streams.Dec()
	defer src.close()
	rc := http.NewResponseController(w)
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	h.Set(api.PingHeader, strconv.FormatInt(s.ping.Milliseconds(), 10))
	w.WriteHeader(http.StatusOK)
	// Drain must not wait for a write to a client that does not read. The
	// deadline is never set once the handler has returned: the
	// ResponseWriter is net/http's again then (HTTP/2 reuses it).
	var deadlineMu sync.Mutex
	handlerDone := false
	stopDrain := context.AfterFunc(s.drained, func() {
		deadlineMu.Lock()
		defer deadlineMu.Unlock()
		if !handlerDone {
			_ = rc.SetWriteDeadline(time.Now())
		}
	})
	defer func() {
		stopDrain()
		deadlineMu.Lock()
		handlerDone = true
		deadlineMu.Unlock()
	}()
	gone := r.Context().Done()
	revoked, stop := s.revocation(r.Context())
	defer stop()
	if revoked != nil {
		// The credential that opened the stream is gone (docs/SECURITY.md).
		ctx, cancel := context.WithCancel(r.Context())
		defer cancel()
		defer context.AfterFunc(revoked, cancel)()
		gone = ctx.Done()
	}
	s.streamLoop(src, first, gone, func(b []byte) error {
		_ = rc.SetWriteDeadline(time.Now().Add(s.writeTimeout))
		if _, err := w.Write(b); err != nil {
			return err
		}
		return rc.Flush()
	})
	return nil
}

// admitStream counts a new event stream of src (hub.admit, and the streams
// gauge), or closes src and refuses it while the server drains.
func (s *Server) admitStream(src source) error {
	if !s.hub.admit() {
		src.close()
		return api.ErrUnavailable
	}
	s.metrics.streams.Inc()
	return nil
}

// takeStream hands sc, an HTTP/1.1 connection whose request opened src, to
// the hub as src's event stream: the answer's head and first go out before
// any event. The stream was admitted (hub.admit) and counted; the
// credential of the caller in ctx ends it when revoked. A socket without
// its connection (sc.fd, from an event loop) carries the connection's
// count in Server.conns.
func (s *Server) takeStream(ctx context.Context, sc streamConn, first []byte, src source) {
	if sc.conn != nil {
		// A read deadline for the request would end the stream; the hub
		// sets the write deadlines it needs.
		_ = sc.conn.SetDeadline(time.Time{})
	}
	out := append(make([]byte, 0, 256+len(first)), "HTTP/1.1 200 OK\r\n"+
		"Content-Type: text/event-stream\r\nCache-Control: no-cache\r\nX-Accel-Buffering: no\r\n"+
		"Connection: close\r\n"+api.PingHeader+": "...)
	out = strconv.AppendInt(out, s.ping.Milliseconds(), 10)
	out = append(out, "\r\n"+api.EpochHeader+": "...)
	out = append(out, s.info.Epoch...)
	out = append(out, "\r\n\r\n"...)
	out = append(out, first...)
	revoked, stop := s.revocation(ctx)
	if revoked == nil {
		stop = nil // nothing to stop: no closure kept a stream
	}
	var st *hubStream
	if sc.conn != nil {
		st = s.hub.start(sc.conn, src, out, revoked, stop)
	} else {
		st = s.hub.startFD(sc.fd, src, out, revoked, stop)
	}
	if st == nil {
		if sc.conn != nil {
			sc.conn.Close()
		} else {
			unix.Close(sc.fd)
			s.conns.Add(-1)
		}
		if stop != nil {
			stop()
		}
		src.close()
		s.metrics.streams.Dec()
		s.openStreams.Done()
	}
}

// streamLoop writes first, then src's events as they come and a ping when
// it has been quiet, until src, the peer or the server ends: an event
// stream served from its handler's goroutine (HTTP/2).
func (s *Server) streamLoop(src source, first []byte, gone <-chan struct{}, write func([]byte) error) {
	if err := write(first); err != nil {
		return
	}
	ping := time.NewTicker(s.ping)
	defer ping.Stop()
	ready, done := src.channels()
	var buf []byte
	for {
		select {
		case <-ready:
			// Everything waiting goes out in one write: a fan-out of many
			// events costs one syscall, not one each.
			buf = src.fill(buf[:0])
			if err := write(buf); err != nil {
				return
			}
			if cap(buf) > 64<<10 {
				buf = nil // let a burst's buffer go
			}
			ping.Reset(s.ping)
		case <-ping.C:
			if err := write(append(buf[:0], ": ping\n\n"...)); err != nil {
				return
			}
		case <-done:
			// Closed by the backend, too slow for example: end the
			// response so the client reconnects with Last-Event-ID and
			// replays.
			return
		case <-gone:
			return
		case <-s.drained.Done():
			return
		}
	}
}

func appendFrame(b []byte, id uint64, name string, data func([]byte) []byte) []byte {
	b = append(b, "id: "...)
	b = strconv.AppendUint(b, id, 10)
	b = append(b, "\nevent: "...)
	b = append(b, name...)
	b = append(b, "\ndata: "...)
	b = data(b)
	return append(b, "\n\n"...)
}

func appendDelivery(b []byte, d lock.Delivery) []byte {
	return appendFrame(b, d.ID, d.Event.Name, func(b []byte) []byte {
		return append(b, d.Event.Encoded(api.AppendEventData)...)
	})
}
