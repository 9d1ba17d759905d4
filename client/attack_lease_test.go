package client

import (
	"context"
	"encoding/json"
	"errors"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/internal/dlocktest"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/memory"
	"github.com/dlock/dlock/server"
)

// Attacks on the client-side lease (docs/DESIGN.md, "The holder stops
// first: the client-side lease"): a server that answers guaranteed_ms
// values a sane server never does, confirmations that come back out of
// order, a slow answer for one hold, a /lock whose answer never comes. All
// run in fake time (synctest): the outcomes are exact.

// rewriteGuarantee serves a real in-memory server behind a handler that
// replaces the guaranteed_ms of the answers to path (/lock or /status)
// with what set returns for the answer's old value; set returns false to
// leave an answer alone, fail (when not nil) true to answer 503 instead.
// The streams ping every minute: the tests run through a day of fake time.
func rewriteGuarantee(t *testing.T, cfg func(*memory.Config), path string, set func(old int64) (int64, bool), fail func() bool) *dlocktest.Server {
	rewrite := dlocktest.RewriteAnswers(path, func(status int, body []byte) []byte {
		var m map[string]json.RawMessage
		if status == http.StatusOK && json.Unmarshal(body, &m) == nil && m["guaranteed_ms"] != nil {
			old, _ := strconv.ParseInt(string(m["guaranteed_ms"]), 10, 64)
			if v, ok := set(old); ok {
				m["guaranteed_ms"] = json.RawMessage(strconv.FormatInt(v, 10))
				body, _ = json.Marshal(m)
			}
		}
		return body
	})
	return dlocktest.Start(t, dlocktest.Options{Config: cfg, InMemory: true, Server: func(o *server.Options) { o.PingInterval = time.Minute }, Wrap: func(next http.Handler) http.Handler {
		answers := rewrite(next)
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == path && fail != nil && fail() {
				http.Error(w, "unavailable", http.StatusServiceUnavailable)
				return
			}
			answers.ServeHTTP(w, r)
		})
	}})
}

// TestAttackHostileGuarantee: a server (hostile, or with a bug) confirms a
// hold with absurd guaranteed_ms values. None may make the client hold on
// past the lease the grant gave: a negative value extends nothing, and
// int64 milliseconds times 1e6 must not overflow into a lease of centuries
// (nor panic). The grant says 2 s (the session grace); the first /status
// after it says the hostile value, and every later one fails (the client
// is cut off). A value that is not positive must leave the lease lost at
// 2 s less the margin (a quarter of 2 s), as if the server had said 0; a
// positive one, however large, is believed up to MaxGuarantee and no
// further.
func TestAttackHostileGuarantee(t *testing.T) {
	for _, v := range []int64{
		-1,
		-9223372036854,            // g - margin overflows to +292 years
		math.MinInt64,             // * 1e6 wraps
		math.MinInt64 / 1000,      // * 1e6 wraps
		9223372036855,             // * 1e6 wraps to about -292 years, then - margin wraps to +292 years
		math.MaxInt64,             // * 1e6 wraps to -1 ms
		math.MaxInt64/1000000 - 1, // fits: 292 years of lease from a buggy server
		int64(30 * 24 * time.Hour / time.Millisecond), // a month
	} {
		t.Run(strconv.FormatInt(v, 10), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var answered atomic.Int32
				srv := rewriteGuarantee(t, func(c *memory.Config) { c.SessionGrace = 2 * time.Second }, "/status",
					func(int64) (int64, bool) { return v, true },
					func() bool { return answered.Add(1) > 1 })
				a := newClient(t, srv, "a")
				// Confirmations every third of the guarantee, and no
				// more often than hourly once it is long: a day of
				// fake time then takes a few dozen of them.
				a.RenewInterval = time.Hour
				start := time.Now()
				res, err := a.Lock(t.Context(), pull)
				if err != nil || !res.Acquired {
					t.Fatal(res, err)
				}
				bound := 2*time.Second - 2*time.Second/4
				if v > 0 {
					// A sane-looking value is believed, up to the
					// client's cap on what one answer may vouch for.
					bound = MaxGuarantee
				}
				select {
				case <-res.Lost:
				case <-time.After(bound + time.Second):
					t.Fatalf("guaranteed_ms %d on /status: the hold still stands %v after the grant; want it lost by %v", v, time.Since(start), bound)
				}
				if d := time.Since(start); d > bound {
					t.Fatalf("guaranteed_ms %d: lost after %v, want by %v", v, d, bound)
				}
				a.Unlock(context.WithoutCancel(t.Context()), pull, nil)
			})
		})
	}
}

