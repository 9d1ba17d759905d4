package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/lock"
)

// failoverRoundClient is a round of Failover with client.Client as the node:
// Servers lists A first, so the client starts there; after the kill its
// own fail-over (docs/DESIGN.md, "What a client does") moves its next
// request and its stream to the next server. The stream is watched through
// the client's LongClient: a tap on its /subscribe answers times when the
// reopened stream says subscribed, and which events it carries.
func failoverRoundClient(ctx context.Context, o FailoverOptions, servers []foServer, node string) (FailoverRound, error) {
	var r FailoverRound
	a := servers[0]
	killed := false
	defer func() {
		if !killed {
			a.stop()
		}
	}()
	var bases []string
	for _, s := range servers {
		bases = append(bases, s.base)
	}
	tap := &streamTap{base: http.DefaultTransport.(*http.Transport).Clone(), changed: make(chan struct{})}
	defer tap.base.CloseIdleConnections()
	c := &client.Client{Servers: bases, Node: node, LongClient: &http.Client{Transport: tap}}
	defer c.Close()
	held := client.Request{Type: lock.Pull, Resource: node + "-held", Lease: lock.LeaseSession}
	next := client.Request{Type: lock.Pull, Resource: node + "-next", Lease: lock.LeaseSession}
	if err := c.Connect(ctx); err != nil {
		return r, fmt.Errorf("client stream on %s: %w", a.base, err)
	}
	first, err := c.TryLock(ctx, held)
	if err != nil || !first.Acquired {
		return r, fmt.Errorf("client lock on %s: %+v %v", a.base, first, err)
	}
	if _, err := tap.await(ctx, time.Now().Add(10*time.Second), func(e tapEvent) bool {
		return e.name == "lock_assigned" && e.about(held.Resource)
	}); err != nil {
		return r, fmt.Errorf("lock_assigned on %s: %w", a.base, err)
	}

	t0 := time.Now()
	killed = true
	a.stop()
	deadline := t0.Add(o.Retry)
	var wg sync.WaitGroup
	var lockErr, streamErr error
	wg.Go(func() {
		lctx, cancel := context.WithDeadline(ctx, deadline)
		defer cancel()
		for {
			ans, err := c.TryLock(lctx, next)
			if err == nil && ans.Acquired {
				r.Lock = time.Since(t0)
				return
			}
			if err == nil {
				lockErr = fmt.Errorf("next lock: %+v", ans)
				return
			}
			if lctx.Err() != nil {
				lockErr = fmt.Errorf("next lock: %w", err)
				return
			}
			// The client's retries ran out on dead or starting
			// servers: the node tries again, as a caller of Lock
			// would.
		}
	})
	wg.Go(func() {
		e, err := tap.await(ctx, deadline, func(e tapEvent) bool {
			return e.name == "subscribed" && e.opened.After(t0) && e.host != strings.TrimPrefix(a.base, "http://")
		})
		if err != nil {
			streamErr = err
			return
		}
		r.Stream = e.at.Sub(t0)
	})
	wg.Wait()
	if lockErr != nil {
		return r, fmt.Errorf("after the kill: %w", lockErr)
	}
	if streamErr != nil {
		return r, fmt.Errorf("resuming the stream after the kill: %w", streamErr)
	}
	kept := func(when string) error {
		st, err := c.Status(ctx, lock.Pull, held.Resource)
		if err != nil {
			return fmt.Errorf("status %s: %w", when, err)
		}
		if r.Kept = st.Holder == node && st.Token == first.Token; !r.Kept {
			r.Problem = joinNote(r.Problem, fmt.Sprintf("hold lost %s: holder %q token %d, was %q %d", when, st.Holder, st.Token, node, first.Token))
		}
		return nil
	}
	if err := kept("after the kill"); err != nil {
		return r, err
	}
	if _, err := tap.await(ctx, time.Now().Add(5*time.Second), func(e tapEvent) bool {
		return e.name == "lock_assigned" && e.about(next.Resource) && e.opened.After(t0)
	}); err == nil {
		r.Replayed = true
	} else {
		r.Problem = joinNote(r.Problem, "no lock_assigned of the next lock on the resumed stream: "+err.Error())
	}
	if r.Kept && o.Recheck > 0 {
		select {
		case <-time.After(o.Recheck - time.Since(t0)):
		case <-ctx.Done():
			return r, ctx.Err()
		}
		if err := kept(fmt.Sprintf("%v after the kill", o.Recheck)); err != nil {
			return r, err
		}
	}
	for _, q := range []client.Request{next, held} {
		c.Release(ctx, q, 0, nil)
	}
	return r, nil
}

// streamTap is the client's LongClient transport: it passes requests on
// and notes, for each /subscribe answer, the events its body carries.
type streamTap struct {
	base    *http.Transport
	mu      sync.Mutex
	events  []tapEvent
	changed chan struct{} // closed and replaced on each event
}

type tapEvent struct {
	host   string    // the server the stream was on
	opened time.Time // when that stream's request went out
	at     time.Time // when the event was read
	name   string
	data   string
}

func (e tapEvent) about(resource string) bool {
	return strings.Contains(e.data, fmt.Sprintf(`"resource_id":%q`, resource))
}

func (t *streamTap) RoundTrip(req *http.Request) (*http.Response, error) {
	opened := time.Now()
	resp, err := t.base.RoundTrip(req)
	if err != nil || !strings.HasSuffix(req.URL.Path, "/subscribe") {
		return resp, err
	}
	resp.Body = &tapBody{ReadCloser: resp.Body, t: t, host: req.URL.Host, opened: opened}
	return resp, nil
}

func (t *streamTap) add(e tapEvent) {
	t.mu.Lock()
	t.events = append(t.events, e)
	close(t.changed)
	t.changed = make(chan struct{})
	t.mu.Unlock()
}

// await returns the first event so far or to come that match takes.
func (t *streamTap) await(ctx context.Context, deadline time.Time, match func(tapEvent) bool) (tapEvent, error) {
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	seen := 0
	for {
		t.mu.Lock()
		evs, ch := t.events[seen:], t.changed
		seen = len(t.events)
		t.mu.Unlock()
		for _, e := range evs {
			if match(e) {
				return e, nil
			}
		}
		select {
		case <-ch:
		case <-timer.C:
			return tapEvent{}, errors.New("not within the time allowed")
		case <-ctx.Done():
			return tapEvent{}, ctx.Err()
		}
	}
}

// tapBody splits what the client reads into events, by their blank lines.
type tapBody struct {
	io.ReadCloser
	t      *streamTap
	host   string
	opened time.Time
	buf    []byte
}

func (b *tapBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.buf = append(b.buf, p[:n]...)
	b.buf = bytes.ReplaceAll(b.buf, []byte("\r\n"), []byte("\n"))
	for {
		i := bytes.Index(b.buf, []byte("\n\n"))
		if i < 0 {
			break
		}
		e := tapEvent{host: b.host, opened: b.opened, at: time.Now()}
		for line := range strings.SplitSeq(string(b.buf[:i]), "\n") {
			if v, ok := strings.CutPrefix(line, "event:"); ok {
				e.name = strings.TrimSpace(v)
			} else if v, ok := strings.CutPrefix(line, "data:"); ok {
				e.data += strings.TrimSpace(v)
			}
		}
		b.buf = b.buf[i+2:]
		if e.name != "" {
			b.t.add(e)
		}
	}
	return n, err
}
