package client

import (
	"context"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/netfault"
	"github.com/dlock/dlock/lock/memory"
)

// TestAttackProxyOneWayCut: the holder reaches the server through a TCP
// proxy (a load balancer, a sidecar), which is then cut one way. A proxy's
// kernel acknowledges what the server sends, so the server's dead-peer
// timeout never fires: only the client can notice. In either direction the
// holder's Lost must close at least half the margin before the waiter is
// granted; the key's moving on is logged.
//
//   - ServerToClient cut: the holder's requests pass, answers and pings do
//     not. Its stream falls silent and is reopened through the proxy (the
//     server sees a new stream: the session lives), its confirmations go
//     unanswered, its lease runs out, and the Unlock that Do sends then
//     passes: the key moves on at once.
//   - ClientToServer cut: the pings pass, nothing of the holder's does.
//     The server sees a healthy stream for ever: the session never enters
//     its grace, and the key never moves on while the cut lasts, although
//     the holder itself gave up. Liveness is lost (safety holds): skipped
//     as a known limitation below.
func TestAttackProxyOneWayCut(t *testing.T) {
	for _, dir := range []netfault.Dir{netfault.ServerToClient, netfault.ClientToServer} {
		t.Run(dir.String(), func(t *testing.T) {
			srv := startServer(t, func(c *memory.Config) { c.SessionGrace = 2 * time.Second })
			px := netfault.NewProxy(t, srv.Addr)
			hc := &http.Client{Transport: &http.Transport{}}
			defer hc.Transport.(*http.Transport).CloseIdleConnections()
			a := &Client{Server: "http://" + px.Addr(), Node: "a", ShortClient: hc, LongClient: hc,
				RetryInterval: 20 * time.Millisecond, RenewInterval: 100 * time.Millisecond, MaxRetries: -1}
			defer a.Close()
			b := newClient(t, srv, "b")
			ctx, cancel := context.WithTimeout(t.Context(), 2*kit.Patience)
			defer cancel()

			doErr := make(chan error, 1)
			held := make(chan Result, 1)
			lost := make(chan time.Time, 1)
			go func() {
				_, err := a.Do(ctx, pull, func(fctx context.Context) error {
					held <- Result{Margin: a.leaseMargin(2 * time.Second)}
					<-fctx.Done()
					lost <- time.Now()
					return fctx.Err()
				})
				doErr <- err
			}()
			r := <-held
			got := make(chan time.Time, 1)
			go func() {
				rb, err := b.Lock(ctx, pull)
				if (err != nil || !rb.Acquired) && ctx.Err() == nil {
					t.Errorf("b: %+v %v", rb, err)
				}
				got <- time.Now()
			}()
			srv.WaitQueued(t, pull.key(), 1)
			px.Cut(dir)
			cut := time.Now()
			select {
			case at := <-got:
				var lostT time.Time
				select {
				case lostT = <-lost:
				default:
					t.Fatalf("b granted %v after the cut while a's work still runs: two holders", at.Sub(cut))
				}
				st, err := b.Status(ctx, pull.Type, pull.Resource)
				if err != nil || st.LastCompleted == nil {
					t.Fatalf("status after the hand-over: %+v %v", st, err)
				}
				end := st.LastCompleted.Error
				t.Logf("%v cut → a's work stopped %v; → b granted %v; gap %v (margin %v); a's hold ended: %q", dir, lostT.Sub(cut), at.Sub(cut), at.Sub(lostT), r.Margin, end)
				// A hand-over by a's own unlock, sent once its work
				// returned, needs no margin; one by the server's lease
				// does.
				if end != "context canceled" && at.Sub(lostT) < r.Margin/2 {
					t.Errorf("gap %v under half the margin %v", at.Sub(lostT), r.Margin/2)
				}
			case <-time.After(15 * time.Second):
				select {
				case lostT := <-lost:
					px.Heal()
					cancel()
					<-got
					<-doErr
					t.Skipf("NOT TESTED, a known limit (docs/DESIGN.md, \"Behind a proxy\"): liveness through a TCP proxy: cut %v, the holder gave up %v after the cut (its unlock lost in the cut) but the server, whose connection to the proxy stays healthy, keeps its session: the key did not move on in 15 s, and moves only when the holder's session ends", dir, lostT.Sub(cut))
				default:
					t.Fatalf("%v cut: neither moved in 15 s", dir)
				}
			}
			if err := <-doErr; !errors.Is(err, ErrLockLost) {
				t.Errorf("a's Do: %v, want ErrLockLost", err)
			}
			b.Unlock(context.WithoutCancel(ctx), pull, nil)
		})
	}
}
