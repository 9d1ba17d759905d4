package client

import (
	"context"
	"errors"
	"net/url"
	"sync"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/lock"
)

// Request names a lock.
type Request struct {
	// Type is lock.Pull, lock.Update or lock.Delete, or another type from
	// lock.ParseType, such as the original design's "image-layer"
	// (docs/DESIGN.md, "Other types").
	Type     lock.Type
	Resource string
	// SkipRecent answers Skipped, without a grant, when the key is free and
	// its last completion, still retained by the server, was a success.
	SkipRecent bool
	// Lease is the lease asked for; LeaseAuto (the default) is a session
	// lease, since Lock opens the session stream first.
	Lease lock.Lease
}

func (r Request) key() lock.Key { return lock.Key{Type: r.Type, Resource: r.Resource} }

// prepare readies the client and checks the request: every call's first step.
func (c *Client) prepare(req Request) error {
	if err := c.init(); err != nil {
		return err
	}
	return req.validate()
}

func (r Request) validate() error {
	return lock.ValidateKey(r.Type, r.Resource, "-")
}

// Result is the outcome of Lock: Acquired or Skipped.
type Result struct {
	// Acquired: this node holds the lock; call Unlock when done.
	Acquired bool
	// Skipped: the work was done, by SkippedBy when known; do not Unlock.
	Skipped   bool
	SkippedBy string
	// Token is the grant's fencing token.
	Token uint64
	// Lost is closed when the lock is lost while held: the server no longer
	// has this node as its holder (lease expired, session lost, restart),
	// or no server confirmed the hold within the lease it guaranteed, which
	// closes Lost at least Margin before any server may hand the lock on
	// (docs/DESIGN.md, "Leases"). It is closed by Unlock and Close too:
	// Err tells them apart.
	Lost <-chan struct{}
	// Margin is, when the server guaranteed the hold, how long at least
	// before the earliest hand-over Lost closes: the time the caller has to
	// stop its work (dlock run: SIGTERM, then SIGKILL half of it later).
	// 0 from a server that gives no guarantee.
	Margin time.Duration
	// LeaseEnds receives the end of the client-side lease, the moment at
	// which Lost closes unless a confirmation comes first: once for the
	// grant, and again each time a confirmation moves the end, which is
	// only ever later. It holds the newest end only, so a reader that falls
	// behind reads the latest one, never a stale one. The times carry the
	// monotonic clock: use them as durations (time.Until), never as wall
	// clock times. Nothing is sent while the servers give no guarantee
	// (Margin 0), and it is never closed: stop reading once Lost closes.
	// dlock run hands each end to its watchdog process, which stops the
	// command when dlock run cannot (docs/DESIGN.md, "Leases").
	LeaseEnds <-chan time.Time

	hold context.Context // Lost's context: its cause is Err's answer
}

// Err says why Lost closed: nil while it is open (the hold stands, as far
// as the client knows), ErrLockLost when the lock was lost (an Unlock
// refused with ErrNotHolder or ErrStaleToken included: it was lost before
// it was let go), ErrReleased when this client let it go (Unlock,
// Release), ErrClosed when the Client was closed. A Result that is not a
// grant has no hold: Err is nil.
func (r Result) Err() error {
	if r.hold == nil || r.hold.Err() == nil {
		return nil
	}
	switch cause := context.Cause(r.hold); {
	case errors.Is(cause, ErrLockLost), errors.Is(cause, ErrReleased):
		return cause
	default:
		return ErrClosed
	}
}

type hintKind int

const (
	hintAssigned hintKind = iota // lock_assigned to this node
	hintDone                     // operation_completed{success}: skip
	hintRefused                  // refused when promoted (in_use)
)

type hint struct {
	kind hintKind
	by   string
}

// waiter receives the stream's hints about one key while a Lock waits.
type waiter struct{ hints chan hint }

func (c *Client) addWaiter(k lock.Key) *waiter {
	w := &waiter{hints: make(chan hint, 8)}
	c.mu.Lock()
	if c.waiters[k] == nil {
		c.waiters[k] = make(map[*waiter]struct{})
	}
	c.waiters[k][w] = struct{}{}
	c.mu.Unlock()
	return w
}

func (c *Client) removeWaiter(k lock.Key, w *waiter) {
	c.mu.Lock()
	delete(c.waiters[k], w)
	if len(c.waiters[k]) == 0 {
		delete(c.waiters, k)
	}
	c.mu.Unlock()
}

