package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/auth"
	"github.com/dlock/dlock/internal/auth/authtest"
	"github.com/dlock/dlock/internal/dlocktest/kit"
)

func TestParseServeCredentials(t *testing.T) {
	env := map[string]string{
		"DLOCK_TOKEN_FILE": "/etc/dlock/tokens",
		"DLOCK_TLS_CERT":   "/etc/dlock/server.crt",
		"DLOCK_TLS_KEY":    "/etc/dlock/server.key",
		"DLOCK_CLIENT_CA":  "/etc/dlock/ca.crt",
	}
	c, err := parseServe([]string{"--client-ca", "/x/ca.crt"}, func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.creds != (credConfig{"/etc/dlock/tokens", "/etc/dlock/server.crt", "/etc/dlock/server.key", "/x/ca.crt"}) {
		t.Fatalf("credentials %+v", c.creds)
	}
	d, err := parseServe(nil, func(string) string { return "" }, io.Discard)
	if err != nil || d.creds != (credConfig{}) {
		t.Fatalf("defaults: %+v %v", d.creds, err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--tls-cert", "c"}, "--tls-cert and --tls-key"},
		{[]string{"--tls-key", "k"}, "--tls-cert and --tls-key"},
		{[]string{"--client-ca", "ca"}, "--client-ca needs --tls-cert"},
	} {
		if _, err := parseServe(tc.args, func(string) string { return "" }, io.Discard); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want %q", tc.args, err, tc.want)
		}
	}
}

// TestServeCredentialErrors: a missing or unusable credential stops
// start-up with a message naming the flag and the file (and the line of a
// token file, never the token).
func TestServeCredentialErrors(t *testing.T) {
	dir := t.TempDir()
	ca := authtest.NewCA(t, "ca")
	cert, key := ca.Server(t).Write(t, dir, "server")
	other, _ := ca.Server(t).Write(t, dir, "other")
	caFile := filepath.Join(dir, "ca.crt")
	authtest.WriteFile(t, caFile, ca.PEM)
	junk := filepath.Join(dir, "junk")
	authtest.WriteFile(t, junk, []byte("junk\n"))
	badTokens := filepath.Join(dir, "tokens")
	const secret = "a-secret-that-must-not-be-logged"
	authtest.WriteFile(t, badTokens, []byte("# ok\n"+secret+"\n"))
	missing := filepath.Join(dir, "missing")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--token-file", missing}, "--token-file: token file: open " + missing},
		{[]string{"--token-file", badTokens}, badTokens + ":2: want TOKEN NODE_ID"},
		{[]string{"--tls-cert", missing, "--tls-key", key}, "--tls-cert " + missing},
		{[]string{"--tls-cert", other, "--tls-key", key}, "private key does not match"},
		{[]string{"--tls-cert", cert, "--tls-key", key, "--client-ca", missing}, "--client-ca: open " + missing},
		{[]string{"--tls-cert", cert, "--tls-key", key, "--client-ca", junk}, "--client-ca " + junk + " holds no PEM certificate"},
	} {
		c, err := parseServe(append([]string{"--listen", "127.0.0.1:0", "--data-dir", ""}, tc.args...), func(string) string { return "" }, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		var log bytes.Buffer
		err = runServer(t.Context(), c, &log)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want %q", tc.args, err, tc.want)
		}
		if err != nil && strings.Contains(err.Error()+log.String(), secret) {
			t.Errorf("%v: the token is shown: %v", tc.args, err)
		}
	}
}

// cmdToken runs dlock token with args.
func cmdToken(args []string, stdout, stderr io.Writer) error {
	return run(context.Background(), append([]string{"token"}, args...), func(string) string { return "" }, nil, stdout, stderr)
}

func TestTokenNew(t *testing.T) {
	var out1, out2 bytes.Buffer
	if err := cmdToken([]string{"new", "node-a"}, &out1, io.Discard); err != nil {
		t.Fatal(err)
	}
	if err := cmdToken([]string{"new", "*"}, &out2, io.Discard); err != nil {
		t.Fatal(err)
	}
	re := regexp.MustCompile(`^([A-Za-z0-9_-]{43}) (node-a|\*)\n$`)
	m1, m2 := re.FindStringSubmatch(out1.String()), re.FindStringSubmatch(out2.String())
	if m1 == nil || m2 == nil || m1[1] == m2[1] {
		t.Fatalf("token lines %q %q", out1.String(), out2.String())
	}
	path := filepath.Join(t.TempDir(), "tokens")
	authtest.WriteFile(t, path, append(out1.Bytes(), out2.Bytes()...))
	tk, err := auth.LoadTokens(path)
	if err != nil {
		t.Fatal(err)
	}
	if g, ok := tk.Lookup([]byte(m1[1])); !ok || g.Node != "node-a" {
		t.Fatalf("the printed line does not load: %+v %v", g, ok)
	}
	if g, ok := tk.Lookup([]byte(m2[1])); !ok || !g.Operator() {
		t.Fatalf("the operator's line does not load: %+v %v", g, ok)
	}
	for _, args := range [][]string{nil, {"new"}, {"old", "a"}, {"new", "a", "b"}, {"new", ""}, {"new", " a"}, {"new", "a\x01"}, {"new", "#a"}} {
		var ue usageError
		if err := cmdToken(args, io.Discard, io.Discard); !errors.As(err, &ue) {
			t.Errorf("token %q: %v, want a usage error", args, err)
		}
	}
}

