package server

import (
	"bytes"
	"crypto/sha256"
	_ "embed"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/lock"
)

// The operators' live view (docs/API.md, GET /ui): one self-contained page
// and the JSON and event stream it reads. The page never downloads every
// key: it reads one page of them, filtered on the server, and applies the
// operator feed's transitions to what it shows.

//go:embed ui/index.html
var uiPage []byte

// uiCSP allows the page nothing but its own inline script and style (by
// hash) and requests to this server: no external script, font or CDN can
// load even if one slipped into the page.
var uiCSP = "default-src 'none'; script-src " + inlineHash(uiPage, "script") +
	"; style-src " + inlineHash(uiPage, "style") +
	"; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

// inlineHash is the CSP source of the one <tag> element of page.
func inlineHash(page []byte, tag string) string {
	open, end := []byte("<"+tag+">"), []byte("</"+tag+">")
	i, j := bytes.Index(page, open), bytes.Index(page, end)
	if i < 0 || j < i || bytes.Count(page, open) != 1 {
		panic(fmt.Sprintf("server: ui/index.html must have exactly one <%s> element", tag))
	}
	sum := sha256.Sum256(page[i+len(open) : j])
	return "'sha256-" + base64.StdEncoding.EncodeToString(sum[:]) + "'"
}

// routeUI registers the live view when the backend offers inspection
// (lock.Inspector). Its routes go through route like every other, so
// whatever guards the API (an operator token) guards them too.
func (s *Server) routeUI() {
	in, ok := s.b.(lock.Inspector)
	if !ok {
		return
	}
	s.inspect = in
	s.route("/ui", http.MethodGet, s.handleUI)
	s.route("/ui/api/keys", http.MethodGet, s.handleUIKeys)
	s.route("/ui/api/completions", http.MethodGet, s.handleUICompletions)
	s.route("/ui/api/sessions", http.MethodGet, s.handleUISessions)
	s.route("/ui/events", http.MethodGet, s.handleUIEvents)
}

func (s *Server) handleUI(w http.ResponseWriter, r *http.Request) error {
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Content-Security-Policy", uiCSP)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("Cache-Control", "no-store")
	h.Set("Content-Length", strconv.Itoa(len(uiPage)))
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(uiPage)
	return nil
}

// uiQuery reads the filter and paging parameters the view's calls share.
func uiQuery(r *http.Request) (filter, node, cursor string, limit int, err error) {
	q := r.URL.Query()
	filter, node, cursor = q.Get("filter"), q.Get("node"), q.Get("cursor")
	if len(filter) > lock.MaxResourceLen || len(node) > lock.MaxNodeLen || len(cursor) > 2048 {
		return "", "", "", 0, fmt.Errorf("%w: filter, node or cursor is too long", lock.ErrInvalid)
	}
	if v := q.Get("limit"); v != "" {
		if limit, err = strconv.Atoi(v); err != nil || limit < 1 {
			return "", "", "", 0, fmt.Errorf("%w: limit must be a positive integer, not %q", lock.ErrInvalid, v)
		}
	}
	return filter, node, cursor, limit, nil
}

type uiWaiter struct {
	NodeID string `json:"node_id"`
	Lease  string `json:"lease"`
}

type uiKey struct {
	Type          string          `json:"type"`
	ResourceID    string          `json:"resource_id"`
	Holder        string          `json:"holder"`
	Token         uint64          `json:"token"`
	Lease         string          `json:"lease"`
	AcquiredAt    time.Time       `json:"acquired_at"`
	Unclaimed     bool            `json:"unclaimed"`
	Queue         []uiWaiter      `json:"queue"`
	QueueLength   int             `json:"queue_length"`
	LastCompleted *api.Completion `json:"last_completed"`
}

type uiTotals struct {
	Keys     int `json:"keys"`
	Held     int `json:"held"`
	Queued   int `json:"queued"`
	Sessions int `json:"sessions"`
}

type uiKeysResponse struct {
	Now     time.Time `json:"now"`
	Epoch   string    `json:"epoch"`
	Keys    []uiKey   `json:"keys"`
	Next    string    `json:"next"`
	Scanned int       `json:"scanned"`
	Limit   int       `json:"limit"`
	Totals  uiTotals  `json:"totals"`
}