func (c *Client) hintWaiters(k lock.Key, h hint) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for w := range c.waiters[k] {
		select {
		case w.hints <- h:
		default: // a full buffer already holds enough reasons to look again
		}
	}
}

// hold is a lock this client took with Lock; it stays until Unlock, lost
// or not, and owns the key's gate until then. A grant of TryAcquire is a
// hold too, without a gate (tried), until a Release with its token.
type hold struct {
	token  uint64
	ctx    context.Context
	cancel context.CancelCauseFunc
	tried  bool

	// The client-side lease (docs/DESIGN.md, "Leases"): the hold is taken
	// as lost at expires, a margin before the moment the servers
	// guaranteed it to stand to, counted from when this client sent the
	// request they answered. leased is false when the server said nothing
	// of a guarantee (a server older than the lease).
	mu      sync.Mutex
	leased  bool
	expires time.Time
	timer   *time.Timer
	g       time.Duration // the last guarantee: how often to renew
	gmax    time.Duration // the longest guarantee: the margin's scale
	// ends holds the newest expires, for Result.LeaseEnds: a buffer of
	// one, written only under mu, emptied before each write.
	ends chan time.Time
}

func (h *hold) lose() { h.cancel(ErrLockLost) }

// confirm extends the lease: a request sent at sent was answered with a
// guarantee of ms milliseconds. A guarantee ends the lease no sooner than
// an earlier one did; a server that cannot vouch (0) extends nothing.
func (c *Client) confirm(k lock.Key, h *hold, sent time.Time, ms api.Guarantee) {
	if !ms.Set {
		return
	}
	// Clamped before the arithmetic: a negative or absurd answer (int64
	// milliseconds times 1e6 overflows) must neither wrap into a lease of
	// centuries nor move the lease's end at all (MaxGuarantee).
	g := min(time.Duration(max(ms.Ms, 0)), MaxGuarantee/time.Millisecond) * time.Millisecond
	h.mu.Lock()
	defer h.mu.Unlock()
	h.gmax = max(h.gmax, g)
	// The margin follows the longest guarantee, not this one: one that
	// shrinks towards a max hold must leave the whole margin before it.
	expires := sent.Add(g - c.leaseMargin(h.gmax))
	if h.leased && !expires.After(h.expires) {
		return
	}
	h.leased, h.expires, h.g = true, expires, g
	if h.ends != nil {
		select {
		case <-h.ends: // superseded: a reader gets the newest end only
		default:
		}
		h.ends <- expires
	}
	if h.timer != nil {
		h.timer.Stop()
	}
	if !expires.After(time.Now()) {
		// Vouched for nothing (0) or for less than the margin: lost now,
		// not when a timer's goroutine runs, so that a grant that is lost
		// already reaches its caller with Lost closed.
		if h.ctx.Err() == nil {
			c.Logger.Warn("lock lost: its server vouched for less than the lease margin", "key", k.String(), "token", h.token, "lease", g)
			h.lose()
		}
		return
	}
	h.timer = time.AfterFunc(time.Until(expires), func() {
		if h.ctx.Err() == nil {
			c.Logger.Warn("lock lost: no server confirmed it within its lease", "key", k.String(), "token", h.token, "lease", g)
			h.lose()
		}
	})
}

// leaseMargin is how long before the end of a guarantee a hold is taken
// as lost: LeaseMargin, at most a quarter of g, the hold's longest
// guarantee, so that a short session grace still leaves room to renew.
func (c *Client) leaseMargin(g time.Duration) time.Duration {
	return min(c.LeaseMargin, g/4)
}

// renewEvery is how often h is confirmed: a third of its guarantee, so that
// two confirmations may fail before it runs out; RenewInterval without one.
func (h *hold) renewEvery(def time.Duration) time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.leased || h.g == 0 {
		return def
	}
	return max(min(def, h.g/3), 10*time.Millisecond)
}

// valid reports whether h stands by its lease now: false once lost, or
// once the lease's end has passed although its timer has not run yet (a
// process that was paused runs its own code before its timers), in which
// case it is lost now.
func (h *hold) valid() bool {
	if h.ctx.Err() != nil {
		return false
	}
	h.mu.Lock()
	expired := h.leased && !time.Now().Before(h.expires)
	h.mu.Unlock()
	if expired {
		h.lose()
		return false
	}
	return true
}

