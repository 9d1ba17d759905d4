package client

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/lock"
)

// session is the node's event stream, shared by every wait of the Client.
// One goroutine, owned by the Client, holds it open and reopens it.
type session struct {
	c *Client

	mu      sync.Mutex
	up      bool
	tried   chan struct{} // closed after the first connection attempt
	changed chan struct{} // closed and replaced whenever up changes
	lastID  uint64
	hasLast bool
	lastErr error // why the stream last went down
}

// ensureSession starts the stream if needed and waits for its first
// connection attempt, so that a /lock sent next cannot miss its grant.
// Failure is not an error: waits fall back to polling.
func (c *Client) ensureSession(ctx context.Context) *session {
	c.mu.Lock()
	s := c.sess
	if s == nil {
		s = &session{c: c, tried: make(chan struct{}), changed: make(chan struct{})}
		if c.closed {
			// Close has begun (under c.mu, as here) and may be in its
			// Wait: no goroutine starts. A stream that is never up
			// makes a wait poll, as for a server out of reach.
			s.lastErr = ErrClosed
			close(s.tried)
			c.mu.Unlock()
			return s
		}
		c.sess = s
		c.wg.Go(s.run)
	}
	c.mu.Unlock()
	select {
	case <-s.tried:
	case <-ctx.Done():
	}
	return s
}

// state returns whether the stream is up and a channel closed at the next change.
func (s *session) state() (bool, <-chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.up, s.changed
}

func (s *session) setUp(up bool) {
	s.mu.Lock()
	if s.up != up {
		s.up = up
		close(s.changed)
		s.changed = make(chan struct{})
	}
	s.mu.Unlock()
}

func (s *session) run() {
	ctx := s.c.ctx
	backoff := 50 * time.Millisecond
	first := true
	failed := 0 // attempts that failed since the last pause
	for {
		connected, err := s.stream(ctx, &first)
		s.mu.Lock()
		s.lastErr = err
		s.mu.Unlock()
		s.setUp(false)
		// With several servers, a stream that failed for its server
		// is reopened on the next at once, within the session's grace
		// (docs/DESIGN.md, "What a client does"); the pause comes when
		// every server has failed in turn.
		if failed++; ctx.Err() == nil && streamElsewhere(err) && failed < len(s.c.bases) {
			s.c.Logger.Info("session stream broken, reconnecting to the next server", "node", s.c.Node, "err", err)
			continue
		}
		failed = 0
		pause := time.Duration(float64(backoff) * (0.8 + 0.4*rand.Float64()))
		level := slog.LevelInfo
		ra, isRefusal := errors.AsType[*refusedError](err)
		switch {
		case isRefusal && ra.after > 0:
			// A refusal for load (too many sessions): come back when asked.
			pause = max(pause, min(ra.after, MaxRetryAfter)+time.Duration(rand.Int64N(int64(ra.after)/5+1)))
		case isRefusal && (ra.status == http.StatusUnauthorized || ra.status == http.StatusForbidden), tlsRefused(err):
			// Refused credentials stay refused until an operator
			// changes the server's token file or certificates: ask
			// again seldom, and say so loudly. Requests meet the same
			// refusal and return it.
			backoff = maxStreamBackoff
			pause = jitter(maxStreamBackoff)
			level = slog.LevelWarn
		}
		if first {
			first = false
			close(s.tried)
		}
		if ctx.Err() != nil {
			return
		}
		if connected {
			backoff = 50 * time.Millisecond
		}
		s.c.Logger.Log(ctx, level, "session stream broken, reconnecting", "node", s.c.Node, "err", err, "in", pause)
		select {
		case <-time.After(pause):
		case <-ctx.Done():
			return
		}
		backoff = min(2*backoff, maxStreamBackoff)
	}
}

// maxStreamBackoff is the longest pause between two attempts to open the stream.
const maxStreamBackoff = 5 * time.Second

