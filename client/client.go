// Package client is the Go client of a dlock server: one Client is one node.
//
// Lock waits for a lock the way docs/DESIGN.md describes: the node's session stream
// is opened before the first /lock, so no grant can be missed; a queued caller
// waits for lock_assigned (acquired) or operation_completed (skipped: another
// node did the work); a broken stream is reopened with Last-Event-ID; when it
// cannot be held the client polls /status. Do wraps the whole
// lock-work-unlock cycle and cancels the work if the lock is lost. Given
// several servers of one lock service (Client.Servers), a request or the
// stream that fails for its server moves to the next.
package client

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/lock"
)

// Errors a server answers, usable with errors.Is. They are the lock
// package's sentinels, so either name matches.
var (
	ErrInvalid    = lock.ErrInvalid
	ErrLockHeld   = lock.ErrLockHeld
	ErrNotHolder  = lock.ErrNotHolder
	ErrStaleToken = lock.ErrStaleToken
	ErrInUse      = lock.ErrInUse
	ErrDeleting   = lock.ErrDeleting
	ErrUpdating   = lock.ErrUpdating
	// ErrNotFound is an unknown path, or a refcount call to a server
	// without server-side reference counting.
	ErrNotFound = api.ErrNotFound
	// ErrUnavailable is a server that is shutting down.
	ErrUnavailable = api.ErrUnavailable
	// ErrUnauthorized (401) is a request without a credential the server
	// knows: no token, an unknown one, no client certificate.
	// ErrForbidden (403) is a credential of another node than the one
	// named, or a node's credential on an operator's route. Neither is
	// retried (docs/SECURITY.md).
	ErrUnauthorized = api.ErrUnauthorized
	ErrForbidden    = api.ErrForbidden
	// ErrLockLost is the cause of a Result's Lost context: the server no
	// longer has this node as the holder (expired, session lost, restarted).
	ErrLockLost = errors.New("dlock: lock lost")
	// ErrReleased is what Result.Err says once this client let the hold go
	// itself (Unlock): Lost closes then too.
	ErrReleased = errors.New("dlock: lock released")
	// ErrClosed is returned by calls on a closed Client.
	ErrClosed = errors.New("dlock: client closed")
	// ErrAnswerTooLarge is an answer longer than the client reads (a
	// body over MaxAnswer, an event line over MaxEventLine): the server
	// is broken or hostile, and the answer is refused, not truncated.
	ErrAnswerTooLarge = errors.New("dlock: answer too large")
	// Refusals for load (429 too_many_sessions and queue_full, 503
	// overloaded and too_many_keys). They are retried after the answer's
	// Retry-After; the one that outlasts MaxRetries is returned.
	ErrOverloaded      = api.ErrOverloaded
	ErrTooManySessions = lock.ErrTooManySessions
	ErrQueueFull       = lock.ErrQueueFull
	ErrTooManyKeys     = lock.ErrTooManyKeys
)

// Bounds on what the client reads and waits for, so that a broken or
// hostile server cannot grow its memory or park it (docs/SECURITY.md).
const (
	// MaxAnswer bounds the body of an answer to a short request. The
	// largest legitimate one, a refcount naming thousands of nodes, is
	// far smaller.
	MaxAnswer = 4 << 20
	// MaxEventLine bounds one line of the session stream. The server's
	// events are under 16 KiB: ids are at most 768 bytes and error texts
	// 1 KiB, even when JSON escapes every byte.
	MaxEventLine = 64 << 10
	// MaxRetryAfter caps the pause a server's Retry-After asks for.
	MaxRetryAfter = 30 * time.Second
)

// DefaultLeaseMargin is Client.LeaseMargin's default.
const DefaultLeaseMargin = time.Second

// MaxGuarantee caps what one server's answer may vouch for: a longer
// guaranteed_ms (a server with a bug, or a hostile one) is taken as this
// long, a negative one as 0. A hold is confirmed far more often anyway
// (every third of its guarantee, at most RenewInterval apart), so the cap
// costs a sane server nothing; it bounds how long a client cut off from
// every server goes on believing a lying one, and keeps the lease's time
// arithmetic far from overflowing.
const MaxGuarantee = 24 * time.Hour