// Held reports whether this Client holds req's key, by Lock or TryAcquire,
// and its lease still stands: what a holder asks right before a step that
// others can see. Unlike a look at Result.Lost it is exact at the moment
// of the call: a lease whose end has passed while its timer has not yet
// run (the process was paused: a long GC, SIGSTOP, a VM frozen, and runs
// its own code first when it resumes) is lost now, and Lost closes. A
// pause between this call and the step is not covered: the fencing token
// is the defence there (docs/DESIGN.md, "Leases").
func (c *Client) Held(req Request) bool {
	if c.prepare(req) != nil {
		return false
	}
	c.mu.Lock()
	h := c.held[req.key()]
	c.mu.Unlock()
	return h != nil && h.valid()
}

func (h *hold) stop() {
	h.mu.Lock()
	if h.timer != nil {
		h.timer.Stop()
	}
	h.mu.Unlock()
}

// Lock takes the lock, waiting in the server's queue if another node holds
// it. It returns Acquired with the grant's token, or Skipped when another
// node completed the same operation meanwhile (or, with SkipRecent, just
// before). When ctx ends first, the queue entry is cancelled (a grant that
// raced the cancel is given up as a failure) and ctx's error is returned.
//
// Two callers of one Client asking for one key are served one after the
// other; a caller that waited for one of this node's own successful pulls
// or deletes of the key is Skipped.
func (c *Client) Lock(ctx context.Context, req Request) (Result, error) {
	if err := c.prepare(req); err != nil {
		return Result{}, err
	}
	k := req.key()
	g := c.gate(k)
	skipped, err := g.acquire(ctx, c.ctx.Done())
	if err != nil {
		c.putGate(k)
		return Result{}, err
	}
	if skipped && k.Type != lock.Update {
		c.releaseGate(k, false)
		return Result{Skipped: true, SkippedBy: c.Node}, nil
	}
	res, err := c.lock(ctx, req)
	if err != nil || !res.Acquired {
		c.releaseGate(k, false)
	}
	return res, err
}

func (c *Client) lock(ctx context.Context, req Request) (Result, error) {
	res, sent, by, err := c.waitTurn(ctx, req, true)
	switch {
	case err != nil:
		return Result{}, err
	case res.Acquired:
		return c.acquired(req.key(), res.Token, sent, res.GuaranteedMs), nil
	default:
		return Result{Skipped: true, SkippedBy: by}, nil
	}
}

// Acquire is TryAcquire that waits its turn in the key's queue, as Lock
// does, but without Lock's turn among this Client's callers: it is for a
// caller that keeps its grants as TryAcquire's are kept, and Releases
// them with their token. It returns a grant (Acquired) with its lost
// channel, or Skip when another node completed the operation meanwhile.
// When ctx ends first, the wait is cancelled (a grant that raced the
// cancel is given up as a failure) and ctx's error is returned.
func (c *Client) Acquire(ctx context.Context, req Request) (res api.LockResponse, lost <-chan struct{}, err error) {
	if err := c.prepare(req); err != nil {
		return api.LockResponse{}, nil, err
	}
	return c.acquire(ctx, req, true)
}

// Await is Acquire for a caller that shares the node's place in line
// among several waits of its own: when ctx ends, or when no answer comes,
// it returns the error and leaves the node in line, with a grant that
// raced it held, for the caller to Cancel, or to take by asking again.
func (c *Client) Await(ctx context.Context, req Request) (res api.LockResponse, lost <-chan struct{}, err error) {
	if err := c.prepare(req); err != nil {
		return api.LockResponse{}, nil, err
	}
	return c.acquire(ctx, req, false)
}

func (c *Client) acquire(ctx context.Context, req Request, leave bool) (api.LockResponse, <-chan struct{}, error) {
	res, sent, _, err := c.waitTurn(ctx, req, leave)
	if err != nil || !res.Acquired {
		return res, nil, err
	}
	return res, c.watch(req.key(), res.Token, true, sent, res.GuaranteedMs).ctx.Done(), nil
}