// proc is a dlock serve process.
type proc struct {
	cmd  *exec.Cmd
	addr string
	log  kit.Buffer
	done chan struct{}
}

// startServe runs the real binary with args; it is stopped (SIGTERM) after
// the test.
func startServe(t *testing.T, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(dlockBinary(t), append([]string{"serve", "--listen", "127.0.0.1:0", "--data-dir", ""}, args...)...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{cmd: cmd, done: make(chan struct{})}
	addr := make(chan string, 1)
	go func() {
		defer close(p.done)
		sc := bufio.NewScanner(stderr)
		re := regexp.MustCompile(`msg="dlock serving" addr=(\S+)`)
		for sc.Scan() {
			p.log.Write([]byte(sc.Text() + "\n"))
			if m := re.FindStringSubmatch(sc.Text()); m != nil {
				addr <- m[1]
			}
		}
		close(addr)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		<-p.done
		_ = cmd.Wait()
	})
	a, ok := <-addr
	if !ok {
		<-p.done
		t.Fatalf("dlock serve did not start:\n%s", p.logs())
	}
	p.addr = a
	return p
}

func (p *proc) logs() string { return p.log.String() }

// hup sends SIGHUP and waits until the process logged the reload of what.
func (p *proc) hup(t *testing.T, what string) {
	t.Helper()
	n := strings.Count(p.logs(), what)
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second) // bounds a broken run only
	for strings.Count(p.logs(), what) == n {
		if time.Now().After(deadline) {
			t.Fatalf("no %q logged after SIGHUP:\n%s", what, p.logs())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// tlsClient is an HTTP/1.1 client that trusts pool and sends cert.
func tlsClient(pool *x509.CertPool, cert *tls.Certificate) *http.Client {
	cfg := &tls.Config{RootCAs: pool, ServerName: "localhost"}
	if cert != nil {
		cfg.Certificates = []tls.Certificate{*cert}
	}
	return &http.Client{Transport: &http.Transport{TLSClientConfig: cfg}, Timeout: 20 * time.Second}
}

// call sends one request with an optional bearer token and returns the
// status and the body.
func call(t *testing.T, c *http.Client, method, url, token, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(method, url, strings.NewReader(body))
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(data)
}

// serverSerial is the serial number of the certificate a new connection
// to addr is shown.
func serverSerial(t *testing.T, addr string, pool *x509.CertPool) string {
	t.Helper()
	c, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: pool, ServerName: "localhost"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	return c.ConnectionState().PeerCertificates[0].SerialNumber.String()
}

// openStream opens node's session stream and reads its subscribed event.
func openStream(t *testing.T, c *http.Client, base, token, node string) (*bufio.Reader, func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "GET", base+"/subscribe?node_id="+node, nil)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	// No client timeout: the stream is meant to last; the cancel ends it.
	resp, err := (&http.Client{Transport: c.Transport}).Do(req)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	if resp.StatusCode != 200 {
		cancel()
		t.Fatalf("stream of %s: %d", node, resp.StatusCode)
	}
	r := bufio.NewReader(resp.Body)
	if ev := nextEvent(t, r); ev != "subscribed" {
		t.Fatalf("first event %q", ev)
	}
	return r, func() { cancel(); resp.Body.Close() }
}

// nextEvent returns the name of the next event; "" when the stream ended.
func nextEvent(t *testing.T, r *bufio.Reader) string {
	t.Helper()
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			return ""
		}
		if ev, ok := strings.CutPrefix(strings.TrimSpace(line), "event: "); ok {
			return ev
		}
	}
}

