package client

import (
	"bytes"
	"crypto/tls"
	"errors"
	"io/fs"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/internal/dlocktest"
	"github.com/dlock/dlock/internal/dlocktest/kit"
)

// authEnv is a dlock server that checks identities as docs/SECURITY.md
// says (HTTPS, client certificates of its CA, bearer tokens): nodes a, b
// and c each have a certificate and a token.
type authEnv struct {
	pki *dlocktest.PKI
	srv *dlocktest.Server
}

const (
	tokA  = "token-of-node-a-0123456789"
	tokB  = "token-of-node-b-0123456789"
	tokC  = "token-of-node-c-0123456789"
	tokOp = "token-of-the-operator-0123"
)

var authTokens = map[string]string{tokA: "a", tokB: "b", tokC: "c", tokOp: "*"}

func startAuthEnv(t *testing.T) *authEnv {
	pki := dlocktest.NewPKI(t)
	srv := dlocktest.Start(t, dlocktest.Options{RefCount: true, Auth: &dlocktest.Auth{PKI: pki, ClientCA: true, Tokens: authTokens}})
	return &authEnv{pki: pki, srv: srv}
}

// client is node's Client with the CA, certNode's certificate ("": none)
// and token.
func (e *authEnv) client(t *testing.T, node, certNode, token string) *Client {
	t.Helper()
	var cert, key string
	if certNode != "" {
		cert, key = e.pki.ClientCert(certNode)
	}
	cfg, err := TLSConfigFromFiles(e.pki.CAFile, cert, key)
	if err != nil {
		t.Fatal(err)
	}
	c := &Client{Server: e.srv.URL(), Node: node, TLSConfig: cfg, Token: token,
		RetryInterval: 20 * time.Millisecond, PollInterval: 50 * time.Millisecond, RenewInterval: 100 * time.Millisecond}
	t.Cleanup(func() { c.Close() })
	return c
}

func (e *authEnv) waitQueued(t *testing.T, n int) {
	t.Helper()
	e.srv.WaitQueued(t, pull.key(), n)
}

// requests is how many requests for path the server answered, refused
// ones included. The server counts a request before its answer leaves.
func (e *authEnv) requests(t *testing.T, path string) float64 {
	t.Helper()
	return e.srv.Metric("dlock_http_request_duration_seconds", "endpoint", path)
}

// refusals is how many requests the server's identity checks refused for
// reason (401 or 403), or for any reason without one.
func (e *authEnv) refusals(t *testing.T, reason ...string) float64 {
	t.Helper()
	if len(reason) == 0 {
		return e.srv.Metric("dlock_auth_refusals_total")
	}
	return e.srv.Metric("dlock_auth_refusals_total", "reason", reason[0])
}

// TestCredentialsHonestFlows: with a certificate and a token, the flows
// of a node work as without: a lock, a failure handed off to the next
// waiter by the session stream, a success that makes the last waiter
// skip, and reference counts. The server refused no request: every one
// carried the node's own token and certificate.
func TestCredentialsHonestFlows(t *testing.T) {
	e := startAuthEnv(t)
	ctx := t.Context()
	a, b, c := e.client(t, "a", "a", tokA), e.client(t, "b", "b", tokB), e.client(t, "c", "c", tokC)

	ra, err := a.Lock(ctx, pull)
	if err != nil || !ra.Acquired {
		t.Fatalf("a: %+v %v", ra, err)
	}
	bDone := make(chan struct{})
	var rb, rc Result
	var errB, errC error
	go func() { defer close(bDone); rb, errB = b.Lock(ctx, pull) }()
	e.waitQueued(t, 1)
	var wg sync.WaitGroup
	wg.Go(func() { rc, errC = c.Lock(ctx, pull) })
	e.waitQueued(t, 2)
	if err := a.Unlock(ctx, pull, errors.New("download failed")); err != nil {
		t.Fatal(err)
	}
	<-bDone
	if errB != nil || !rb.Acquired {
		t.Fatalf("b after a's failure: %+v %v, want acquired", rb, errB)
	}
	if err := b.Unlock(ctx, pull, nil); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if errC != nil || !rc.Skipped || rc.SkippedBy != "b" {
		t.Fatalf("c after b's success: %+v %v, want skipped by b", rc, errC)
	}

	res := "sha256:shared"
	for _, cl := range []*Client{a, b} {
		if _, err := cl.AddRef(ctx, res); err != nil {
			t.Fatal(err)
		}
	}
	rcnt, err := c.RefCount(ctx, res)
	if err != nil || rcnt.Count != 2 {
		t.Fatalf("refcount: %+v %v, want 2", rcnt, err)
	}
	if rcnt, err = a.ReleaseRef(ctx, res); err != nil || rcnt.Count != 1 {
		t.Fatalf("release: %+v %v, want 1", rcnt, err)
	}

	// No token, an unknown one, another node's token or certificate:
	// each is a refusal the server counts by its reason.
	if n := e.refusals(t); n != 0 {
		t.Fatalf("%v requests refused", n)
	}
	// Each node keeps its session stream open until Close.
	kit.WaitFor(t, "the session streams of a, b and c, over TLS", func() bool {
		return e.srv.Metric("dlock_event_streams") == 3
	})
	if n := e.requests(t, "/lock"); n == 0 {
		t.Fatal("no /lock request reached the server")
	}
}