// waitTurn sends /lock and, while the node is queued, waits for the
// stream's hints (or polls /status) until the answer is a grant, won by
// the /lock sent at sent, or a skip, by skippedBy when known (res.Skip).
// leave: when ctx ends, or no answer comes, the node leaves the line
// (abandon, lockFailed); else it stays, for the caller to leave.
func (c *Client) waitTurn(ctx context.Context, req Request, leave bool) (res api.LockResponse, sent time.Time, skippedBy string, err error) {
	k := req.key()
	abandon, lockFailed := c.abandon, c.lockFailed
	if !leave {
		abandon = func(ctx context.Context, _ lock.Key) error { return context.Cause(ctx) }
		lockFailed = func(_ lock.Key, err error) error { return err }
	}
	skip := func(by string) (api.LockResponse, time.Time, string, error) {
		return api.LockResponse{Skip: true}, sent, by, nil
	}
	if c.ctx.Err() != nil {
		return res, sent, "", ErrClosed // closed while it waited for its turn (gate)
	}
	s := c.ensureSession(ctx)
	w := c.addWaiter(k)
	defer c.removeWaiter(k, w)
	sent = time.Now()
	res, err = c.tryLock(ctx, req)
	if err != nil {
		if ctx.Err() != nil {
			// The caller gave up with the /lock on the wire: the server
			// may have queued or granted it. Cancel, or the node keeps a
			// place nobody waits on in front of the nodes behind it.
			return res, sent, "", abandon(ctx, k)
		}
		return res, sent, "", lockFailed(k, err)
	}
	switch {
	case res.Acquired:
		return res, sent, "", nil
	case res.Skip:
		return skip(c.lastCompleter(ctx, k))
	}
	up, changed := s.state()
	poll := time.NewTimer(c.pollEvery(up))
	defer poll.Stop()
	for {
		relock := false
		select {
		case h := <-w.hints:
			if h.kind == hintDone {
				return skip(h.by)
			}
			relock = true // a grant or a refusal: the answer to /lock says which
		case <-changed:
			var nowUp bool
			nowUp, changed = s.state()
			// Reconnected: the server may have forgotten this wait (a new
			// epoch), and /lock is idempotent.
			relock = nowUp
			poll.Reset(c.pollEvery(nowUp))
		case <-poll.C:
			up, _ := s.state()
			poll.Reset(c.pollEvery(up))
			st, err := c.status(ctx, k, true)
			if err != nil {
				c.Logger.Debug("status poll failed", "key", k.String(), "err", err)
				continue
			}
			switch {
			case st.Holder == c.Node:
				relock = true // granted: confirm it
			case st.Position > 0:
			case st.LastCompleted != nil && st.LastCompleted.Success && k.Type != lock.Update && st.State == "free":
				return skip(st.LastCompleted.NodeID)
			default:
				relock = true // not queued any more (lease ended, restart): ask again
			}
		case <-ctx.Done():
			return res, sent, "", abandon(ctx, k)
		case <-c.ctx.Done():
			// Closed: the caller waits no more. A Lock or Acquire leaves
			// the line, or the node would be granted the key with nobody
			// to release it, and hold up every node behind it until its
			// session's grace ran out; an Await's caller leaves it.
			if leave {
				c.cancelWait(k)
			}
			return res, sent, "", ErrClosed
		}
		if !relock {
			continue
		}
		sent = time.Now()
		res, err = c.tryLock(ctx, req)
		if err != nil {
			if ctx.Err() != nil {
				return res, sent, "", abandon(ctx, k)
			}
			return res, sent, "", lockFailed(k, err)
		}
		switch {
		case res.Acquired:
			return res, sent, "", nil
		case res.Skip:
			return skip(c.lastCompleter(ctx, k))
		}
	}
}

func (c *Client) pollEvery(streamUp bool) time.Duration {
	if streamUp {
		return 10 * c.PollInterval
	}
	return c.PollInterval
}

// abandon cancels a wait whose caller gave up and returns the caller's
// error. A grant that raced the cancel is released by it as a failure, so
// the key passes on.
func (c *Client) abandon(ctx context.Context, k lock.Key) error {
	c.cancelWait(k)
	return context.Cause(ctx)
}

// lockFailed handles a /lock that failed with err, which it returns. When
// no answer came (every attempt timed out or broke, or the last was a
// 5xx), an earlier attempt may have been handled: the node may hold the
// key or wait for it with nobody to release it, so the wait is cancelled
// as abandon does. A refusal the server answered (4xx) queued nothing.
func (c *Client) lockFailed(k lock.Key, err error) error {
	if ae, ok := errors.AsType[*api.Error](err); !ok || ae.Status >= 500 {
		c.cancelWait(k)
	}
	return err
}