// TestServeSIGHUP: the real process, with certificates made by
// crypto/x509 and a token file: on SIGHUP it serves a new server
// certificate to new connections and drops a removed token, whose stream
// ends, while the other node's stream goes on. A node's certificate for
// node-a cannot act as node-b. No token is ever logged.
func TestServeSIGHUP(t *testing.T) {
	dir := t.TempDir()
	ca := authtest.NewCA(t, "dlock CA")
	cert, key := ca.Server(t).Write(t, dir, "server")
	caFile := filepath.Join(dir, "ca.crt")
	authtest.WriteFile(t, caFile, ca.PEM)
	tokA, tokB := auth.NewToken(), auth.NewToken()
	tokens := filepath.Join(dir, "tokens")
	authtest.WriteFile(t, tokens, []byte(tokA+" node-a\n"+tokB+" node-b\n"))
	p := startServe(t, "--tls-cert", cert, "--tls-key", key, "--client-ca", caFile, "--token-file", tokens)
	base := "https://" + p.addr
	certA, certB := ca.Node(t, "node-a", "node-a").TLS(t), ca.Node(t, "node-b", "node-b").TLS(t)
	ca2 := authtest.NewCA(t, "second CA") // trusted for nothing yet
	stranger := ca2.Node(t, "node-a").TLS(t)
	asA, asB := tlsClient(ca.Pool(), &certA), tlsClient(ca.Pool(), &certB)

	lock := func(node, res string) string {
		return fmt.Sprintf(`{"type":"pull","resource_id":%q,"node_id":%q}`, res, node)
	}
	if st, body := call(t, asA, "POST", base+"/lock", tokA, lock("node-a", "r")); st != 200 || !strings.Contains(body, `"acquired":true`) {
		t.Fatalf("node-a as node-a: %d %s", st, body)
	}
	if st, body := call(t, asA, "POST", base+"/unlock", tokA, lock("node-b", "r")); st != 403 || !strings.Contains(body, `"code":"forbidden"`) {
		t.Fatalf("node-a's certificate as node-b: %d %s", st, body)
	}
	if st, _ := call(t, asA, "POST", base+"/unlock", tokB, lock("node-b", "r")); st != 403 {
		t.Fatalf("node-b's token with node-a's certificate: %d", st)
	}
	if st, _ := call(t, tlsClient(ca.Pool(), nil), "GET", base+"/status?type=pull&resource_id=r", tokA, ""); st != 401 {
		t.Fatalf("no client certificate: %d", st)
	}
	if st, _ := call(t, tlsClient(ca.Pool(), nil), "GET", base+"/healthz", "", ""); st != 200 {
		t.Fatalf("/healthz without credentials: %d", st)
	}

	sa, closeA := openStream(t, asA, base, tokA, "node-a")
	defer closeA()
	sb, closeB := openStream(t, asB, base, tokB, "node-b")
	defer closeB()

	old := serverSerial(t, p.addr, ca.Pool())
	ca.Server(t).Write(t, dir, "server")
	authtest.WriteFile(t, caFile, append(append([]byte{}, ca.PEM...), ca2.PEM...))
	authtest.WriteFile(t, tokens, []byte(tokA+" node-a\n"))
	p.hup(t, "TLS certificates reloaded")
	if serverSerial(t, p.addr, ca.Pool()) == old {
		t.Fatal("a new connection still gets the old server certificate after SIGHUP")
	}
	var bounded atomic.Bool // a broken run must not hang
	stop := time.AfterFunc(20*time.Second, func() { bounded.Store(true); closeB() })
	if ev := nextEvent(t, sb); ev != "" || bounded.Load() {
		t.Fatalf("node-b's stream, whose token was removed, got %q (cut by the test: %v)", ev, bounded.Load())
	}
	stop.Stop()
	if st, _ := call(t, asB, "GET", base+"/status?type=pull&resource_id=r", tokB, ""); st != 401 {
		t.Fatalf("a removed token: %d", st)
	}
	call(t, asA, "POST", base+"/lock", tokA, lock("node-a", "after"))
	if ev := nextEvent(t, sa); ev != "lock_assigned" {
		t.Fatalf("node-a's stream after SIGHUP: %q", ev)
	}
	if st, body := call(t, tlsClient(ca.Pool(), &stranger), "POST", base+"/lock", tokA, lock("node-a", "s")); st != 200 {
		t.Fatalf("a certificate of the CA added on SIGHUP: %d %s", st, body)
	}

	// A broken reload keeps the last good files.
	authtest.WriteFile(t, tokens, []byte("broken\n"))
	p.hup(t, "reload failed")
	if st, _ := call(t, asA, "GET", base+"/status?type=pull&resource_id=r", tokA, ""); st != 200 {
		t.Fatalf("after a failed reload: %d", st)
	}
	for _, tok := range []string{tokA, tokB} {
		if strings.Contains(p.logs(), tok) {
			t.Fatalf("a token was logged:\n%s", p.logs())
		}
	}
}