// Client talks to a dlock server as one node. Set the exported fields
// before the first call; the zero value of every field but Node works. A
// Client is safe for concurrent use; Close it when done.
type Client struct {
	// Server is the server's base URL. Default http://127.0.0.1:7380.
	Server string
	// Servers, instead of Server, are the base URLs of several servers of
	// one lock service (one backend: the same epoch and event ids on
	// each), all http:// or all https://. Every request and the session
	// stream go to one of them, the first to begin with, and stay there
	// while it answers. An attempt that fails for the server (a network
	// error, a timeout, a 502, 503 or 504) moves the client to the next,
	// round the list; whether the request is tried again is MaxRetries'
	// rule, as with one server. A session stream that breaks is reopened
	// on the next with its Last-Event-ID, so a node's session and its
	// holds survive if that happens within the server's session grace.
	// Setting both Server and Servers is an error. SplitServers reads a
	// comma-separated list, as --server and DLOCK_SERVER take it.
	Servers []string
	// Node is this client's node id. Required.
	Node string
	// MaxRetries is how often a request that failed for a network error,
	// a timeout, or a 429/502/503/504 is retried. Default 3; negative:
	// never. A 4xx other than 429 is never retried.
	MaxRetries int
	// RetryInterval is the pause between retries, with ±20 % jitter. A
	// 429 or 503 waits for its Retry-After instead (at most
	// MaxRetryAfter, plus up to 20 %), or without one backs off from
	// RetryInterval, doubling. With several Servers, a retry that moves
	// to a server not yet tried since the last pause goes at once: the
	// pause comes when every server has failed in turn.
	RetryInterval time.Duration
	// RequestTimeout bounds one attempt of a short request. Default 2 s:
	// a server that does not answer (frozen, or cut off) is left for the
	// next of Servers within it (docs/DESIGN.md, "Leases").
	RequestTimeout time.Duration
	// PollInterval is how often a waiter polls /status while the session
	// stream is down (seed 000: 500 ms). While the stream is up it polls
	// ten times less often, as a safety net.
	PollInterval time.Duration
	// RenewInterval is how often held locks are checked and their ttl
	// leases renewed with /status when the server gives no guarantee.
	// Default 10 s. A hold the server guarantees (every server of this
	// version does) is confirmed every third of its guarantee instead.
	RenewInterval time.Duration
	// LeaseMargin is how long before the end of a server's guarantee a
	// hold is taken as lost (Result.Lost closes, Do cancels fn with
	// ErrLockLost), at most a quarter of the guarantee: the time the
	// caller has to stop its work before any server may hand the lock on,
	// and the bound on how far this machine's clock may run slow against
	// the servers'. Default DefaultLeaseMargin (docs/DESIGN.md, "Leases").
	LeaseMargin time.Duration
	// ShortClient sends the short requests; default a keep-alive client.
	ShortClient *http.Client
	// LongClient holds the session stream; it must have no overall timeout.
	LongClient *http.Client
	// LocalAddr, if set, is the local address every connection of the
	// default ShortClient and LongClient dials from (a *net.TCPAddr,
	// usually with port 0): a node with several addresses picks the one
	// its traffic leaves from, and a test cuts exactly this node off by
	// dropping that address (`dlock --source-addr`). A caller that sets
	// ShortClient or LongClient dials as those do.
	LocalAddr net.Addr
	// Logger receives stream reconnects and lost locks; nil discards.
	Logger *slog.Logger
	// TLSConfig is the TLS of an https:// Server (or Servers): the CA that
	// signed the servers' certificates (RootCAs; nil: the system's roots)
	// and, for a server that asks for one, this node's certificate
	// (docs/SECURITY.md). TLSConfigFromFiles builds one. It is used by the
	// default ShortClient and LongClient; a caller that sets those
	// configures their TLS itself. Setting it for http:// servers is an
	// error.
	TLSConfig *tls.Config
	// Token is this node's bearer token, sent as "Authorization: Bearer
	// Token" on every request and on the session stream, to a server run
	// with a token file. It appears in no error and no log line.
	// ReadTokenFile reads one from a file.
	Token string

	initOnce sync.Once
	initErr  error
	bases    []*url.URL     // Server or Servers, parsed
	cur      atomic.Int32   // the index in bases of the server asked now
	owned    []*http.Client // the default clients, whose connections Close ends

	mu      sync.Mutex
	closed  bool
	ctx     context.Context // cancelled by Close: owns the client's goroutines
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	epoch   string
	sess    *session
	waiters map[lock.Key]map[*waiter]struct{}
	held    map[lock.Key]*hold
	gates   map[lock.Key]*gate
	monitor bool // the held-lock monitor runs
}