// cancelWait sends /cancel for k, best effort.
func (c *Client) cancelWait(k lock.Key) {
	// Not ended by Close: a wait that Close ended leaves the line too.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(c.ctx), c.RequestTimeout)
	defer cancel()
	var res api.CancelResponse
	err := c.call(cctx, "POST", "/cancel", nil, api.KeyRequest{Type: k.Type.String(), ResourceID: k.Resource, NodeID: c.Node}, &res)
	if err != nil {
		c.Logger.Warn("cancelling a wait failed; the server drops it when its lease ends", "key", k.String(), "err", err)
	}
}

// TryLock sends one /lock and returns the answer: acquired, queued (the node
// keeps its place until its lease ends; ask again to renew it) or skip. It
// neither waits nor opens the session stream, so unless req.Lease says
// otherwise the server gives it a ttl lease when this node has no session.
func (c *Client) TryLock(ctx context.Context, req Request) (api.LockResponse, error) {
	if err := c.prepare(req); err != nil {
		return api.LockResponse{}, err
	}
	return c.tryLock(ctx, req)
}

// TryAcquire is TryLock for a caller that must know when a grant is lost,
// as Lock's callers do: when the answer is Acquired, lost is closed once
// this client learns that the server no longer has the hold (the check
// every RenewInterval, a server restart), and nil otherwise. It neither
// waits nor takes the key's turn among this Client's Lock callers, so it
// is not for a key this Client holds with Lock. A Release with the
// grant's token ends the watch, and closes lost.
func (c *Client) TryAcquire(ctx context.Context, req Request) (res api.LockResponse, lost <-chan struct{}, err error) {
	if err := c.prepare(req); err != nil {
		return api.LockResponse{}, nil, err
	}
	sent := time.Now()
	res, err = c.tryLock(ctx, req)
	if err != nil || !res.Acquired {
		return res, nil, err
	}
	return res, c.watch(req.key(), res.Token, true, sent, res.GuaranteedMs).ctx.Done(), nil
}

// Release sends one /unlock with the given token (0: not checked): success
// when opErr is nil. Unlike Unlock it works without a Lock of this Client,
// for a lock taken by TryLock or by another process of the same node. It
// ends the watch of a TryAcquire grant with that token, whatever the answer.
func (c *Client) Release(ctx context.Context, req Request, token uint64, opErr error) (api.UnlockResponse, error) {
	if err := c.prepare(req); err != nil {
		return api.UnlockResponse{}, err
	}
	k := req.key()
	c.mu.Lock()
	h := c.held[k]
	if h != nil && h.tried && h.token == token {
		delete(c.held, k)
	} else {
		h = nil
	}
	c.mu.Unlock()
	if h == nil {
		return c.release(ctx, k, token, opErr)
	}
	h.stop()
	res, err := c.release(ctx, k, token, opErr)
	h.cancel(releasedCause(err))
	return res, err
}

// releasedCause is the cause a hold ends with once its /unlock was answered
// with err (Result.Err): a refusal because another node holds the key or a
// newer token was granted says the lock was lost before this client let it
// go, which a holder that checks Err after the fact must learn.
func releasedCause(err error) error {
	if errors.Is(err, ErrNotHolder) || errors.Is(err, ErrStaleToken) {
		return ErrLockLost
	}
	return ErrReleased
}

func (c *Client) release(ctx context.Context, k lock.Key, token uint64, opErr error) (api.UnlockResponse, error) {
	body := api.UnlockRequest{Type: k.Type.String(), ResourceID: k.Resource, NodeID: c.Node, Token: token}
	success := opErr == nil
	body.Success = &success
	if opErr != nil {
		body.Error = opErr.Error()
		if len(body.Error) > 1024 {
			body.Error = body.Error[:1024]
		}
	}
	var res api.UnlockResponse
	err := c.call(ctx, "POST", "/unlock", nil, body, &res)
	return res, err
}

