package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/internal/dlocktest"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/lock"
)

// secureServe is a real `dlock serve` process with a token file, TLS and a
// client CA (docs/SECURITY.md), and the credential files of its nodes.
type secureServe struct {
	t   *testing.T
	dir string
	pki *dlocktest.PKI
	url string
}

// startSecureServe runs `dlock serve` on 127.0.0.1 with a token file naming
// every node (tok(NODE) NODE) and the operator token tok("op") *.
func startSecureServe(t *testing.T, nodes ...string) *secureServe {
	s := &secureServe{t: t, dir: t.TempDir(), pki: dlocktest.NewPKI(t)}
	var tokens strings.Builder
	tokens.WriteString("# test tokens\n" + tok("op") + " *\n")
	for _, n := range nodes {
		fmt.Fprintf(&tokens, "%s %s\n", tok(n), n)
	}
	tokenFile := filepath.Join(s.dir, "tokens")
	if err := os.WriteFile(tokenFile, []byte(tokens.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	cert, key := s.pki.ServerCert()
	cmd := exec.Command(dlockBinary(t), "serve", "--listen", "127.0.0.1:0", "--refcount", "server", "--data-dir", filepath.Join(s.dir, "data"),
		"--token-file", tokenFile, "--tls-cert", cert, "--tls-key", key, "--client-ca", s.pki.CAFile)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var logs kit.Buffer
	done := make(chan struct{})
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
		<-done
		if t.Failed() {
			t.Logf("dlock serve:\n%s", logs.String())
		}
	})
	addr := make(chan string, 1)
	re := regexp.MustCompile(`addr=(\S+)`)
	go func() {
		defer close(done)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			logs.Write([]byte(sc.Text() + "\n"))
			if m := re.FindStringSubmatch(sc.Text()); m != nil {
				select {
				case addr <- m[1]:
				default:
				}
			}
		}
		io.Copy(io.Discard, stderr)
	}()
	select {
	case a := <-addr:
		s.url = "https://" + a
	case <-time.After(30 * time.Second):
		t.Fatal("dlock serve logged no listen address")
	}
	return s
}

// tok is node's token in the test's token file: the server takes tokens
// of 16 characters or more.
func tok(node string) string { return "tok-" + node + "-0123456789abcdef" }

// files writes node's credential files: a certificate naming it, and its
// token file in the server's "TOKEN NODE_ID" form.
func (s *secureServe) files(node, token string) (cert, key, tokenFile string) {
	cert, key = s.pki.ClientCert(node)
	tokenFile = filepath.Join(s.dir, "token-"+node+"-"+token)
	if err := os.WriteFile(tokenFile, []byte(token+" "+node+"\n"), 0o600); err != nil {
		s.t.Fatal(err)
	}
	return cert, key, tokenFile
}

// env is node's DLOCK_* environment for the dlock commands.
func (s *secureServe) env(node string) map[string]string {
	cert, key, tokenFile := s.files(node, tok(node))
	return map[string]string{"DLOCK_SERVER": s.url, "DLOCK_NODE": node, "DLOCK_CA": s.pki.CAFile,
		"DLOCK_CERT": cert, "DLOCK_KEY": key, "DLOCK_TOKEN_FILE": tokenFile}
}

// countingClient is node's Client with certNode's certificate and token,
// whose short requests and connections are counted.
type countingClient struct {
	*client.Client
	requests, dials atomic.Int64
}

func (s *secureServe) client(t *testing.T, node, certNode, token string) *countingClient {
	t.Helper()
	cert, key := s.pki.ClientCert(certNode)
	cfg, err := client.TLSConfigFromFiles(s.pki.CAFile, cert, key)
	if err != nil {
		t.Fatal(err)
	}
	cc := &countingClient{}
	tr := &http.Transport{TLSClientConfig: cfg}
	d := &net.Dialer{}
	tr.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		cc.dials.Add(1)
		return d.DialContext(ctx, network, addr)
	}
	short := &http.Client{Transport: roundTripper(func(r *http.Request) (*http.Response, error) {
		cc.requests.Add(1)
		return tr.RoundTrip(r)
	})}
	cc.Client = &client.Client{Server: s.url, Node: node, TLSConfig: cfg, Token: token, ShortClient: short,
		MaxRetries: 3, RetryInterval: 10 * time.Millisecond, PollInterval: 50 * time.Millisecond, RenewInterval: 100 * time.Millisecond}
	t.Cleanup(func() { cc.Close(); tr.CloseIdleConnections() })
	return cc
}