func (c *Client) init() error {
	c.initOnce.Do(func() {
		servers := c.Servers
		switch {
		case len(servers) > 0 && c.Server != "":
			c.initErr = errors.New("dlock: client: set Server or Servers, not both")
			return
		case len(servers) == 0:
			if c.Server == "" {
				c.Server = "http://127.0.0.1:7380"
			}
			servers = []string{c.Server}
		}
		if c.bases, c.initErr = parseServers(servers); c.initErr != nil {
			return
		}
		if c.TLSConfig != nil && c.bases[0].Scheme != "https" {
			c.initErr = fmt.Errorf("%w: a TLS configuration given for %s", ErrNotHTTPS, servers[0])
			return
		}
		if err := validToken(c.Token); err != nil {
			c.initErr = fmt.Errorf("%w: Token: %v", ErrBadCredentials, err)
			return
		}
		if err := lock.ValidateNode(c.Node); err != nil {
			c.initErr = fmt.Errorf("dlock: client node: %w", err)
			return
		}
		if c.MaxRetries == 0 {
			c.MaxRetries = 3
		}
		if c.RetryInterval <= 0 {
			c.RetryInterval = 200 * time.Millisecond
		}
		if c.RequestTimeout <= 0 {
			c.RequestTimeout = 2 * time.Second
		}
		if c.LeaseMargin <= 0 {
			c.LeaseMargin = DefaultLeaseMargin
		}
		if c.PollInterval <= 0 {
			c.PollInterval = 500 * time.Millisecond
		}
		if c.RenewInterval <= 0 {
			c.RenewInterval = 10 * time.Second
		}
		if c.ShortClient == nil {
			c.ShortClient = &http.Client{Transport: defaultTransport(c.TLSConfig, c.LocalAddr)}
			c.owned = append(c.owned, c.ShortClient)
		}
		if c.LongClient == nil {
			c.LongClient = &http.Client{Transport: defaultTransport(c.TLSConfig, c.LocalAddr)}
			c.owned = append(c.owned, c.LongClient)
		}
		if c.Logger == nil {
			c.Logger = slog.New(slog.DiscardHandler)
		}
		c.ctx, c.cancel = context.WithCancel(context.Background())
		c.waiters = make(map[lock.Key]map[*waiter]struct{})
		c.held = make(map[lock.Key]*hold)
		c.gates = make(map[lock.Key]*gate)
	})
	if c.initErr != nil {
		return c.initErr
	}
	c.mu.Lock()
	closed := c.closed
	c.mu.Unlock()
	if closed {
		return ErrClosed
	}
	return nil
}

// SplitServers reads a comma-separated list of server URLs, as the dlock
// commands take it (--server, DLOCK_SERVER): "http://a:7380,http://b:7380".
// Spaces around a URL are dropped; an empty entry is kept, for the Client
// (or CredentialFiles.Load) to refuse.
func SplitServers(list string) []string {
	servers := strings.Split(list, ",")
	for i, s := range servers {
		servers[i] = strings.TrimSpace(s)
	}
	return servers
}

