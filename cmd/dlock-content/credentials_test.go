package main

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dlock/dlock/internal/dlocktest"
)

// TestParseCredentials: --ca, --cert, --key and --token-file, with
// DLOCK_CONTENT_* fallbacks, are read at start-up; a missing or unusable
// one stops it with a message naming it.
func TestParseCredentials(t *testing.T) {
	pki := dlocktest.NewPKI(t)
	cert, key := pki.ClientCert("n1")
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	os.WriteFile(tokenFile, []byte("tok-n1 n1\n"), 0o600)
	env := map[string]string{
		"DLOCK_CONTENT_ROOT": "/shared", "DLOCK_CONTENT_SERVER": "https://127.0.0.1:7380",
		"DLOCK_CONTENT_CA": pki.CAFile, "DLOCK_CONTENT_CERT": cert, "DLOCK_CONTENT_KEY": key, "DLOCK_CONTENT_TOKEN_FILE": tokenFile,
	}
	getenv := func(k string) string { return env[k] }
	c, err := parse(nil, getenv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.token != "tok-n1" || c.tls == nil || c.tls.RootCAs == nil || c.tls.GetClientCertificate == nil {
		t.Fatalf("credentials from the environment: token %q, tls %+v", c.token, c.tls)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--token-file", filepath.Join(dir, "nope")}, "token file: open"},
		{[]string{"--ca", tokenFile}, "holds no PEM certificate"},
		{[]string{"--key", filepath.Join(dir, "nope")}, "client key"},
		{[]string{"--server", "http://127.0.0.1:7380"}, "need an https:// server"},
	} {
		if _, err := parse(tc.args, getenv, io.Discard); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want %q", tc.args, err, tc.want)
		}
	}
}

// TestRunWithCredentials: dlock-content starts against a server that
// checks identities (HTTPS, client certificates, tokens; docs/SECURITY.md)
// with its node's credentials, and refuses to start, saying why, with a
// token the server does not know.
func TestRunWithCredentials(t *testing.T) {
	const token = "token-of-node-n-0123456789"
	pki := dlocktest.NewPKI(t)
	srv := dlocktest.Start(t, dlocktest.Options{RefCount: true, Auth: &dlocktest.Auth{PKI: pki, ClientCA: true, Tokens: map[string]string{token: "n"}}})
	dir, err := os.MkdirTemp("", "dlcc") // short: unix socket paths are limited
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	cert, key := pki.ClientCert("n")
	tokenFile := filepath.Join(dir, "token")
	os.WriteFile(tokenFile, []byte(token+"\n"), 0o600)
	args := []string{"--root", filepath.Join(dir, "shared"), "--socket", filepath.Join(dir, "c.sock"), "--server", srv.URL(), "--node", "n",
		"--ca", pki.CAFile, "--cert", cert, "--key", key, "--token-file", tokenFile}

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	ready := make(chan struct{})
	errc := make(chan error, 1)
	go func() { errc <- run(ctx, args, func(string) string { return "" }, io.Discard, func() { close(ready) }) }()
	select {
	case <-ready:
	case err := <-errc:
		t.Fatalf("run: %v", err)
	}
	// The store connected n's session stream before it was ready.
	if n := srv.Metric("dlock_event_streams"); n != 1 {
		t.Fatalf("%v event streams open, want n's session stream", n)
	}
	if n := srv.Metric("dlock_auth_refusals_total"); n != 0 {
		t.Fatalf("%v requests refused", n)
	}
	cancel()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}

	os.WriteFile(tokenFile, []byte("s3cret-unknown\n"), 0o600)
	err = run(t.Context(), args, func(string) string { return "" }, io.Discard, nil)
	if err == nil || !strings.Contains(err.Error(), "unauthorized") || strings.Contains(err.Error(), "s3cret") {
		t.Fatalf("unknown token: %v, want unauthorized without the token", err)
	}
	if srv.Metric("dlock_auth_refusals_total", "reason", "unknown_token") == 0 {
		t.Fatal("the server counted no refusal of the unknown token")
	}
}