// TestWrongCredentials: a refused credential comes back as an *api.Error
// with its code, after one request (never retried), and neither the error
// nor the log names the token. A client without a certificate passes the
// handshake, which asks for one without requiring it, and is answered
// 401 (docs/SECURITY.md): GET /healthz stays open to probes.
func TestWrongCredentials(t *testing.T) {
	e := startAuthEnv(t)
	ctx := t.Context()
	for _, tc := range []struct {
		name, certNode, token, code, reason string
		status                              int
	}{
		{"no token", "a", "", "unauthorized", "no_token", http.StatusUnauthorized},
		{"unknown token", "a", "secret-not-known-0123", "unauthorized", "unknown_token", http.StatusUnauthorized},
		{"no client certificate", "", tokA, "unauthorized", "no_certificate", http.StatusUnauthorized},
		{"another node's token", "a", tokB, "forbidden", "other_node", http.StatusForbidden},
		{"another node's certificate", "b", tokA, "forbidden", "other_node", http.StatusForbidden},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs bytes.Buffer
			c := e.client(t, "a", tc.certNode, tc.token)
			c.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
			before, refusedBefore := e.requests(t, "/lock"), e.refusals(t, tc.reason)
			_, err := c.TryLock(ctx, pull)
			ae, ok := errors.AsType[*api.Error](err)
			if !ok || ae.Code != tc.code || ae.Status != tc.status {
				t.Fatalf("TryLock: %v, want an *api.Error %d %s", err, tc.status, tc.code)
			}
			if sentinel := map[int]error{http.StatusUnauthorized: ErrUnauthorized, http.StatusForbidden: ErrForbidden}[tc.status]; !errors.Is(err, sentinel) {
				t.Fatalf("TryLock: %v, want errors.Is %v", err, sentinel)
			}
			if n := e.requests(t, "/lock") - before; n != 1 {
				t.Fatalf("%v /lock requests, want 1: a %d is not retried", n, tc.status)
			}
			if n := e.refusals(t, tc.reason) - refusedBefore; n != 1 {
				t.Fatalf("%v refusals for %s, want 1", n, tc.reason)
			}
			// Lock opens the session stream first: it is refused too,
			// and Lock returns the refusal of its /lock.
			_, err = c.Lock(ctx, pull)
			if ae, ok := errors.AsType[*api.Error](err); !ok || ae.Code != tc.code {
				t.Fatalf("Lock: %v, want %s", err, tc.code)
			}
			err = c.Connect(ctx)
			if ae, ok := errors.AsType[*api.Error](err); !ok || ae.Code != tc.code {
				t.Fatalf("Connect: %v, want the stream's refusal, %s", err, tc.code)
			}
			c.Close()
			if tc.token != "" {
				for what, text := range map[string]string{"TryLock": err.Error(), "log": logs.String()} {
					if strings.Contains(text, tc.token) {
						t.Fatalf("the %s names the token: %s", what, text)
					}
				}
			}
		})
	}
	if st, err := e.srv.HTTPClient().Get(e.srv.URL() + "/healthz"); err != nil || st.StatusCode != http.StatusOK {
		t.Fatalf("GET /healthz without credentials: %v %v, want 200", st, err)
	} else {
		st.Body.Close()
	}
}