// Cancel leaves the key's queue, or gives the lock up as a failure if this
// node holds it.
func (c *Client) Cancel(ctx context.Context, req Request) (api.CancelResponse, error) {
	if err := c.prepare(req); err != nil {
		return api.CancelResponse{}, err
	}
	var res api.CancelResponse
	k := req.key()
	err := c.call(ctx, "POST", "/cancel", nil, api.KeyRequest{Type: k.Type.String(), ResourceID: k.Resource, NodeID: c.Node}, &res)
	return res, err
}

func (c *Client) tryLock(ctx context.Context, req Request) (api.LockResponse, error) {
	var res api.LockResponse
	body := api.LockRequest{Type: req.Type.String(), ResourceID: req.Resource, NodeID: c.Node, SkipRecent: req.SkipRecent}
	if req.Lease != lock.LeaseAuto {
		body.Lease = req.Lease.String()
	}
	err := c.call(ctx, "POST", "/lock", nil, body, &res)
	return res, err
}

// acquired records a grant of Lock: the /lock that won it was sent at sent
// and answered with guarantee ms.
func (c *Client) acquired(k lock.Key, token uint64, sent time.Time, ms api.Guarantee) Result {
	h := c.watch(k, token, false, sent, ms)
	h.mu.Lock()
	var margin time.Duration
	if h.leased {
		margin = c.leaseMargin(h.gmax)
	}
	h.mu.Unlock()
	return Result{Acquired: true, Token: token, Lost: h.ctx.Done(), Margin: margin, LeaseEnds: h.ends, hold: h.ctx}
}

// watch makes a grant a hold, checked by watchHolds, its lease running from
// sent (confirm). A TryAcquire grant with the token of a hold already
// watched (one node asking twice) shares that hold: the server has one.
func (c *Client) watch(k lock.Key, token uint64, tried bool, sent time.Time, ms api.Guarantee) *hold {
	c.mu.Lock()
	defer c.mu.Unlock()
	old := c.held[k]
	if tried && old != nil && old.token == token && old.ctx.Err() == nil {
		c.confirm(k, old, sent, ms)
		return old
	}
	hctx, cancel := context.WithCancelCause(c.ctx)
	h := &hold{token: token, ctx: hctx, cancel: cancel, tried: tried, ends: make(chan time.Time, 1)}
	c.confirm(k, h, sent, ms)
	if old != nil {
		old.stop()
		old.cancel(ErrLockLost) // the grant it named was replaced by another token's
	}
	c.held[k] = h
	// Not once Close has begun (under c.mu, as here): its Wait may be
	// under way, and a goroutine added then would outlive it. The hold's
	// context, made of the Client's, has ended already.
	if !c.monitor && !c.closed {
		c.monitor = true
		c.wg.Go(c.watchHolds)
	}
	return h
}

// lastCompleter names the node of the key's retained completion, for a
// skip_recent answer, which does not say who did the work.
func (c *Client) lastCompleter(ctx context.Context, k lock.Key) string {
	st, err := c.status(ctx, k, false)
	if err != nil || st.LastCompleted == nil {
		return ""
	}
	return st.LastCompleted.NodeID
}

func (c *Client) status(ctx context.Context, k lock.Key, asNode bool) (api.StatusResponse, error) {
	q := url.Values{"type": {k.Type.String()}, "resource_id": {k.Resource}}
	if asNode {
		q.Set("node_id", c.Node)
	}
	var st api.StatusResponse
	err := c.call(ctx, "GET", "/status", q, nil, &st)
	return st, err
}

// Unlock releases a lock this node holds: success when opErr is nil, else a
// failure carrying opErr's text, which hands the lock to the next waiter.
// The grant's token is sent, so an unlock of a lock lost meanwhile is
// refused (ErrNotHolder or ErrStaleToken) instead of ending someone else's.
func (c *Client) Unlock(ctx context.Context, req Request, opErr error) error {
	if err := c.prepare(req); err != nil {
		return err
	}
	k := req.key()
	c.mu.Lock()
	h := c.held[k]
	delete(c.held, k)
	c.mu.Unlock()
	var token uint64
	if h != nil {
		token = h.token
		h.stop()
	}
	_, err := c.release(ctx, k, token, opErr)
	if h != nil {
		defer h.cancel(releasedCause(err))
		if !h.tried {
			c.releaseGate(k, err == nil && opErr == nil)
		}
	}
	return err
}

