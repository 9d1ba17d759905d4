// Package client is the Go client of a dlock server: one Client is one node.
//
// Lock waits for a lock the way SPEC §6 describes: the node's session stream
// is opened before the first /lock, so no grant can be missed; a queued caller
// waits for lock_assigned (acquired) or operation_completed (skipped: another
// node did the work); a broken stream is reopened with Last-Event-ID; when it
// cannot be held the client polls /status. Do wraps the whole
// lock-work-unlock cycle and cancels the work if the lock is lost.
package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/dlock/dlock/internal/wire"
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
	ErrNotFound = wire.ErrNotFound
	// ErrUnavailable is a server that is shutting down.
	ErrUnavailable = wire.ErrUnavailable
	// ErrLockLost is the cause of a Result's Lost context: the server no
	// longer has this node as the holder (expired, session lost, restarted).
	ErrLockLost = errors.New("dlock: lock lost")
	// ErrClosed is returned by calls on a closed Client.
	ErrClosed = errors.New("dlock: client closed")
)

// Client talks to one dlock server as one node. Set the exported fields
// before the first call; the zero value of every field but Node works. A
// Client is safe for concurrent use; Close it when done.
type Client struct {
	// Server is the server's base URL. Default http://127.0.0.1:7380.
	Server string
	// Node is this client's node id. Required.
	Node string
	// MaxRetries is how often a request that failed for a network error,
	// a timeout or a 502/503/504 is retried. Default 3; negative: never.
	MaxRetries int
	// RetryInterval is the pause between retries, with ±20 % jitter.
	// Default 200 ms.
	RetryInterval time.Duration
	// RequestTimeout bounds one short request. Default 5 s.
	RequestTimeout time.Duration
	// PollInterval is how often a waiter polls /status while the session
	// stream is down (seed 000: 500 ms). While the stream is up it polls
	// ten times less often, as a safety net.
	PollInterval time.Duration
	// RenewInterval is how often held locks are checked and their ttl
	// leases renewed with /status. Default 10 s.
	RenewInterval time.Duration
	// ShortClient sends the short requests; default a keep-alive client.
	ShortClient *http.Client
	// LongClient holds the session stream; it must have no overall timeout.
	LongClient *http.Client
	// Logger receives stream reconnects and lost locks; nil discards.
	Logger *slog.Logger

	initOnce sync.Once
	initErr  error
	base     *url.URL

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
		if c.Server == "" {
			c.Server = "http://127.0.0.1:7380"
		}
		u, err := url.Parse(strings.TrimSuffix(c.Server, "/"))
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			c.initErr = fmt.Errorf("dlock: server %q is not an http(s) URL", c.Server)
			return
		}
		c.base = u
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
			c.RequestTimeout = 5 * time.Second
		}
		if c.PollInterval <= 0 {
			c.PollInterval = 500 * time.Millisecond
		}
		if c.RenewInterval <= 0 {
			c.RenewInterval = 10 * time.Second
		}
		if c.ShortClient == nil {
			c.ShortClient = &http.Client{Transport: defaultTransport()}
		}
		if c.LongClient == nil {
			c.LongClient = &http.Client{Transport: defaultTransport()}
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

func defaultTransport() *http.Transport {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConnsPerHost = 64
	return t
}

// Close stops the session stream and the held-lock monitor. It does not
// unlock anything: held locks are released by the server when the session's
// grace or their ttl runs out.
func (c *Client) Close() error {
	if err := c.init(); err != nil && !errors.Is(err, ErrClosed) {
		return err
	}
	c.mu.Lock()
	c.closed = true
	c.mu.Unlock()
	c.cancel()
	c.wg.Wait()
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

// call sends one short request, retrying network errors, timeouts and
// 502/503/504 up to MaxRetries; a 4xx is never retried. out may be nil.
func (c *Client) call(ctx context.Context, method, path string, query url.Values, in, out any) error {
	var body []byte
	if in != nil {
		var err error
		if body, err = json.Marshal(in); err != nil {
			return err
		}
	}
	u := *c.base
	u.Path += path
	u.RawQuery = query.Encode()
	var err error
	for attempt := 0; ; attempt++ {
		var retry bool
		retry, err = c.once(ctx, method, u.String(), body, out)
		if err == nil || !retry || attempt >= c.MaxRetries || ctx.Err() != nil {
			break
		}
		pause := time.Duration(float64(c.RetryInterval) * (0.8 + 0.4*rand.Float64()))
		select {
		case <-time.After(pause):
		case <-ctx.Done():
			return errors.Join(err, ctx.Err())
		}
	}
	return err
}

func (c *Client) once(ctx context.Context, method, u string, body []byte, out any) (retry bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, c.RequestTimeout)
	defer cancel()
	var r io.Reader
	if body != nil {
		r = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, u, r)
	if err != nil {
		return false, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.ShortClient.Do(req)
	if err != nil {
		return retryable(err), fmt.Errorf("dlock: %s %s: %w", method, u, err)
	}
	defer resp.Body.Close()
	c.sawEpoch(resp.Header.Get(wire.EpochHeader))
	data, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return true, fmt.Errorf("dlock: %s %s: reading the answer: %w", method, u, err)
	}
	if resp.StatusCode != http.StatusOK {
		var eb wire.Error
		if json.Unmarshal(data, &eb) != nil || eb.Code == "" {
			eb = wire.Error{Code: "http_" + fmt.Sprint(resp.StatusCode), Message: strings.TrimSpace(string(data))}
		}
		switch resp.StatusCode {
		case http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
			retry = true
		}
		return retry, wire.ErrorFor(resp.StatusCode, eb)
	}
	if out != nil {
		if err := json.Unmarshal(data, out); err != nil {
			return false, fmt.Errorf("dlock: %s %s: bad answer: %w", method, u, err)
		}
	}
	return false, nil
}

// retryable reports network errors and timeouts; a cancelled caller is not.
func retryable(err error) bool {
	if errors.Is(err, context.Canceled) {
		return false
	}
	var ne net.Error
	return errors.As(err, &ne) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, context.DeadlineExceeded)
}