// TestTLSRefusals: a handshake refused for its certificates is one
// attempt, not MaxRetries, and says why. A client certificate of another
// CA is refused after the client's side of a TLS 1.3 handshake is done:
// the refusal is the server's alert, read on the first request (over
// HTTP/1.1: see defaultTransport).
func TestTLSRefusals(t *testing.T) {
	e := startAuthEnv(t)
	ctx := t.Context()
	other := dlocktest.NewPKI(t)
	cert, key := e.pki.ClientCert("a")
	strangerCert, strangerKey := other.ClientCert("a")
	for _, tc := range []struct {
		name, ca, cert, key, want string
	}{
		{"server not trusted", other.CAFile, cert, key, "certificate signed by unknown authority"},
		{"client certificate of another CA", e.pki.CAFile, strangerCert, strangerKey, "unknown certificate authority"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := TLSConfigFromFiles(tc.ca, tc.cert, tc.key)
			if err != nil {
				t.Fatal(err)
			}
			c := &Client{Server: e.srv.URL(), Node: "a", TLSConfig: cfg, Token: tokA, MaxRetries: 5, RetryInterval: time.Millisecond}
			defer c.Close()
			checkTLSRefusal(t, e, c, tc.want)
		})
	}
	// An http:// URL never gets the TLS configuration: that is a mistake.
	cfg, err := TLSConfigFromFiles(e.pki.CAFile, cert, key)
	if err != nil {
		t.Fatal(err)
	}
	c := &Client{Server: "http://127.0.0.1:1", Node: "a", TLSConfig: cfg}
	if _, err := c.TryLock(ctx, pull); !errors.Is(err, ErrNotHTTPS) {
		t.Fatalf("TLS with an http:// server: %v", err)
	}
	if _, _, err := (CredentialFiles{CA: e.pki.CAFile}).Load("http://127.0.0.1:1"); !errors.Is(err, ErrNotHTTPS) {
		t.Fatalf("a CA file for an http:// server: %v", err)
	}
	if cfg, tok, err := (CredentialFiles{}).Load("http://127.0.0.1:1"); cfg != nil || tok != "" || err != nil {
		t.Fatalf("no credentials, http://: %v %q %v", cfg, tok, err)
	}
}

// checkTLSRefusal: c's TryLock fails at the TLS handshake with want, on
// one connection, and the server counts the failed handshake.
func checkTLSRefusal(t *testing.T, e *authEnv, c *Client, want string) {
	t.Helper()
	conns, failed, requests := e.srv.Connections(), e.srv.Metric("dlock_tls_handshake_errors_total"), e.requests(t, "/lock")
	_, err := c.TryLock(t.Context(), pull)
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("TryLock: %v, want %q", err, want)
	}
	if n := e.srv.Connections() - conns; n != 1 {
		t.Fatalf("%d connections, want 1: a TLS refusal is not retried (%v)", n, err)
	}
	kit.WaitFor(t, "the server to count the failed handshake", func() bool {
		return e.srv.Metric("dlock_tls_handshake_errors_total") == failed+1
	})
	if n := e.requests(t, "/lock") - requests; n != 0 {
		t.Fatalf("%v /lock requests served after a failed handshake", n)
	}
}

// TestTLSRefusalRepeated: a client certificate of another CA, over the
// Client's default transport, is refused on one connection and named as
// such, every time (over h2 it was not: see defaultTransport).
func TestTLSRefusalRepeated(t *testing.T) {
	e := startAuthEnv(t)
	other := dlocktest.NewPKI(t)
	cert, key := other.ClientCert("a")
	cfg, err := TLSConfigFromFiles(e.pki.CAFile, cert, key)
	if err != nil {
		t.Fatal(err)
	}
	for range 20 {
		c := &Client{Server: e.srv.URL(), Node: "a", TLSConfig: cfg, Token: tokA, MaxRetries: 5, RetryInterval: time.Millisecond}
		checkTLSRefusal(t, e, c, "unknown certificate authority")
		c.Close()
	}
}

