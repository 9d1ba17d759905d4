package server

import (
	"context"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/lock"
)

// handleSubscribe serves a node's session stream and/or an observer of one
// key as Server-Sent Events.
func (s *Server) handleSubscribe(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	node := q.Get("node_id")
	var observe *lock.Key
	if q.Has("type") || q.Has("resource_id") {
		t, err := lock.ParseType(q.Get("type"))
		if err != nil {
			return err
		}
		if err := lock.ValidateResource(q.Get("resource_id")); err != nil {
			return err
		}
		observe = &lock.Key{Type: t, Resource: q.Get("resource_id")}
	}
	if s.draining.Load() {
		return api.ErrUnavailable
	}
	if node != "" {
		// A node's stream keeps its session alive and replays its events.
		if err := s.mayActAs(r.Context(), node); err != nil {
			return err
		}
	}
	var lastID uint64
	hasLast := false
	if v := r.Header.Get("Last-Event-ID"); v != "" {
		if id, err := strconv.ParseUint(v, 10, 64); err == nil {
			lastID, hasLast = id, true
		}
	}
	releaseSlot := func() {}
	if observe != nil {
		var err error
		if releaseSlot, err = s.observerSlot(r.Context()); err != nil {
			return err
		}
	}
	st, sub, err := s.b.Subscribe(r.Context(), lock.SubscribeRequest{Node: node, Observe: observe, LastID: lastID, HasLast: hasLast})
	if err != nil {
		releaseSlot()
		return err
	}
	first := make([]byte, 0, 512)
	first = appendFrame(first, sub.ID, "subscribed", func(b []byte) []byte {
		return api.AppendSubscribed(b, node, s.info.Epoch)
	})
	for _, d := range sub.Replay {
		first = appendDelivery(first, d)
	}
	s.eventStream(w, r, first, func() { st.Close(); releaseSlot() }, func(gone <-chan struct{}, write func([]byte) error) {
		s.streamLoop(st, first, gone, write)
	})
	return nil
}

// eventStream serves a Server-Sent Events response whose body run writes
// (first, then events) until gone closes or it returns; release is called
// once the stream has ended. /subscribe and /ui/events both use it.
//
// On HTTP/1.1 the connection is taken over: the handler's goroutine and
// net/http's buffers (about 10 KiB a connection) go away, which matters with
// thousands of idle sessions; the stream keeps one goroutine that writes and
// one that notices the peer leave. Other protocols (HTTP/2 behind TLS) stream
// through the ResponseWriter.
func (s *Server) eventStream(w http.ResponseWriter, r *http.Request, first []byte, release func(), run func(gone <-chan struct{}, write func([]byte) error)) {
	s.openStreams.Add(1)
	s.metrics.streams.Inc()
	if conn, brw, err := http.NewResponseController(w).Hijack(); err == nil {
		brw.Reader.Reset(nil)
		// net/http's read deadline for the request would end the stream;
		// the stream sets its own write deadlines.
		_ = conn.SetReadDeadline(time.Time{})
		hdr := append(make([]byte, 0, 256), "HTTP/1.1 200 OK\r\n"+
			"Content-Type: text/event-stream\r\nCache-Control: no-cache\r\nX-Accel-Buffering: no\r\n"+
			"Connection: close\r\n"+api.EpochHeader+": "...)
		hdr = append(hdr, s.info.Epoch...)
		hdr = append(hdr, "\r\n\r\n"...)
		revoked, stop := s.revocation(r.Context())
		go s.hijackedStream(conn, hdr, revoked, func() { stop(); release() }, run)
		return
	}
	defer s.openStreams.Done()
	defer s.metrics.streams.Dec()
	defer release()
	rc := http.NewResponseController(w)
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
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
	run(gone, func(b []byte) error {
		_ = rc.SetWriteDeadline(time.Now().Add(s.writeTimeout))
		if _, err := w.Write(b); err != nil {
			return err
		}
		return rc.Flush()
	})
}

// hijackedStream serves a stream on a connection taken over from net/http:
// the response header goes out with the stream's first write.
func (s *Server) hijackedStream(conn net.Conn, hdr []byte, revoked context.Context, release func(), run func(gone <-chan struct{}, write func([]byte) error)) {
	defer s.openStreams.Done()
	defer s.metrics.streams.Dec()
	defer release()
	defer func() {
		if p := recover(); p != nil {
			s.panicked(p, conn.RemoteAddr().String())
			conn.Close()
		}
	}()
	// Drain must not wait for a write to a client that does not read: the
	// connection closes, and the write fails, at once.
	defer context.AfterFunc(s.drained, func() { conn.Close() })()
	if revoked != nil {
		// The credential that opened the stream is gone (docs/SECURITY.md).
		defer context.AfterFunc(revoked, func() { conn.Close() })()
	}
	gone := make(chan struct{})
	var reader sync.WaitGroup
	reader.Go(func() {
		// The client sends nothing more: a read ends when it goes away.
		var b [64]byte
		for {
			if _, err := conn.Read(b[:]); err != nil {
				close(gone)
				return
			}
		}
	})
	var deadline time.Time
	run(gone, func(b []byte) error {
		// A peer that stops reading must not pin this goroutine: a write
		// blocks for at most the write timeout. Moving the deadline on
		// every write would cost a timer update each; moving it when half
		// is gone keeps it between half and all of the write timeout.
		if now := time.Now(); deadline.Sub(now) < s.writeTimeout/2 {
			deadline = now.Add(s.writeTimeout)
			_ = conn.SetWriteDeadline(deadline)
		}
		if hdr != nil {
			b = append(hdr, b...)
			hdr = nil
		}
		_, err := conn.Write(b)
		return err
	})
	conn.Close()
	reader.Wait()
}

// streamLoop writes first, then the stream's events as they come and a ping
// when it has been quiet, until the stream, the peer or the server ends.
func (s *Server) streamLoop(st lock.Stream, first []byte, gone <-chan struct{}, write func([]byte) error) {
	if err := write(first); err != nil {
		return
	}
	ping := time.NewTicker(s.ping)
	defer ping.Stop()
	buf := make([]byte, 0, 512)
	var pending []lock.Delivery
	for {
		select {
		case <-st.Ready():
			// Everything waiting goes out in one write: a fan-out of many
			// events costs one syscall, not one each.
			pending = st.Take(pending[:0])
			buf = buf[:0]
			for _, d := range pending {
				buf = appendDelivery(buf, d)
			}
			clear(pending)
			if err := write(buf); err != nil {
				return
			}
			if cap(buf) > 64<<10 {
				buf = make([]byte, 0, 512) // let a burst's buffer go
			}
			ping.Reset(s.ping)
		case <-ping.C:
			if err := write(append(buf[:0], ": ping\n\n"...)); err != nil {
				return
			}
		case <-st.Done():
			// Closed by the manager, too slow for example: end the response
			// so the client reconnects with Last-Event-ID and replays.
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