// TestAttackHostileGuaranteeOnGrant: the values that vouch for nothing on
// the grant itself. Such a value that vouches for nothing leaves the hold lost when Lock
// returns (not a moment later, when a timer runs): Do must not start fn,
// and a caller that checks Lost before starting its work sees it closed.
func TestAttackHostileGuaranteeOnGrant(t *testing.T) {
	for _, v := range []int64{0, -1, -9223372036854, math.MinInt64, math.MinInt64 / 1000} {
		t.Run(strconv.FormatInt(v, 10), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				srv := rewriteGuarantee(t, nil, "/lock", func(int64) (int64, bool) { return v, true }, nil)
				a := newClient(t, srv, "a")
				res, err := a.Lock(t.Context(), pull)
				if err != nil || !res.Acquired {
					t.Fatal(res, err)
				}
				select {
				case <-res.Lost:
				default:
					t.Errorf("guaranteed_ms %d on the grant: Lock returned Acquired with Lost open", v)
				}
				a.Unlock(t.Context(), pull, nil)

				ran := false
				_, err = a.Do(t.Context(), pull, func(ctx context.Context) error {
					ran = true
					return nil
				})
				if ran {
					t.Errorf("guaranteed_ms %d on the grant: Do ran fn on a hold nobody vouched for", v)
				}
				if !errors.Is(err, ErrLockLost) {
					t.Errorf("Do: %v, want ErrLockLost", err)
				}
			})
		})
	}
}

// TestAttackReorderedConfirmations: confirmations whose answers come back
// in any order. Each says the hold stands until its send plus its
// guarantee; the lease must end at the latest of these, less the margin,
// whatever the order, and never be moved earlier by an old answer.
func TestAttackReorderedConfirmations(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := &Client{Server: "http://127.0.0.1:1", Node: "a", LeaseMargin: time.Second}
		if err := c.init(); err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		k := pull.key()
		ms := api.Millis
		t0 := time.Now()
		type conf struct {
			sent time.Duration // after t0
			g    time.Duration
		}
		confs := []conf{{0, 8 * time.Second}, {2 * time.Second, 8 * time.Second}, {3 * time.Second, 4 * time.Second}, {1 * time.Second, 10 * time.Second}}
		orders := [][]int{{0, 1, 2, 3}, {3, 2, 1, 0}, {2, 0, 3, 1}, {1, 3, 0, 2}}
		for _, order := range orders {
			ctx, cancel := context.WithCancelCause(c.ctx)
			h := &hold{token: 1, ctx: ctx, cancel: cancel}
			var want time.Time
			var gmax time.Duration
			for _, i := range order {
				cf := confs[i]
				c.confirm(k, h, t0.Add(cf.sent), ms(cf.g))
				gmax = max(gmax, cf.g)
			}
			for _, cf := range confs {
				// Every confirmation ends no earlier than its own send
				// plus its guarantee less the margin of the longest.
				if e := t0.Add(cf.sent + cf.g - min(c.LeaseMargin, gmax/4)); e.After(want) {
					want = e
				}
			}
			h.mu.Lock()
			got := h.expires
			h.mu.Unlock()
			// The margin is taken from the longest guarantee seen when
			// each answer came: never less than the final one's, so the
			// lease may only end earlier than want, never later.
			if got.After(want) {
				t.Errorf("order %v: lease ends at +%v, later than the latest send+guarantee-margin, +%v", order, got.Sub(t0), want.Sub(t0))
			}
			// And an old answer must not pull it earlier than the best
			// one with its own margin: sent 1 s, 10 s guaranteed.
			if best := t0.Add(time.Second + 10*time.Second - 2500*time.Millisecond); got.Before(best) {
				t.Errorf("order %v: lease ends at +%v, before +%v that one answer vouched for", order, got.Sub(t0), best.Sub(t0))
			}
			h.stop()
			cancel(nil)
		}
	})
}