func TestReadTokenFile(t *testing.T) {
	dir := t.TempDir()
	file := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	for _, tc := range []struct{ name, content, want string }{
		{"alone", "s3cret\n", "s3cret"},
		{"spaces", "  s3cret  \r\n\n", "s3cret"},
		{"server line", "# node a's line of the server's file\ns3cret a\n", "s3cret"},
	} {
		if got, err := ReadTokenFile(file(tc.name, tc.content)); err != nil || got != tc.want {
			t.Errorf("%s: %q %v, want %q", tc.name, got, err, tc.want)
		}
	}
	for _, tc := range []struct{ name, content, want string }{
		{"empty", "\n# nothing\n", "holds no token"},
		{"two lines", "s3cret a\nother b\n", "holds 2 lines"},
		{"control", "s3\x01cret\n", "control"},
		{"non-ascii", "s3crét\n", "non-ASCII"},
	} {
		_, err := ReadTokenFile(file(tc.name, tc.content))
		if !errors.Is(err, ErrBadCredentials) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
		if err != nil && (strings.Contains(err.Error(), "s3") || strings.Contains(err.Error(), "other")) {
			t.Errorf("%s: the error quotes the token: %v", tc.name, err)
		}
	}
	_, err := ReadTokenFile(filepath.Join(dir, "missing"))
	if !errors.Is(err, ErrBadCredentials) || !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), "missing") {
		t.Errorf("missing: %v", err)
	}
	// Unreadable even as root: a folder.
	if _, err := ReadTokenFile(dir); !errors.Is(err, ErrBadCredentials) || !strings.Contains(err.Error(), "directory") {
		t.Errorf("a folder: %v", err)
	}
	c := &Client{Node: "a", Token: "two words"}
	if _, err := c.TryLock(t.Context(), pull); !errors.Is(err, ErrBadCredentials) || strings.Contains(err.Error(), "words") {
		t.Errorf("a token with a space: %v", err)
	}
}

func TestTLSConfigFromFiles(t *testing.T) {
	pki := dlocktest.NewPKI(t)
	certA, keyA := pki.ClientCert("a")
	certB, keyB := pki.ClientCert("b")
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "not.pem")
	os.WriteFile(notPEM, []byte("hello"), 0o600)
	for _, tc := range []struct{ name, ca, cert, key, want string }{
		{"missing CA", filepath.Join(dir, "nope.pem"), "", "", "no such file"},
		{"CA not PEM", notPEM, "", "", "holds no PEM certificate"},
		{"cert without key", pki.CAFile, certA, "", "needs its key"},
		{"key without cert", pki.CAFile, "", keyA, "needs its certificate"},
		{"missing key", pki.CAFile, certA, filepath.Join(dir, "nokey.pem"), "no such file"},
		{"mismatched pair", pki.CAFile, certA, keyB, "does not match"},
		{"key not PEM", pki.CAFile, certA, notPEM, "PEM"},
	} {
		if _, err := TLSConfigFromFiles(tc.ca, tc.cert, tc.key); !errors.Is(err, ErrBadCredentials) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
	}
	cfg, err := TLSConfigFromFiles("", "", "")
	if err != nil || cfg.RootCAs != nil || cfg.GetClientCertificate != nil {
		t.Fatalf("no files: %+v %v, want the system's roots and no certificate", cfg, err)
	}

	// A rotated certificate is used at the next handshake.
	cert, key := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	copyFile(t, certA, cert)
	copyFile(t, keyA, key)
	if cfg, err = TLSConfigFromFiles(pki.CAFile, cert, key); err != nil {
		t.Fatal(err)
	}
	if got := leafCN(t, cfg); got != "a" {
		t.Fatalf("certificate of %q, want a", got)
	}
	copyFile(t, certB, cert)
	copyFile(t, keyB, key)
	later := time.Now().Add(time.Minute)
	os.Chtimes(cert, later, later)
	os.Chtimes(key, later, later)
	if got := leafCN(t, cfg); got != "b" {
		t.Fatalf("after rotation: certificate of %q, want b", got)
	}
	// A half-written rotation keeps the previous pair.
	copyFile(t, certA, cert)
	os.Chtimes(cert, later.Add(time.Minute), later.Add(time.Minute))
	if got := leafCN(t, cfg); got != "b" {
		t.Fatalf("mismatched files: certificate of %q, want b kept", got)
	}
}

func copyFile(t *testing.T, from, to string) {
	data, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, data, 0o600); err != nil {
		t.Fatal(err)
	}
}

func leafCN(t *testing.T, cfg *tls.Config) string {
	t.Helper()
	cert, err := cfg.GetClientCertificate(nil)
	if err != nil || cert == nil || cert.Leaf == nil {
		t.Fatalf("client certificate: %v %v", cert, err)
	}
	return cert.Leaf.Subject.CommonName
}