type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// TestSecureServeHonestFlows: against `dlock serve` with a token file, TLS
// and a client CA, each node with its own certificate and token: a lock,
// a failure handed off by the session stream, a success that makes the
// last waiter skip, reference counts, and `dlock run` exactly once.
func TestSecureServeHonestFlows(t *testing.T) {
	nodes := []string{"a", "b", "c", "n0", "n1", "n2", "n3"}
	s := startSecureServe(t, nodes...)
	ctx := t.Context()
	a, b, c := s.client(t, "a", "a", tok("a")), s.client(t, "b", "b", tok("b")), s.client(t, "c", "c", tok("c"))
	req := client.Request{Type: lock.Pull, Resource: "sha256:layer"}
	waitQueue := func(n int) {
		t.Helper()
		kit.Await(t, fmt.Sprintf("%d waiters", n), func() error {
			st, err := a.Status(ctx, req.Type, req.Resource)
			if err == nil && st.QueueLength != n {
				err = fmt.Errorf("%d waiting", st.QueueLength)
			}
			return err
		})
	}
	ra, err := a.Lock(ctx, req)
	if err != nil || !ra.Acquired {
		t.Fatalf("a: %+v %v", ra, err)
	}
	bDone := make(chan struct{})
	var rb, rc client.Result
	var errB, errC error
	go func() { defer close(bDone); rb, errB = b.Lock(ctx, req) }()
	waitQueue(1)
	cDone := make(chan struct{})
	go func() { defer close(cDone); rc, errC = c.Lock(ctx, req) }()
	waitQueue(2)
	if err := a.Unlock(ctx, req, errors.New("download failed")); err != nil {
		t.Fatal(err)
	}
	<-bDone
	if errB != nil || !rb.Acquired {
		t.Fatalf("b after a's failure: %+v %v, want acquired", rb, errB)
	}
	if err := b.Unlock(ctx, req, nil); err != nil {
		t.Fatal(err)
	}
	<-cDone
	if errC != nil || !rc.Skipped || rc.SkippedBy != "b" {
		t.Fatalf("c after b's success: %+v %v, want skipped by b", rc, errC)
	}
	// b's successful pull and c's skip each hold a reference
	// (docs/DESIGN.md, "Reference rules"); a adds one, then releases it.
	if rcnt, err := a.AddRef(ctx, req.Resource); err != nil || rcnt.Count != 3 {
		t.Fatalf("a adds a reference: %+v %v, want 3", rcnt, err)
	}
	if rcnt, err := a.ReleaseRef(ctx, req.Resource); err != nil || !slices.Equal(rcnt.Nodes, []string{"b", "c"}) {
		t.Fatalf("a releases its reference: %+v %v, want b's and c's", rcnt, err)
	}

	// dlock run: four processes, four nodes, one run.
	runs := filepath.Join(t.TempDir(), "runs")
	statuses, stderrs := make([]int, 4), make([]string, 4)
	var wg sync.WaitGroup
	for i := range 4 {
		env := s.env(fmt.Sprint("n", i))
		wg.Go(func() {
			_, stderrs[i], statuses[i] = dlockWith(t, env, "run", "--resource", "sha256:run", "--", "sh", "-c", "echo run >> "+runs+"; sleep 0.2")
		})
	}
	wg.Wait()
	if n := lines(t, runs); n != 1 {
		t.Fatalf("the command ran %d times, want 1: %q", n, stderrs)
	}
	for i, st := range statuses {
		if st != 0 {
			t.Fatalf("n%d exited %d: %s", i, st, stderrs[i])
		}
	}
	if count(statuses, 0) != 4 || strings.Count(strings.Join(stderrs, ""), "skipped: done by n") != 3 {
		t.Fatalf("statuses %v, stderrs %q: want one run and three skips", statuses, stderrs)
	}
}

