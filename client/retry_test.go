package client

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/lock"
)

// fakeServer serves h inside the current synctest bubble and returns a
// client of it; everything is closed when the test's bubble ends.
func fakeServer(t *testing.T, h http.HandlerFunc, cfg func(*Client)) *Client {
	l := kit.NewPipeListener()
	hs := &http.Server{Handler: h}
	done := make(chan struct{})
	go func() {
		defer close(done)
		hs.Serve(l)
	}()
	tr := &http.Transport{DialContext: l.Dial}
	c := &Client{Server: "http://dlock", Node: "a", ShortClient: &http.Client{Transport: tr}, LongClient: &http.Client{Transport: tr}}
	if cfg != nil {
		cfg(c)
	}
	t.Cleanup(func() {
		c.Close()
		tr.CloseIdleConnections()
		hs.Close()
		<-done
	})
	return c
}

// refuse writes a load refusal as the server does: the error body of err
// and, when after is not "", a Retry-After header.
func refuse(w http.ResponseWriter, err error, after string) {
	status, body := api.ErrorResponse(err)
	if after != "" {
		w.Header().Set("Retry-After", after)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	w.Write([]byte(`{"error":"` + body.Error + `","code":"` + body.Code + `","message":"` + body.Message + `"}`))
}

func okStatus(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "application/json")
	w.Write([]byte(`{"type":"pull","resource_id":"r","state":"free"}`))
}

// TestRetryAfter: a server that answers 429 with Retry-After twice, then
// 200, is retried after the pauses it asked for, plus at most 20 % jitter.
func TestRetryAfter(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var hits atomic.Int64
		var at []time.Time
		c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
			at = append(at, time.Now())
			if hits.Add(1) <= 2 {
				refuse(w, lock.ErrTooManySessions, "2")
				return
			}
			okStatus(w)
		}, func(c *Client) { c.RetryInterval = time.Millisecond })
		st, err := c.Status(t.Context(), lock.Pull, "r")
		if err != nil || st.ResourceID != "r" || hits.Load() != 3 {
			t.Fatalf("status: %+v %v after %d requests, want the answer of the third", st, err, hits.Load())
		}
		for i := 1; i < len(at); i++ {
			if d := at[i].Sub(at[i-1]); d < 2*time.Second || d > 2*time.Second*12/10 {
				t.Errorf("pause %d: %v, want Retry-After's 2s plus at most 20%%", i, d)
			}
		}
	})
}

// TestRetryLoadRefusals: 503 without Retry-After backs off, doubling; a
// Retry-After is capped at MaxRetryAfter; a refusal that outlasts
// MaxRetries is returned with its sentinel; a pause past the caller's
// deadline is not taken; other 4xx are not retried.
func TestRetryLoadRefusals(t *testing.T) {
	t.Run("backoff", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			var at []time.Time
			c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
				at = append(at, time.Now())
				refuse(w, lock.ErrTooManyKeys, "")
			}, func(c *Client) { c.RetryInterval = 100 * time.Millisecond; c.MaxRetries = 4 })
			_, err := c.Status(t.Context(), lock.Pull, "r")
			if !errors.Is(err, ErrTooManyKeys) || len(at) != 5 {
				t.Fatalf("%v after %d requests, want ErrTooManyKeys after 5", err, len(at))
			}
			for i := 1; i < len(at); i++ {
				want := 100 * time.Millisecond << (i - 1)
				if d := at[i].Sub(at[i-1]); d < want*8/10 || d > want*12/10 {
					t.Errorf("pause %d: %v, want %v ± 20%%", i, d, want)
				}
			}
		})
	})
	t.Run("cap", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			var at []time.Time
			c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
				at = append(at, time.Now())
				if len(at) == 1 {
					refuse(w, lock.ErrQueueFull, strconv.Itoa(24*3600))
					return
				}
				okStatus(w)
			}, nil)
			if _, err := c.Status(t.Context(), lock.Pull, "r"); err != nil {
				t.Fatal(err)
			}
			if d := at[1].Sub(at[0]); d < MaxRetryAfter || d > MaxRetryAfter*12/10 {
				t.Fatalf("a day's Retry-After waited %v, want MaxRetryAfter (%v) plus at most 20%%", d, MaxRetryAfter)
			}
		})
	})
	t.Run("deadline", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			var hits atomic.Int64
			c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
				hits.Add(1)
				refuse(w, api.ErrOverloaded, "10")
			}, nil)
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			defer cancel()
			start := time.Now()
			_, err := c.Status(ctx, lock.Pull, "r")
			if !errors.Is(err, ErrOverloaded) || hits.Load() != 1 || time.Since(start) != 0 {
				t.Fatalf("%v after %d requests and %v, want ErrOverloaded at once: the pause ends past the deadline", err, hits.Load(), time.Since(start))
			}
		})
	})
	t.Run("4xx", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			var hits atomic.Int64
			c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
				hits.Add(1)
				refuse(w, lock.ErrNotHolder, "1")
			}, nil)
			if _, err := c.Status(t.Context(), lock.Pull, "r"); !errors.Is(err, ErrNotHolder) || hits.Load() != 1 {
				t.Fatalf("%v after %d requests, want ErrNotHolder after 1", err, hits.Load())
			}
		})
	})
}

// TestLockRetriesQueueFull: Lock itself rides out 429s on /lock and
// /subscribe (too_many_sessions), waiting as asked.
func TestLockRetriesQueueFull(t *testing.T) {
	srv := startServer(t, nil)
	var locks, subs atomic.Int64
	url := hostileServer(t, func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.URL.Path == "/subscribe" && subs.Add(1) == 1:
			refuse(w, lock.ErrTooManySessions, "1")
		case r.URL.Path == "/lock" && locks.Add(1) <= 2:
			refuse(w, lock.ErrQueueFull, "1")
		default:
			srv.Handler.ServeHTTP(w, r)
		}
	})
	c := &Client{Server: url, Node: "a", RetryInterval: time.Millisecond}
	defer c.Close()
	res, err := c.Lock(t.Context(), pull)
	if err != nil || !res.Acquired {
		t.Fatalf("lock: %+v %v", res, err)
	}
	if n := locks.Load(); n != 3 {
		t.Fatalf("%d /lock requests, want 3 (two refused)", n)
	}
	kit.WaitFor(t, "the session stream, after its refusal", func() bool { return subs.Load() >= 2 })
	if err := c.Unlock(t.Context(), pull, nil); err != nil {
		t.Fatal(err)
	}
}