// parseServers checks a Client's servers: http(s) URLs with a host, all
// of one scheme, so that a token or a client certificate meant for TLS is
// never sent in clear to one of them.
func parseServers(servers []string) ([]*url.URL, error) {
	bases := make([]*url.URL, len(servers))
	for i, s := range servers {
		u, err := url.Parse(strings.TrimSuffix(s, "/"))
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return nil, fmt.Errorf("dlock: server %q is not an http(s) URL", s)
		}
		if i > 0 && u.Scheme != bases[0].Scheme {
			return nil, fmt.Errorf("dlock: servers %q and %q: all servers are http:// or all https://", servers[0], s)
		}
		bases[i] = u
	}
	return bases, nil
}

// server returns the server to ask now, and its index for moveOn.
func (c *Client) server() (int, *url.URL) {
	i := int(c.cur.Load())
	return i, c.bases[i]
}

// moveOn leaves server i, which failed, for the next of the list, unless
// another request or the stream left it already: the client stays on a
// server while it answers, and a failure moves it once, not once per
// request that saw it.
func (c *Client) moveOn(i int) {
	n := len(c.bases)
	if n > 1 && c.cur.CompareAndSwap(int32(i), int32((i+1)%n)) {
		c.Logger.Info("dlock server failed, moving to the next", "node", c.Node, "failed", c.bases[i].String(), "next", c.bases[(i+1)%n].String())
	}
}

// serverNames lists the servers, for an error.
func (c *Client) serverNames() string {
	names := make([]string, len(c.bases))
	for i, u := range c.bases {
		names[i] = u.String()
	}
	return strings.Join(names, ",")
}

// defaultTransport speaks HTTP/1.1 only, also over TLS. The server answers
// keep-alive HTTP/1.1 /lock, /unlock and /cancel on its lean loop, and h2
// only through net/http (docs/DESIGN.md, "One request entry point"); each
// session stream has a connection of its own either way. And over h2 a
// client certificate the server refuses after a TLS 1.3 handshake reaches
// the caller as "client conn could not be established", without the
// alert, which would be retried as a network error. Its connections
// leave from local when that is set (Client.LocalAddr).
func defaultTransport(tlsConfig *tls.Config, local net.Addr) *http.Transport {
	t := http.DefaultTransport.(*http.Transport).Clone()
	if local != nil {
		// http.DefaultTransport's dialer, from local.
		d := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second, LocalAddr: local}
		t.DialContext = d.DialContext
	}
	t.MaxIdleConnsPerHost = 64
	t.ForceAttemptHTTP2 = false
	t.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
	if tlsConfig != nil {
		t.TLSClientConfig = tlsConfig.Clone()
		t.TLSClientConfig.NextProtos = []string{"http/1.1"}
	}
	return t
}

// authorize adds the node's token to a request.
func (c *Client) authorize(req *http.Request) {
	if c.Token != "" {
		req.Header.Set("Authorization", "Bearer "+c.Token)
	}
}

// Close stops the session stream and the held-lock monitor, ends every call
// that waits with ErrClosed (a Lock or Acquire in line leaves it first),
// and closes the idle connections of the default ShortClient and
// LongClient. It does not unlock anything: held locks are released by the
// server when the session's grace or their ttl runs out.
func (c *Client) Close() error {
	if err := c.init(); err != nil && !errors.Is(err, ErrClosed) {
		return err
	}
	c.mu.Lock()
	c.closed = true
	c.mu.Unlock()
	c.cancel()
	c.wg.Wait()
	for _, hc := range c.owned {
		hc.CloseIdleConnections()
	}
	return nil
}

// Epoch returns the server epoch last seen ("" before the first answer).
func (c *Client) Epoch() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.epoch
}