// TestAttackSlowConfirmationStarvesOthers: the server answers /status for
// one held key slowly (each attempt times out), while it answers another
// held key at once. The client confirms its holds "one at a time each,
// all at once: a slow answer for one hold must not starve another's
// lease" (watchHolds). The quick key's lease must stand: a hold that its
// server confirms whenever asked must not be declared lost.
func TestAttackSlowConfirmationStarvesOthers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		slow := Request{Type: lock.Pull, Resource: "sha256:slow"}
		quick := Request{Type: lock.Pull, Resource: "sha256:quick"}
		var hang atomic.Bool
		release := make(chan struct{})
		defer close(release)
		srv := dlocktest.Start(t, dlocktest.Options{InMemory: true,
			Config: func(c *memory.Config) { c.SessionGrace = 3 * time.Second },
			Wrap: func(next http.Handler) http.Handler {
				return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					if hang.Load() && r.URL.Path == "/status" && r.URL.Query().Get("resource_id") == slow.Resource {
						select {
						case <-r.Context().Done():
						case <-release:
						}
						return
					}
					next.ServeHTTP(w, r)
				})
			}})
		a := newClient(t, srv, "a")
		rs, err := a.Lock(t.Context(), slow)
		if err != nil || !rs.Acquired {
			t.Fatal(rs, err)
		}
		rq, err := a.Lock(t.Context(), quick)
		if err != nil || !rq.Acquired {
			t.Fatal(rq, err)
		}
		hang.Store(true)
		start := time.Now()
		select {
		case <-rq.Lost:
			t.Fatalf("the quick key's hold was declared lost after %v while its server answered every /status about it at once", time.Since(start))
		case <-time.After(20 * time.Second):
		}
		a.Unlock(t.Context(), quick, nil)
		a.Unlock(t.Context(), slow, nil)
	})
}

// TestAttackLockAnswerNeverComes: the server handles a /lock and grants
// it, but every answer is late past RequestTimeout (a slow server or path;
// an etcd-backed server may take up to 10 s). Lock gives up with an error:
// the node must then not keep the grant, which nobody would ever release
// while the node's session stream lives (the next node would wait
// forever).
func TestAttackLockAnswerNeverComes(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var slow atomic.Bool
		slow.Store(true)
		srv := dlocktest.Start(t, dlocktest.Options{InMemory: true, Wrap: func(next http.Handler) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path != "/lock" || !slow.Load() {
					next.ServeHTTP(w, r)
					return
				}
				rec := httptest.NewRecorder()
				next.ServeHTTP(rec, r)
				<-r.Context().Done() // the answer is late: the client gave up
			})
		}})
		a := newClient(t, srv, "a")
		a.RequestTimeout = 500 * time.Millisecond
		if _, err := a.Lock(t.Context(), pull); err == nil {
			t.Fatal("Lock succeeded without an answer")
		}
		slow.Store(false)
		st, err := a.Status(t.Context(), pull.Type, pull.Resource)
		if err != nil {
			t.Fatal(err)
		}
		if st.Holder == "a" || st.QueueLength > 0 {
			t.Fatalf("after a's Lock failed, a still holds or waits (%+v): nobody will release it while a's session lives", st)
		}
	})
}

// TestAttackUnlockAfterLostSendsToken: a holder whose lease ran out (the
// server handed the key on meanwhile) unlocks with success: its token must
// make the server refuse, leaving the next holder's hold alone.
func TestAttackUnlockAfterLostSendsToken(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := startInMemory(t, func(c *memory.Config) { c.MaxHold = 400 * time.Millisecond })
		a, b := newClient(t, srv, "a"), newClient(t, srv, "b")
		ra, err := a.Lock(t.Context(), pull)
		if err != nil || !ra.Acquired {
			t.Fatal(ra, err)
		}
		<-ra.Lost
		rb, err := b.Lock(t.Context(), pull)
		if err != nil || !rb.Acquired {
			t.Fatal(rb, err)
		}
		if err := a.Unlock(t.Context(), pull, nil); !errors.Is(err, ErrNotHolder) && !errors.Is(err, ErrStaleToken) {
			t.Fatalf("a's unlock after losing the hold: %v, want a refusal", err)
		}
		st, err := b.Status(t.Context(), pull.Type, pull.Resource)
		if err != nil || st.Holder != "b" || st.Token != rb.Token {
			t.Fatalf("b's hold after a's stray unlock: %+v %v", st, err)
		}
		select {
		case <-rb.Lost:
			t.Fatal("b's hold lost after a's stray unlock")
		default:
		}
		b.Unlock(t.Context(), pull, nil)
	})
}

// TestAttackDoNoRetriesUnlocks: a Client that never retries (MaxRetries
// negative, as `dlock run --max-retries 0` sets it) still gets its Do's
// unlock out: the unlock's time is one attempt at least, not
// RequestTimeout × (MaxRetries+1) = 0, which failed every such unlock
// before it was sent and left the key held until the session ended.
func TestAttackDoNoRetriesUnlocks(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := startInMemory(t, nil)
		a := newClient(t, srv, "a")
		a.MaxRetries = -1
		if _, err := a.Do(t.Context(), pull, func(context.Context) error { return nil }); err != nil {
			t.Fatalf("Do: %v", err)
		}
		st, err := a.Status(t.Context(), pull.Type, pull.Resource)
		if err != nil {
			t.Fatal(err)
		}
		if st.Holder != "" || st.LastCompleted == nil || !st.LastCompleted.Success {
			t.Fatalf("after Do returned: %+v, want the key free with a success recorded", st)
		}
	})
}