// stream holds one connection until it breaks. A stream that breaks for
// its server moves the client to the next server of its list, where it is
// reopened with its Last-Event-ID: event ids are valid on every server of
// one lock service, and a new epoch there is handled as a restart is
// (sawEpoch).
func (s *session) stream(ctx context.Context, first *bool) (connected bool, err error) {
	c := s.c
	i, base := c.server()
	closing := ctx // the Client's: ended by Close, not by the stream
	defer func() {
		if closing.Err() == nil && streamElsewhere(err) {
			c.moveOn(i)
		}
	}()
	u := *base
	u.Path += "/subscribe"
	u.RawQuery = url.Values{"node_id": {c.Node}}.Encode()
	// Only the connection phase is bounded: the stream itself lives on.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	timer := time.AfterFunc(c.RequestTimeout, cancel)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return false, err
	}
	s.mu.Lock()
	if s.hasLast {
		req.Header.Set("Last-Event-ID", strconv.FormatUint(s.lastID, 10))
	}
	s.mu.Unlock()
	req.Header.Set("Accept", "text/event-stream")
	c.authorize(req)
	resp, err := c.LongClient.Do(req)
	if !timer.Stop() && err == nil {
		resp.Body.Close()
		return false, fmt.Errorf("subscribe: no answer within %v", c.RequestTimeout)
	}
	if err != nil {
		return false, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return false, refused(resp)
	}
	silence := silenceBound(resp.Header.Get(api.PingHeader))
	var silent atomic.Bool
	watchdog := time.AfterFunc(silence, func() { silent.Store(true); cancel() })
	defer watchdog.Stop()
	// The buffer is the bound on a line: a longer one is a broken stream,
	// dropped and reopened like any other.
	r := bufio.NewReaderSize(resp.Body, MaxEventLine)
	var id, name, data string
	for {
		raw, err := r.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			return connected, fmt.Errorf("subscribe: %w: an event line over %d bytes", ErrAnswerTooLarge, MaxEventLine)
		}
		if err != nil {
			if silent.Load() {
				return connected, fmt.Errorf("%w: the session stream was silent for %v", errStreamSilent, silence)
			}
			return connected, err
		}
		watchdog.Reset(silence)
		line := strings.TrimRight(string(raw), "\r\n")
		switch {
		case line == "":
			if name == "" {
				continue
			}
			if name == "subscribed" {
				var ev api.Event
				if err := json.Unmarshal([]byte(data), &ev); err != nil {
					return connected, fmt.Errorf("subscribed event: %w", err)
				}
				c.sawEpoch(ev.Epoch)
				connected = true
				s.setUp(true)
				if *first {
					*first = false
					close(s.tried)
				}
			} else {
				s.dispatch(name, data)
			}
			if v, err := strconv.ParseUint(id, 10, 64); err == nil {
				s.mu.Lock()
				s.lastID, s.hasLast = v, true
				s.mu.Unlock()
			}
			id, name, data = "", "", ""
		case strings.HasPrefix(line, ":"):
		case strings.HasPrefix(line, "id:"):
			id = strings.TrimSpace(line[3:])
		case strings.HasPrefix(line, "event:"):
			name = strings.TrimSpace(line[6:])
		case strings.HasPrefix(line, "data:"):
			data = strings.TrimPrefix(line[5:], " ")
		}
	}
}

// maxPingMs bounds the ping interval a server may announce: an hour.
const maxPingMs = 3600 * 1000

// silenceBound is how long a stream may hear nothing before it is taken
// for one on a server that hung or was cut off: twice the ping interval
// the server announced (its Dlock-Ping-Ms header), and a second, so that it
// is left and reopened on the next server (docs/DESIGN.md, "Leases"). A
// server that does not say pings at least every 15 s. The header is
// bounded before the arithmetic: a broken or hostile server's must not
// overflow into a watchdog that fires at once, or never.
func silenceBound(header string) time.Duration {
	ping := 15 * time.Second
	if ms, err := strconv.ParseInt(header, 10, 64); err == nil && ms > 0 {
		ping = min(time.Duration(ms), maxPingMs) * time.Millisecond
	}
	return 2*ping + time.Second
}

