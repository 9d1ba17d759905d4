package bench

import (
	"context"
	"crypto/tls"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/internal/dlocktest"
	"github.com/dlock/dlock/internal/rawhttp"
)

// TestScenariosOverTLS: the raw client speaks TLS, shows a client
// certificate and sends the token, on keep-alive connections and on
// session streams.
func TestScenariosOverTLS(t *testing.T) {
	const tokOp = "token-of-the-operator-0123"
	pki := dlocktest.NewPKI(t)
	srv := dlocktest.Start(t, dlocktest.Options{Auth: &dlocktest.Auth{PKI: pki, ClientCA: true, Tokens: map[string]string{tokOp: "*"}}})
	// The scenarios' nodes with two workers, named by one certificate.
	cert, key := pki.ClientCert("w0", "w1", "h0", "h1", "holder-0", "holder-1")
	cfg, err := client.TLSConfigFromFiles(pki.CAFile, cert, key)
	if err != nil {
		t.Fatal(err)
	}
	// Every handshake the client completes, resumed ones included.
	var handshakes atomic.Int64
	cfg.VerifyConnection = func(tls.ConnectionState) error {
		handshakes.Add(1)
		return nil
	}
	d := rawhttp.Dialer{TLS: cfg, Token: tokOp}
	opts := Options{Duration: 300 * time.Millisecond, Concurrency: 2, Dialer: d}
	ctx := context.Background()
	for name, f := range map[string]func(context.Context, string, Options) (Result, error){"pairs": Pairs, "handoff": Handoff} {
		r, err := f(ctx, srv.URL(), opts)
		if err != nil || r.Ops == 0 {
			t.Fatalf("%s over TLS: %+v %v", name, r, err)
		}
	}
	// One TLS handshake per connection, and keep-alive holds: one
	// connection per pairs worker, two (stream, requests) per handoff node.
	if n := srv.Connections(); n != 2+2*2 {
		t.Errorf("%d connections, want 6: one per pairs worker, two (stream, requests) per handoff node", n)
	}
	if n := handshakes.Load(); n != 2+2*2 {
		t.Errorf("%d TLS handshakes, want 6: one per connection", n)
	}
	if n := srv.Metric("dlock_auth_refusals_total"); n != 0 {
		t.Errorf("%v requests refused", n)
	}
	// HeldLocks reads the server's memory from /metrics, an operator's
	// route: the certificate must name "*" as the token does.
	opCert, opKey := pki.ClientCert("*")
	opCfg, err := client.TLSConfigFromFiles(pki.CAFile, opCert, opKey)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := HeldLocks(ctx, srv.URL(), d, 20, 2); err == nil || !strings.Contains(err.Error(), "403") {
		t.Fatalf("held locks with a certificate of nodes only: %v, want /metrics refused 403", err)
	}
	if r, err := HeldLocks(ctx, srv.URL(), rawhttp.Dialer{TLS: opCfg, Token: tokOp}, 20, 2); err != nil || r.RSSMiB <= 0 || srv.Memory.Stats().Held != 20 {
		t.Fatalf("held locks over TLS: %+v %v", r, err)
	}

	opts.Dialer.Token = "wrong-token-0123456789"
	if _, err := Pairs(ctx, srv.URL(), opts); err == nil || !strings.Contains(err.Error(), "401") {
		t.Fatalf("pairs with a wrong token: %v, want a 401", err)
	}
	if _, err := Handoff(ctx, srv.URL(), opts); err == nil || !strings.Contains(err.Error(), "401") {
		t.Fatalf("handoff with a wrong token: %v, want a 401", err)
	}
	if srv.Metric("dlock_auth_refusals_total", "reason", "unknown_token") == 0 {
		t.Fatal("the server counted no refusal of the wrong token")
	}
}
