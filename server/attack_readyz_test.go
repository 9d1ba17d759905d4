package server

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"google.golang.org/grpc"

	"github.com/dlock/dlock/internal/auth"
	"github.com/dlock/dlock/internal/auth/authtest"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock/etcd"
)

// holdEveryOtherProbe is an etcd client interceptor that holds every other
// readiness read (a count of the epoch key) until its deadline, and lets
// the others through: a server whose client reaches two etcd members, one
// of which holds every request sent to it (a member without a quorum holds
// a read until the request's deadline; a frozen one, or one behind a path
// that drops packets, holds everything), as the client's round robin sends
// every other read to it.
type holdEveryOtherProbe struct {
	probes atomic.Int32
}

func (h *holdEveryOtherProbe) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if r, ok := req.(*pb.RangeRequest); ok && r.CountOnly && strings.HasSuffix(string(r.Key), "/epoch") {
		if h.probes.Add(1)%2 == 1 {
			<-ctx.Done()
			return ctx.Err()
		}
	}
	return invoker(ctx, method, req, reply, cc, opts...)
}

// TestAttackReadyzOneMemberHolds: while one of the etcd members a server
// reaches holds every request and the other answers, GET /readyz stays
// 200. The server answers its calls through the member that answers, as
// every other server of the data set, which reach the same members, does:
// a 503 would take every server out of its Service at once. The probe read
// etcd one read after the other, so each read sent to the member that
// holds it stopped the probe for the read's whole deadline, as long as
// readiness allows: /readyz answered 503 about one second in four.
func TestAttackReadyzOneMemberHolds(t *testing.T) {
	h := &holdEveryOtherProbe{}
	cli := etcdtest.Shared(t).Client(t, grpc.WithChainUnaryInterceptor(h.intercept))
	cfg := etcd.DefaultConfig()
	cfg.Prefix = etcdtest.Prefix(t)
	b, err := etcd.New(context.Background(), cli, cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := New(b, Options{})
	ts := httptest.NewServer(srv)
	t.Cleanup(func() {
		ts.Close()
		srv.Close()
		b.Close()
	})

	// Readiness is asked while the probe reads etcd about eight times,
	// four of which are held to their deadline.
	const probes = 8
	hc := &http.Client{Timeout: 5 * time.Second}
	kit.WaitFor(t, "the readiness probe to read etcd 8 times", func() bool {
		resp, err := hc.Get(ts.URL + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET /readyz after %d probe reads (half of them held): %d %s", h.probes.Load(), resp.StatusCode, body)
		}
		return h.probes.Load() >= probes
	})
}

// TestAttackReadyzTellsNothing: /readyz needs no credential, so it says
// nothing a credential would be needed for: ready, its epoch (which
// /healthz has said all along), or unavailable, with no address, error of
// etcd's or key of the data set.
func TestAttackReadyzTellsNothing(t *testing.T) {
	h := &holdAllProbes{}
	cli := etcdtest.Shared(t).Client(t, grpc.WithChainUnaryInterceptor(h.intercept))
	cfg := etcd.DefaultConfig()
	cfg.Prefix = etcdtest.Prefix(t)
	b, err := etcd.New(context.Background(), cli, cfg)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "tokens")
	authtest.WriteFile(t, path, []byte("operator-token-0123456789 *\n"))
	tk, err := auth.LoadTokens(path)
	if err != nil {
		t.Fatal(err)
	}
	srv := New(b, Options{Tokens: tk})
	ts := httptest.NewServer(srv)
	t.Cleanup(func() {
		ts.Close()
		srv.Close()
		b.Close()
	})
	hc := &http.Client{Timeout: 5 * time.Second}
	get := func() (int, map[string]any) {
		resp, err := hc.Get(ts.URL + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var body map[string]any
		if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, body
	}
	status, body := get()
	if status != http.StatusOK || len(body) != 2 || body["status"] != "ready" || body["epoch"] != b.Info().Epoch {
		t.Fatalf("GET /readyz without a credential: %d %v", status, body)
	}
	h.hold.Store(true)
	kit.WaitFor(t, "/readyz to answer 503 while no read is answered", func() bool {
		status, body = get()
		return status == http.StatusServiceUnavailable
	})
	msg, _ := body["message"].(string)
	for _, leak := range []string{"127.0.0.1", cfg.Prefix, "etcdserver", "context", "rpc"} {
		if strings.Contains(msg, leak) {
			t.Errorf("the 503 of /readyz says %q: %v", leak, body)
		}
	}
}

// holdAllProbes holds every readiness read, once hold is set, until its
// deadline.
type holdAllProbes struct{ hold atomic.Bool }

func (h *holdAllProbes) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if r, ok := req.(*pb.RangeRequest); ok && r.CountOnly && strings.HasSuffix(string(r.Key), "/epoch") && h.hold.Load() {
		<-ctx.Done()
		return ctx.Err()
	}
	return invoker(ctx, method, req, reply, cc, opts...)
}