// errStreamSilent is a stream that heard nothing, not even a ping, for
// twice the server's ping interval.
var errStreamSilent = errors.New("dlock: session stream silent")

// streamElsewhere reports a stream that failed for its server, so that
// another server may hold it: a network error, a stream that ended or
// broke, a 502, 503 or 504. A refusal of the credentials (401, 403, a TLS
// refusal) or for this node's sessions (429) would be the same on every
// server.
func streamElsewhere(err error) bool {
	if ra, ok := errors.AsType[*refusedError](err); ok {
		switch ra.status {
		case http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
			return true
		}
		return false
	}
	return err != nil && !tlsRefused(err)
}

// refusedError is a /subscribe answered with another status than 200.
type refusedError struct {
	status int
	after  time.Duration // its Retry-After
	err    error         // the server's error body, as an *api.Error
}

func (e *refusedError) Error() string { return "subscribe: " + e.err.Error() }

// Unwrap gives the *api.Error, so that errors.Is matches its code's sentinel.
func (e *refusedError) Unwrap() error { return e.err }

// refused reads a refusal's error body (its first KiB is all an error keeps).
func refused(resp *http.Response) *refusedError {
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
	var eb api.ErrorBody
	if json.Unmarshal(data, &eb) != nil || eb.Code == "" {
		eb = api.ErrorBody{Code: "http_" + strconv.Itoa(resp.StatusCode), Message: strings.TrimSpace(string(data))}
	}
	eb.Message, eb.Error = clip(eb.Message), clip(eb.Error)
	err := api.ErrorFromResponse(resp.StatusCode, eb)
	if resp.Request != nil {
		err = notDlock(resp.Request.Method, resp.Request.URL.String(), resp.StatusCode, resp.Header.Get("Content-Type"), data, err)
	}
	return &refusedError{status: resp.StatusCode, after: retryAfter(resp.Header), err: err}
}

// dispatch turns an event into a hint for this node's waiter on the key.
func (s *session) dispatch(name, data string) {
	var ev api.Event
	if err := json.Unmarshal([]byte(data), &ev); err != nil {
		s.c.Logger.Warn("undecodable event", "event", name, "err", err)
		return
	}
	// A type this client never asked for has no waiter here; looking it
	// up, not parsing it, keeps a server's names out of the client's
	// table of types.
	t, ok := lock.LookupType(ev.Type)
	if !ok {
		return
	}
	k := lock.Key{Type: t, Resource: ev.ResourceID}
	var h hint
	switch {
	case name == lock.EventLockAssigned && ev.NodeID == s.c.Node:
		h = hint{kind: hintAssigned}
	case name == lock.EventOperationCompleted && ev.Success:
		h = hint{kind: hintDone, by: ev.NodeID}
	case name == lock.EventOperationCompleted && ev.NodeID == s.c.Node && ev.Error == api.CodeInUse:
		h = hint{kind: hintRefused}
	default:
		return
	}
	s.c.hintWaiters(k, h)
}

// Connect opens the node's session stream now, as Lock does on demand, and
// reports an error when it is not up. Holds and queue places taken with
// LeaseSession afterwards live as long as this Client keeps the stream.
func (c *Client) Connect(ctx context.Context) error {
	if err := c.init(); err != nil {
		return err
	}
	s := c.ensureSession(ctx)
	if up, _ := s.state(); !up {
		if err := ctx.Err(); err != nil {
			return err
		}
		s.mu.Lock()
		why := s.lastErr
		s.mu.Unlock()
		if why == nil {
			return fmt.Errorf("dlock: no session stream to %s", c.serverNames())
		}
		return fmt.Errorf("dlock: no session stream to %s: %w", c.serverNames(), why)
	}
	return nil
}
