package server

import (
	"net/http"
	"strconv"
	"time"

	"github.com/dlock/dlock/internal/wire"
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
		return wire.ErrUnavailable
	}
	var lastID uint64
	hasLast := false
	if v := r.Header.Get("Last-Event-ID"); v != "" {
		if id, err := strconv.ParseUint(v, 10, 64); err == nil {
			lastID, hasLast = id, true
		}
	}
	st, sub, err := s.m.Subscribe(node, observe, lastID, hasLast)
	if err != nil {
		return err
	}
	s.openStreams.Add(1)
	defer s.openStreams.Done()
	defer st.Close()
	s.metrics.streams.Inc()
	defer s.metrics.streams.Dec()

	rc := http.NewResponseController(w)
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)

	buf := make([]byte, 0, 512)
	buf = appendFrame(buf, sub.ID, "subscribed", func(b []byte) []byte {
		return wire.AppendSubscribed(b, node, s.m.Epoch())
	})
	for _, d := range sub.Replay {
		buf = appendDelivery(buf, d)
	}
	if err := s.flush(w, rc, buf); err != nil {
		return nil
	}
	ping := time.NewTicker(s.ping)
	defer ping.Stop()
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
			if err := s.flush(w, rc, buf); err != nil {
				return nil
			}
			if cap(buf) > 64<<10 {
				buf = make([]byte, 0, 512) // let a burst's buffer go
			}
			ping.Reset(s.ping)
		case <-ping.C:
			if err := s.flush(w, rc, append(buf[:0], ": ping\n\n"...)); err != nil {
				return nil
			}
		case <-st.Done():
			// Closed by the manager, too slow for example: end the response
			// so the client reconnects with Last-Event-ID and replays.
			return nil
		case <-r.Context().Done():
			return nil
		case <-s.streams:
			return nil
		}
	}
}

func (s *Server) flush(w http.ResponseWriter, rc *http.ResponseController, b []byte) error {
	// A peer that stops reading must not pin this goroutine forever.
	_ = rc.SetWriteDeadline(time.Now().Add(2 * s.ping))
	if _, err := w.Write(b); err != nil {
		return err
	}
	return rc.Flush()
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
		return append(b, d.Event.Encoded(wire.AppendEventData)...)
	})
}