// TestSecureServeWrongCredentials: from the client's side, a credential
// the server refuses is a clear error after one request (or one TLS
// handshake), never retried, and never quoting the token.
func TestSecureServeWrongCredentials(t *testing.T) {
	s := startSecureServe(t, "a", "b")
	ctx := t.Context()
	req := client.Request{Type: lock.Pull, Resource: "r"}
	for _, tc := range []struct {
		name, certNode, token, code string
		status                      int
	}{
		{"no token", "a", "", "unauthorized", http.StatusUnauthorized},
		{"unknown token", "a", "s3cret-unknown-0123456789", "unauthorized", http.StatusUnauthorized},
		{"another node's token", "a", tok("b"), "forbidden", http.StatusForbidden},
		{"another node's certificate", "b", tok("a"), "forbidden", http.StatusForbidden},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := s.client(t, "a", tc.certNode, tc.token)
			_, err := c.TryLock(ctx, req)
			ae, ok := errors.AsType[*api.Error](err)
			if !ok || ae.Code != tc.code || ae.Status != tc.status {
				t.Fatalf("TryLock: %v, want %d %s", err, tc.status, tc.code)
			}
			if n := c.requests.Load(); n != 1 {
				t.Fatalf("%d requests, want 1: a %d is not retried", n, tc.status)
			}
			if tc.token != "" && strings.Contains(err.Error(), tc.token) {
				t.Fatalf("the error names the token: %v", err)
			}
		})
	}
	t.Run("no client certificate", func(t *testing.T) {
		cfg, err := client.TLSConfigFromFiles(s.pki.CAFile, "", "")
		if err != nil {
			t.Fatal(err)
		}
		var dials atomic.Int64
		d := &net.Dialer{}
		tr := &http.Transport{TLSClientConfig: cfg, DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			dials.Add(1)
			return d.DialContext(ctx, network, addr)
		}}
		defer tr.CloseIdleConnections()
		c := &client.Client{Server: s.url, Node: "a", TLSConfig: cfg, Token: tok("a"), ShortClient: &http.Client{Transport: tr}, MaxRetries: 3, RetryInterval: 10 * time.Millisecond}
		defer c.Close()
		_, err = c.TryLock(ctx, req)
		if err == nil || !strings.Contains(err.Error(), "certificate") {
			t.Fatalf("TryLock without a certificate: %v", err)
		}
		if n := dials.Load(); n != 1 {
			t.Fatalf("%d connections, want 1: a TLS refusal is not retried", n)
		}
	})
	// The command line: a clear message and status 1.
	env := s.env("a")
	wrong := filepath.Join(s.dir, "wrong")
	os.WriteFile(wrong, []byte("s3cret-wrong\n"), 0o600)
	env["DLOCK_TOKEN_FILE"] = wrong
	if _, errOut, st := dlockWith(t, env, "lock", "--resource", "r"); st != 1 || !strings.Contains(errOut, "unauthorized") || strings.Contains(errOut, "s3cret") {
		t.Fatalf("dlock lock with a wrong token: %d %q", st, errOut)
	}
	env = s.env("a")
	env["DLOCK_NODE"] = "b"
	if _, errOut, st := dlockWith(t, env, "run", "--resource", "r", "--", "true"); st != 1 || !strings.Contains(errOut, "forbidden") {
		t.Fatalf("dlock run as another node: %d %q", st, errOut)
	}
	env = s.env("a")
	delete(env, "DLOCK_CA")
	if _, errOut, st := dlockWith(t, env, "status", "--resource", "r"); st != 1 || !strings.Contains(errOut, "certificate signed by unknown authority") || !strings.Contains(errOut, "--ca") {
		t.Fatalf("dlock status without the CA: %d %q", st, errOut)
	}
}