func (s *Server) handleUIKeys(w http.ResponseWriter, r *http.Request) error {
	filter, node, cursor, limit, err := uiQuery(r)
	if err != nil {
		return err
	}
	page, err := s.inspect.InspectKeys(r.Context(), lock.KeyQuery{Resource: filter, Node: node, Cursor: cursor, Limit: limit})
	if err != nil {
		return err
	}
	st := s.b.Stats()
	out := uiKeysResponse{
		Now: time.Now().UTC(), Epoch: s.info.Epoch, Keys: make([]uiKey, 0, len(page.Keys)),
		Next: page.Next, Scanned: page.Scanned, Limit: min(max(limit, 0), lock.MaxInspectLimit),
		Totals: uiTotals{Keys: st.Keys, Held: st.Held, Queued: st.Queued, Sessions: st.Sessions},
	}
	if out.Limit == 0 {
		out.Limit = lock.DefaultInspectLimit
	}
	for _, k := range page.Keys {
		v := uiKey{
			Type: k.Key.Type.String(), ResourceID: k.Key.Resource, Holder: k.Holder, Token: k.Token,
			Lease: k.Lease.String(), AcquiredAt: k.AcquiredAt.UTC(), Unclaimed: k.Unclaimed,
			Queue: make([]uiWaiter, len(k.Queue)), QueueLength: k.QueueLength,
		}
		for i, q := range k.Queue {
			v.Queue[i] = uiWaiter{NodeID: q.Node, Lease: q.Lease.String()}
		}
		if c := k.LastCompleted; c != nil {
			v.LastCompleted = &api.Completion{NodeID: c.Node, Token: c.Token, Success: c.Success, Error: c.Error, CompletedAt: c.CompletedAt.UTC()}
		}
		out.Keys = append(out.Keys, v)
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

type uiCompletion struct {
	Type        string    `json:"type"`
	ResourceID  string    `json:"resource_id"`
	NodeID      string    `json:"node_id"`
	Token       uint64    `json:"token"`
	Success     bool      `json:"success"`
	Error       string    `json:"error"`
	CompletedAt time.Time `json:"completed_at"`
	NextHolder  string    `json:"next_holder"`
}

func (s *Server) handleUICompletions(w http.ResponseWriter, r *http.Request) error {
	filter, node, _, limit, err := uiQuery(r)
	if err != nil {
		return err
	}
	list, err := s.inspect.RecentCompletions(r.Context(), lock.KeyQuery{Resource: filter, Node: node, Limit: limit})
	if err != nil {
		return err
	}
	out := struct {
		Now         time.Time      `json:"now"`
		Completions []uiCompletion `json:"completions"`
	}{Now: time.Now().UTC(), Completions: make([]uiCompletion, len(list))}
	for i, c := range list {
		out.Completions[i] = uiCompletion{
			Type: c.Key.Type.String(), ResourceID: c.Key.Resource, NodeID: c.Node, Token: c.Token,
			Success: c.Success, Error: c.Error, CompletedAt: c.CompletedAt.UTC(), NextHolder: c.NextHolder,
		}
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

type uiSession struct {
	NodeID  string `json:"node_id"`
	Streams int    `json:"streams"`
	InGrace bool   `json:"in_grace"`
	Keys    int    `json:"keys"`
}

func (s *Server) handleUISessions(w http.ResponseWriter, r *http.Request) error {
	_, node, cursor, limit, err := uiQuery(r)
	if err != nil {
		return err
	}
	page, err := s.inspect.InspectSessions(r.Context(), lock.SessionQuery{Node: node, Cursor: cursor, Limit: limit})
	if err != nil {
		return err
	}
	out := struct {
		Now      time.Time   `json:"now"`
		Sessions []uiSession `json:"sessions"`
		Next     string      `json:"next"`
		Total    int         `json:"total"`
	}{Now: time.Now().UTC(), Sessions: make([]uiSession, len(page.Sessions)), Next: page.Next, Total: page.Total}
	for i, v := range page.Sessions {
		out.Sessions[i] = uiSession{NodeID: v.Node, Streams: v.Streams, InGrace: v.InGrace, Keys: v.Keys}
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

// handleUIEvents serves the operator feed as Server-Sent Events: one stream
// for every key, so a view of many keys costs one connection. It has no
// event ids and no replay: a view that reconnects reads a fresh snapshot.
func (s *Server) handleUIEvents(w http.ResponseWriter, r *http.Request) error {
	if s.draining.Load() {
		return api.ErrUnavailable
	}
	st, err := s.inspect.WatchOps(r.Context())
	if err != nil {
		return err
	}
	first := fmt.Appendf(nil, "retry: 1000\nevent: subscribed\ndata: {\"event\":\"subscribed\",\"epoch\":%q}\n\n", s.info.Epoch)
	return s.eventStream(w, r, first, &feedSource[lock.OpEvent]{f: st, appendItem: appendOpEvent})
}

// appendOpEvent appends one SSE frame. Lock events carry the data session
// streams get (encoded once for all); queue and session events have
// their own.
func appendOpEvent(b []byte, ev lock.OpEvent) []byte {
	if c := ev.Session; c != nil {
		data, _ := json.Marshal(struct {
			Event   string `json:"event"`
			NodeID  string `json:"node_id"`
			Streams int    `json:"streams"`
			Ended   bool   `json:"ended"`
		}{"session", c.Node, c.Streams, c.Ended})
		b = append(b, "event: session\ndata: "...)
		b = append(b, data...)
		return append(b, "\n\n"...)
	}
	e := ev.Event
	b = append(b, "event: "...)
	b = append(b, e.Name...)
	b = append(b, "\ndata: "...)
	switch e.Name {
	case lock.EventQueueJoined, lock.EventQueueLeft:
		b = append(b, e.Encoded(appendQueueEvent)...)
	default:
		b = append(b, e.Encoded(api.AppendEventData)...)
	}
	return append(b, "\n\n"...)
}

func appendQueueEvent(b []byte, e *lock.Event) []byte {
	data, _ := json.Marshal(struct {
		Event      string `json:"event"`
		Type       string `json:"type"`
		ResourceID string `json:"resource_id"`
		NodeID     string `json:"node_id"`
	}{e.Name, e.Key.Type.String(), e.Key.Resource, e.Node})
	return append(b, data...)
}