// sawEpoch notes the epoch of an answer. A change means the server forgot
// every hold: the locks this node held are lost.
func (c *Client) sawEpoch(e string) {
	if e == "" {
		return
	}
	c.mu.Lock()
	old := c.epoch
	c.epoch = e
	var lost []*hold
	if old != "" && old != e {
		for _, h := range c.held {
			lost = append(lost, h)
		}
	}
	c.mu.Unlock()
	if len(lost) > 0 {
		c.Logger.Warn("dlock server restarted: held locks are lost", "old_epoch", old, "epoch", e)
	}
	for _, h := range lost {
		h.lose()
	}
}

// call sends one short request, retrying network errors, timeouts, 502 and
// 504 after RetryInterval and load refusals (429, 503) after their
// Retry-After, up to MaxRetries; any other 4xx is never retried. A pause
// that would end past ctx's deadline is not taken. out may be nil.
//
// With several servers, an attempt that failed for its server moves the
// client to the next (moveOn), and the retry, if any, goes there at once;
// the pause is taken when every server has failed since the last one.
func (c *Client) call(ctx context.Context, method, path string, query url.Values, in, out any) error {
	var body []byte
	if in != nil {
		var err error
		if body, err = json.Marshal(in); err != nil {
			return err
		}
	}
	rawQuery := query.Encode()
	var err error
	tried, pauses := 0, 0 // servers that failed since the last pause; pauses taken
	for attempt := 0; ; attempt++ {
		i, base := c.server()
		u := *base
		u.Path += path
		u.RawQuery = rawQuery
		var r retry
		r, err = c.once(ctx, method, u.String(), body, out)
		if err != nil && r.elsewhere && ctx.Err() == nil {
			c.moveOn(i)
		}
		if err == nil || r.kind == noRetry || attempt >= c.MaxRetries || ctx.Err() != nil {
			break
		}
		if tried++; r.elsewhere && tried < len(c.bases) {
			continue // the next server, which has not failed yet
		}
		tried = 0
		pause := c.retryPause(r, pauses)
		pauses++
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) < pause {
			return fmt.Errorf("%w (not retried: the next attempt, in %v, is past the deadline)", err, pause.Round(time.Millisecond))
		}
		t := time.NewTimer(pause)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return errors.Join(err, ctx.Err())
		}
	}
	return err
}

type retryKind int

const (
	noRetry   retryKind = iota
	retryNet            // a network error, a timeout, a 502 or 504
	retryLoad           // 429 or 503: the server refused for load
)

// retry says whether and when a failed attempt may be repeated.
type retry struct {
	kind  retryKind
	after time.Duration // the answer's Retry-After; 0: none
	// elsewhere: the failure is the server's (retryNet, or a 503: shutting
	// down, or at its connection limit), so another server of the list
	// may answer. A 429 is the lock service's answer to this node (its
	// sessions, the key's queue), the same on every server.
	elsewhere bool
}

// retryPause is the pause after the nth pause taken. A server's Retry-After
// is honoured, capped, with jitter added (never subtracted), so that the
// clients it refused at once do not all come back in the same instant.
func (c *Client) retryPause(r retry, n int) time.Duration {
	switch {
	case r.after > 0:
		d := min(r.after, MaxRetryAfter)
		return d + time.Duration(rand.Int64N(int64(d)/5+1))
	case r.kind == retryLoad:
		d := c.RetryInterval
		for range min(n, 16) {
			d *= 2
		}
		return jitter(min(d, MaxRetryAfter))
	default:
		return jitter(c.RetryInterval)
	}
}

func jitter(d time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
}

