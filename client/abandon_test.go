package client

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/dlock/dlock/internal/dlocktest"
)

// TestLockGivenUpWhileFirstLockInFlight: a caller gives up while its first
// /lock is on the wire, after the server queued the node but before the
// answer arrived. The client cannot know whether it was queued (or granted),
// so it cancels: the node must not keep a place in the queue that nobody
// waits on, where it would stand in the way of every node behind it until
// its session ends.
func TestLockGivenUpWhileFirstLockInFlight(t *testing.T) {
	queued := make(chan struct{})    // the server has answered b's /lock
	answer := make(chan struct{})    // let that answer go to b
	defer func() { close(answer) }() // a failed test must not leave the handler waiting
	srv := dlocktest.Start(t, dlocktest.Options{Wrap: func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/lock" || r.Header.Get("X-Test-Node") != "b" {
				next.ServeHTTP(w, r)
				return
			}
			rec := httptest.NewRecorder()
			next.ServeHTTP(rec, r)
			close(queued)
			<-answer
			for k, v := range rec.Header() {
				w.Header()[k] = v
			}
			w.WriteHeader(rec.Code)
			w.Write(rec.Body.Bytes())
		})
	}})
	a := newClient(t, srv, "a")
	b := newClient(t, srv, "b")
	b.ShortClient = &http.Client{Transport: markNode{"b", srv.HTTPClient().Transport}}

	ra, err := a.Lock(t.Context(), pull)
	if err != nil || !ra.Acquired {
		t.Fatalf("a: %+v %v", ra, err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() {
		_, err := b.Lock(ctx, pull)
		errc <- err
	}()
	<-queued
	srv.WaitQueued(t, pull.key(), 1)
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("b's Lock: %v, want context.Canceled", err)
	}
	st, err := a.Status(t.Context(), pull.Type, pull.Resource)
	if err != nil {
		t.Fatal(err)
	}
	if st.QueueLength != 0 {
		t.Fatalf("after b gave up, %d still queued behind a (%+v): b's place was not cancelled", st.QueueLength, st)
	}
}

// markNode names the node of each request in a header, for a test's
// handler that acts on one node's requests.
type markNode struct {
	node string
	rt   http.RoundTripper
}

func (m markNode) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("X-Test-Node", m.node)
	return m.rt.RoundTrip(r)
}