// Do runs fn under the lock and unlocks with fn's outcome. It returns
// skipped=true without running fn when another node did the work. fn's
// context is cancelled, with cause ErrLockLost, if the lock is lost while fn
// runs; Do then returns an error matching ErrLockLost.
func (c *Client) Do(ctx context.Context, req Request, fn func(ctx context.Context) error) (skipped bool, err error) {
	res, err := c.Lock(ctx, req)
	if err != nil {
		return false, err
	}
	if res.Skipped {
		return true, nil
	}
	fctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	c.mu.Lock()
	h := c.held[req.key()]
	c.mu.Unlock()
	if h != nil && errors.Is(context.Cause(h.ctx), ErrLockLost) {
		// Lost before fn could start (a grant its server vouched for
		// less than the margin): fn does not run.
		uctx, ucancel := context.WithTimeout(context.WithoutCancel(ctx), c.unlockTimeout())
		defer ucancel()
		_ = c.Unlock(uctx, req, ErrLockLost)
		return false, ErrLockLost
	}
	if h != nil {
		stop := context.AfterFunc(h.ctx, func() {
			if errors.Is(context.Cause(h.ctx), ErrLockLost) {
				cancel(ErrLockLost)
			}
		})
		defer stop()
	}
	ferr := fn(fctx)
	lost := errors.Is(context.Cause(fctx), ErrLockLost)
	uctx, ucancel := context.WithTimeout(context.WithoutCancel(ctx), c.unlockTimeout())
	defer ucancel()
	uerr := c.Unlock(uctx, req, ferr)
	if lost {
		return false, errors.Join(ErrLockLost, ferr)
	}
	return false, errors.Join(ferr, uerr)
}

// unlockTimeout bounds Do's unlock: every attempt MaxRetries allows, one
// at least (a negative MaxRetries means no retry, not no attempt).
func (c *Client) unlockTimeout() time.Duration {
	return c.RequestTimeout * time.Duration(max(c.MaxRetries, 0)+1)
}

// watchHolds confirms held locks: /status with this node's id renews a ttl
// lease and answers how long the hold is sure to stand, which extends its
// client-side lease (confirm); an answer that names another holder or
// token means the lock was lost. Each hold is confirmed every third of its
// guarantee, or every RenewInterval from a server that gives none
// (docs/DESIGN.md, "Leases").
func (c *Client) watchHolds() {
	next := map[*hold]time.Time{} // when each hold is confirmed next
	busy := map[*hold]bool{}      // holds whose confirmation is on the wire
	done := make(chan *hold)
	var wg sync.WaitGroup
	defer wg.Wait()
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-c.ctx.Done():
			return
		case h := <-done:
			delete(busy, h)
		case <-t.C:
		}
		c.mu.Lock()
		holds := make(map[lock.Key]*hold, len(c.held))
		for k, h := range c.held {
			if h.ctx.Err() == nil {
				holds[k] = h
			}
		}
		c.mu.Unlock()
		now := time.Now()
		wake := now.Add(c.RenewInterval)
		seen := make(map[*hold]bool, len(holds))
		for k, h := range holds {
			seen[h] = true
			at, ok := next[h]
			if !ok {
				at = now.Add(h.renewEvery(c.RenewInterval))
			}
			if busy[h] {
				// Its answer, when it comes, wakes the loop: a slow
				// answer for one hold delays that hold's next
				// confirmation only, never another's.
				next[h] = at
				continue
			}
			if !at.After(now) {
				busy[h] = true
				wg.Go(func() {
					c.confirmHold(k, h)
					select {
					case done <- h:
					case <-c.ctx.Done():
					}
				})
				at = now.Add(h.renewEvery(c.RenewInterval))
			}
			next[h] = at
			if at.Before(wake) {
				wake = at
			}
		}
		for h := range next {
			if !seen[h] {
				delete(next, h)
			}
		}
		t.Reset(max(time.Until(wake), time.Millisecond))
	}
}

// confirmHold asks the server about one hold (watchHolds).
func (c *Client) confirmHold(k lock.Key, h *hold) {
	sent := time.Now()
	st, err := c.status(h.ctx, k, true)
	if err != nil {
		return // unknown: the lease decides, and the next check sees it
	}
	if st.Holder != c.Node || st.Token != h.token {
		c.Logger.Warn("lock lost", "key", k.String(), "token", h.token, "holder", st.Holder)
		h.lose()
		return
	}
	c.confirm(k, h, sent, st.GuaranteedMs)
}