// retryAfter reads a Retry-After header: delay-seconds or an HTTP date.
func retryAfter(h http.Header) time.Duration {
	v := strings.TrimSpace(h.Get("Retry-After"))
	if v == "" {
		return 0
	}
	if n, err := strconv.ParseInt(v, 10, 64); err == nil {
		if n <= 0 {
			return 0
		}
		return time.Duration(min(n, int64(MaxRetryAfter/time.Second))) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil {
		return max(time.Until(t), 0)
	}
	return 0
}

// readAnswer reads a whole answer body, at most MaxAnswer bytes.
func readAnswer(r io.Reader) ([]byte, error) {
	data, err := io.ReadAll(io.LimitReader(r, MaxAnswer+1))
	if err == nil && len(data) > MaxAnswer {
		return nil, fmt.Errorf("%w: over %d bytes", ErrAnswerTooLarge, MaxAnswer)
	}
	return data, err
}

func (c *Client) once(ctx context.Context, method, u string, body []byte, out any) (retry, error) {
	ctx, cancel := context.WithTimeout(ctx, c.RequestTimeout)
	defer cancel()
	var r io.Reader
	if body != nil {
		r = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, u, r)
	if err != nil {
		return retry{}, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	c.authorize(req)
	resp, err := c.ShortClient.Do(req)
	if err != nil {
		return netRetry(err), fmt.Errorf("dlock: %s %s: %w", method, u, err)
	}
	defer resp.Body.Close()
	c.sawEpoch(resp.Header.Get(api.EpochHeader))
	data, err := readAnswer(resp.Body)
	if errors.Is(err, ErrAnswerTooLarge) {
		return retry{}, fmt.Errorf("dlock: %s %s: HTTP %d: %w", method, u, resp.StatusCode, err)
	}
	if err != nil {
		return retry{kind: retryNet, elsewhere: true}, fmt.Errorf("dlock: %s %s: reading the answer: %w", method, u, err)
	}
	if resp.StatusCode != http.StatusOK {
		var eb api.ErrorBody
		if json.Unmarshal(data, &eb) != nil || eb.Code == "" {
			eb = api.ErrorBody{Code: "http_" + fmt.Sprint(resp.StatusCode), Message: strings.TrimSpace(string(data))}
		}
		// An error carries at most 1 KiB of the server's text, as the
		// server keeps its own (docs/API.md).
		eb.Message, eb.Error = clip(eb.Message), clip(eb.Error)
		var rt retry
		switch resp.StatusCode {
		case http.StatusTooManyRequests:
			rt = retry{kind: retryLoad, after: retryAfter(resp.Header)}
		case http.StatusServiceUnavailable:
			rt = retry{kind: retryLoad, after: retryAfter(resp.Header), elsewhere: true}
		case http.StatusBadGateway, http.StatusGatewayTimeout:
			rt = retry{kind: retryNet, elsewhere: true}
		}
		return rt, notDlock(method, u, resp.StatusCode, resp.Header.Get("Content-Type"), data, api.ErrorFromResponse(resp.StatusCode, eb))
	}
	if out != nil {
		if err := json.Unmarshal(data, out); err != nil {
			return retry{}, notDlock(method, u, resp.StatusCode, resp.Header.Get("Content-Type"), data, fmt.Errorf("dlock: %s %s: bad answer: %w", method, u, err))
		}
	}
	return retry{}, nil
}

// clip keeps the first KiB of a server's error text, marked with "…".
func clip(s string) string {
	const limit = 1 << 10
	if len(s) <= limit {
		return s
	}
	s = s[:limit]
	for i := 0; i < 3 && !utf8.ValidString(s); i++ {
		s = s[:len(s)-1]
	}
	return s + "…"
}

func netRetry(err error) retry {
	if retryable(err) {
		return retry{kind: retryNet, elsewhere: true}
	}
	return retry{}
}

// retryable reports network errors and timeouts; a cancelled caller is not.
// Neither is a TLS refusal, the same at every attempt.
func retryable(err error) bool {
	if errors.Is(err, context.Canceled) || tlsRefused(err) {
		return false
	}
	var ne net.Error
	return errors.As(err, &ne) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, context.DeadlineExceeded)
}

// tlsRefused reports a handshake that failed for the credentials: the
// server's certificate does not verify, or the server refused this
// node's certificate (a TLS alert from the server: none, unknown CA,
// expired).
func tlsRefused(err error) bool {
	if _, ok := errors.AsType[*tls.CertificateVerificationError](err); ok {
		return true
	}
	oe, ok := errors.AsType[*net.OpError](err)
	return ok && oe.Op == "remote error"
}
