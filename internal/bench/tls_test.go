package bench

import (
	"context"
	"strings"
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
	pki := dlocktest.NewPKI(t)
	srv := dlocktest.Start(t, dlocktest.Options{})
	proxy := dlocktest.StartAuthProxy(t, srv, pki, map[string]string{"tok-op": "*"})
	// The scenarios' nodes with two workers, named by one certificate.
	cert, key := pki.ClientCert("w0", "w1", "h0", "h1", "holder-0", "holder-1")
	cfg, err := client.TLSConfigFromFiles(pki.CAFile, cert, key)
	if err != nil {
		t.Fatal(err)
	}
	d := rawhttp.Dialer{TLS: cfg, Token: "tok-op"}
	opts := Options{Duration: 300 * time.Millisecond, Concurrency: 2, Dialer: d}
	ctx := context.Background()
	for name, f := range map[string]func(context.Context, string, Options) (Result, error){"pairs": Pairs, "handoff": Handoff} {
		r, err := f(ctx, proxy.URL, opts)
		if err != nil || r.Ops == 0 {
			t.Fatalf("%s over TLS: %+v %v", name, r, err)
		}
	}
	// One TLS handshake per connection: keep-alive holds.
	if n := proxy.Handshakes(); n != 2+2*2 {
		t.Errorf("%d TLS handshakes, want 6: one per pairs worker, two (stream, requests) per handoff node", n)
	}
	if r, err := HeldLocks(ctx, proxy.URL, d, 20, 2); err != nil || r.RSSMiB <= 0 || srv.Memory.Stats().Held != 20 {
		t.Fatalf("held locks over TLS: %+v %v", r, err)
	}

	opts.Dialer.Token = "wrong"
	if _, err := Pairs(ctx, proxy.URL, opts); err == nil || !strings.Contains(err.Error(), "401") {
		t.Fatalf("pairs with a wrong token: %v, want a 401", err)
	}
	if _, err := Handoff(ctx, proxy.URL, opts); err == nil || !strings.Contains(err.Error(), "401") {
		t.Fatalf("handoff with a wrong token: %v, want a 401", err)
	}
}
