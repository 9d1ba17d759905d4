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
)

// authEnv is a real dlock server behind the rules of docs/SECURITY.md
// (HTTPS, mTLS, bearer tokens): nodes a, b and c each have a certificate
// and a token.
type authEnv struct {
	pki     *dlocktest.PKI
	backend *dlocktest.Server
	proxy   *dlocktest.AuthProxy
}

var authTokens = map[string]string{"tok-a": "a", "tok-b": "b", "tok-c": "c", "tok-op": "*"}

func startAuthEnv(t *testing.T) *authEnv {
	pki := dlocktest.NewPKI(t)
	backend := dlocktest.Start(t, dlocktest.Options{RefCount: true})
	return &authEnv{pki: pki, backend: backend, proxy: dlocktest.StartAuthProxy(t, backend, pki, authTokens)}
}

// client is node's Client with the CA, certNode's certificate and token.
func (e *authEnv) client(t *testing.T, node, certNode, token string) *Client {
	t.Helper()
	cert, key := e.pki.ClientCert(certNode)
	cfg, err := TLSConfigFromFiles(e.pki.CAFile, cert, key)
	if err != nil {
		t.Fatal(err)
	}
	c := &Client{Server: e.proxy.URL, Node: node, TLSConfig: cfg, Token: token,
		RetryInterval: 20 * time.Millisecond, PollInterval: 50 * time.Millisecond, RenewInterval: 100 * time.Millisecond}
	t.Cleanup(func() { c.Close() })
	return c
}

func (e *authEnv) waitQueued(t *testing.T, n int) {
	t.Helper()
	e.backend.WaitQueued(t, pull.key(), n)
}

// TestCredentialsHonestFlows: with a certificate and a token, the flows
// of a node work as without: a lock, a failure handed off to the next
// waiter by the session stream, a success that makes the last waiter
// skip, and reference counts. Every request carried the node's token.
func TestCredentialsHonestFlows(t *testing.T) {
	e := startAuthEnv(t)
	ctx := t.Context()
	a, b, c := e.client(t, "a", "a", "tok-a"), e.client(t, "b", "b", "tok-b"), e.client(t, "c", "c", "tok-c")

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

	if n := e.proxy.Answered(http.StatusUnauthorized) + e.proxy.Answered(http.StatusForbidden); n != 0 {
		t.Fatalf("%d requests refused", n)
	}
	if e.proxy.Requests("/subscribe") == 0 {
		t.Fatal("no session stream was opened through TLS")
	}
	for _, h := range e.proxy.Authorizations() {
		if h != "Bearer tok-a" && h != "Bearer tok-b" && h != "Bearer tok-c" {
			t.Fatalf("a request came with Authorization %q", h)
		}
	}
}

// TestWrongCredentials: a refused credential comes back as an *api.Error
// with its code, after one request (never retried), and neither the error
// nor the log names the token.
func TestWrongCredentials(t *testing.T) {
	e := startAuthEnv(t)
	ctx := t.Context()
	for _, tc := range []struct {
		name, certNode, token, code string
		status                      int
	}{
		{"no token", "a", "", "unauthorized", http.StatusUnauthorized},
		{"unknown token", "a", "secret-not-known", "unauthorized", http.StatusUnauthorized},
		{"another node's token", "a", "tok-b", "forbidden", http.StatusForbidden},
		{"another node's certificate", "b", "tok-a", "forbidden", http.StatusForbidden},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs bytes.Buffer
			c := e.client(t, "a", tc.certNode, tc.token)
			c.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
			before := e.proxy.Requests("/lock")
			_, err := c.TryLock(ctx, pull)
			ae, ok := errors.AsType[*api.Error](err)
			if !ok || ae.Code != tc.code || ae.Status != tc.status {
				t.Fatalf("TryLock: %v, want an *api.Error %d %s", err, tc.status, tc.code)
			}
			if n := e.proxy.Requests("/lock") - before; n != 1 {
				t.Fatalf("%d /lock requests, want 1: a %d is not retried", n, tc.status)
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
}

// TestTLSRefusals: a handshake refused for its certificates is one
// attempt, not MaxRetries, and says why.
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
		{"no client certificate", e.pki.CAFile, "", "", "certificate required"},
		{"client certificate of another CA", e.pki.CAFile, strangerCert, strangerKey, "unknown certificate authority"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := TLSConfigFromFiles(tc.ca, tc.cert, tc.key)
			if err != nil {
				t.Fatal(err)
			}
			c := &Client{Server: e.proxy.URL, Node: "a", TLSConfig: cfg, Token: "tok-a", MaxRetries: 5, RetryInterval: time.Millisecond}
			defer c.Close()
			before := e.proxy.Handshakes()
			_, err = c.TryLock(ctx, pull)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("TryLock: %v, want %q", err, tc.want)
			}
			if n := e.proxy.Handshakes() - before; n != 1 {
				t.Fatalf("%d handshakes, want 1: a TLS refusal is not retried", n)
			}
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