// TestOpenSSLRecipe runs docs/mkcerts.sh — the openssl commands
// docs/SECURITY.md documents — and serves with what it makes: node-a's
// certificate acts as node-a and not as node-b, the operator's reads
// /metrics, curl works with the same files, and running the script again
// then SIGHUP rotates the server certificate.
func TestOpenSSLRecipe(t *testing.T) {
	if _, err := exec.LookPath("openssl"); err != nil {
		t.Skip("openssl is not installed (make deps installs it as root)")
	}
	dir := t.TempDir()
	script := filepath.Join("..", "..", "docs", "mkcerts.sh")
	mk := func() {
		t.Helper()
		if out, err := exec.Command("sh", script, dir, "node-a", "node-b", "*").CombinedOutput(); err != nil {
			t.Fatalf("mkcerts.sh: %v\n%s", err, out)
		}
	}
	mk()
	for _, f := range []string{"ca.key", "server.key", "node-a.key", "op.key"} {
		if fi, err := os.Stat(filepath.Join(dir, f)); err != nil || fi.Mode().Perm() != 0o600 {
			t.Fatalf("%s: %v %v, want mode 0600", f, fi.Mode(), err)
		}
	}
	file := func(name string) string { return filepath.Join(dir, name) }
	p := startServe(t, "--tls-cert", file("server.crt"), "--tls-key", file("server.key"), "--client-ca", file("ca.crt"))
	base := "https://" + p.addr
	pool := x509.NewCertPool()
	caPEM, err := os.ReadFile(file("ca.crt"))
	if err != nil || !pool.AppendCertsFromPEM(caPEM) {
		t.Fatalf("ca.crt: %v", err)
	}
	pair := func(name string) *tls.Certificate {
		c, err := tls.LoadX509KeyPair(file(name+".crt"), file(name+".key"))
		if err != nil {
			t.Fatal(err)
		}
		return &c
	}
	asA, op := tlsClient(pool, pair("node-a")), tlsClient(pool, pair("op"))
	if st, body := call(t, asA, "POST", base+"/lock", "", `{"type":"pull","resource_id":"r","node_id":"node-a"}`); st != 200 {
		t.Fatalf("node-a as node-a: %d %s", st, body)
	}
	if st, _ := call(t, asA, "POST", base+"/lock", "", `{"type":"pull","resource_id":"r","node_id":"node-b"}`); st != 403 {
		t.Fatalf("node-a as node-b: %d", st)
	}
	if st, _ := call(t, asA, "GET", base+"/metrics", "", ""); st != 403 {
		t.Fatalf("node-a on /metrics: %d", st)
	}
	if st, body := call(t, op, "GET", base+"/metrics", "", ""); st != 200 || !strings.Contains(body, "dlock_auth_refusals_total") {
		t.Fatalf("the operator on /metrics: %d", st)
	}
	if _, err := exec.LookPath("curl"); err == nil {
		curl := func(node, cert string) string {
			out, err := exec.Command("curl", "-sS", "--max-time", "20", "-o", "/dev/null", "-w", "%{http_code} %{http_version}",
				"--cacert", file("ca.crt"), "--cert", file(cert+".crt"), "--key", file(cert+".key"),
				base+"/status?type=pull&resource_id=r&node_id="+node).CombinedOutput()
			if err != nil {
				t.Fatalf("curl: %v %s", err, out)
			}
			return string(out)
		}
		got := curl("node-b", "node-b")
		t.Logf("curl: %s (status, HTTP version)", got)
		if !strings.HasPrefix(got, "200 ") {
			t.Fatalf("curl as node-b: %s", got)
		}
		if got := curl("node-b", "node-a"); !strings.HasPrefix(got, "403 ") {
			t.Fatalf("curl with node-a's certificate as node-b: %s", got)
		}
	} else {
		t.Log("curl is not installed: the Go client alone was used")
	}

	old := serverSerial(t, p.addr, pool)
	mk() // the CA stays; every other certificate is new
	p.hup(t, "TLS certificates reloaded")
	if serverSerial(t, p.addr, pool) == old {
		t.Fatal("the server certificate did not change on SIGHUP")
	}
	if st, _ := call(t, tlsClient(pool, pair("node-a")), "GET", base+"/status?type=pull&resource_id=r&node_id=node-a", "", ""); st != 200 {
		t.Fatalf("a new node-a certificate: %d", st)
	}
}
