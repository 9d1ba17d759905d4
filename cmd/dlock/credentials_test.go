package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/dlock/dlock/internal/dlocktest"
)

// credEnv is a dlock server that checks identities as docs/SECURITY.md
// says (HTTPS, client certificates of its CA, bearer tokens: tok(NODE)
// for each node, tok("op") for the operator), and each node's credential
// files.
type credEnv struct {
	t   *testing.T
	dir string
	pki *dlocktest.PKI
	srv *dlocktest.Server
}

func startCredEnv(t *testing.T, nodes ...string) *credEnv {
	e := &credEnv{t: t, dir: t.TempDir(), pki: dlocktest.NewPKI(t)}
	tokens := map[string]string{tok("op"): "*"}
	for _, n := range nodes {
		tokens[tok(n)] = n
	}
	e.srv = dlocktest.Start(t, dlocktest.Options{RefCount: true, Auth: &dlocktest.Auth{PKI: e.pki, ClientCA: true, Tokens: tokens}})
	return e
}

// refusals is how many requests the server's identity checks refused
// (401 or 403) for reason, or for any reason without one.
func (e *credEnv) refusals(reason ...string) float64 {
	e.t.Helper()
	if len(reason) == 0 {
		return e.srv.Metric("dlock_auth_refusals_total")
	}
	return e.srv.Metric("dlock_auth_refusals_total", "reason", reason[0])
}

// files are a node's credential files, the token file in the server's
// "TOKEN NODE_ID" form: a line of the server's file handed to the node.
func (e *credEnv) files(node string) (cert, key, tokenFile string) {
	cert, key = e.pki.ClientCert(node)
	tokenFile = filepath.Join(e.dir, "token-"+node)
	if err := os.WriteFile(tokenFile, []byte(tok(node)+" "+node+"\n"), 0o600); err != nil {
		e.t.Fatal(err)
	}
	return cert, key, tokenFile
}

// env is node's environment: every setting from DLOCK_* variables.
func (e *credEnv) env(node string) map[string]string {
	cert, key, tokenFile := e.files(node)
	return map[string]string{
		"DLOCK_SERVER": e.srv.URL(), "DLOCK_NODE": node, "DLOCK_CA": e.pki.CAFile,
		"DLOCK_CERT": cert, "DLOCK_KEY": key, "DLOCK_TOKEN_FILE": tokenFile,
	}
}

// dlockWith runs the binary with env added to the process's environment.
func dlockWith(t *testing.T, env map[string]string, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.Command(dlockBinary(t), args...)
	cmd.Env = os.Environ()
	for k, v := range env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if _, ok := errors.AsType[*exec.ExitError](err); err != nil && !ok {
		t.Fatal(err)
	}
	return out.String(), errb.String(), cmd.ProcessState.ExitCode()
}

// inProcess runs the command in this process, as main does, with env as
// its whole environment; it returns stdout, stderr and the exit status.
func inProcess(t *testing.T, env map[string]string, args ...string) (string, string, int) {
	t.Helper()
	var out, errb bytes.Buffer
	err := run(t.Context(), args, func(k string) string { return env[k] }, strings.NewReader(""), &out, &errb)
	st := exitCode(err, &errb)
	return out.String(), errb.String(), st
}

// TestRunOnceWithCredentials: four `dlock run` processes, each a node with
// its own certificate and token from DLOCK_* variables, race for one
// resource: the command runs once, the others skip. Then one fails and
// the next takes over.
func TestRunOnceWithCredentials(t *testing.T) {
	nodes := []string{"n0", "n1", "n2", "n3"}
	e := startCredEnv(t, nodes...)
	dir := t.TempDir()
	runs := filepath.Join(dir, "runs")
	race := func(resource, script string) ([]int, []string) {
		statuses, stderrs := make([]int, len(nodes)), make([]string, len(nodes))
		var wg sync.WaitGroup
		for i, n := range nodes {
			env := e.env(n)
			wg.Go(func() {
				_, stderrs[i], statuses[i] = dlockWith(t, env, "run", "--resource", resource, "--", "sh", "-c", script)
			})
		}
		wg.Wait()
		return statuses, stderrs
	}
	statuses, stderrs := race("sha256:layer", "echo run >> "+runs+"; sleep 0.2")
	if n := lines(t, runs); n != 1 {
		t.Fatalf("the command ran %d times, want 1: %q", n, stderrs)
	}
	skips := 0
	for i, st := range statuses {
		if st != 0 {
			t.Errorf("%s exited %d: %s", nodes[i], st, stderrs[i])
		}
		if strings.Contains(stderrs[i], "skipped: done by n") {
			skips++
		}
	}
	if skips != 3 {
		t.Fatalf("%d processes skipped, want 3: %q", skips, stderrs)
	}

	failed := filepath.Join(dir, "failed")
	statuses, stderrs = race("sha256:other", "echo run >> "+runs+"; sleep 0.1; if mkdir "+failed+" 2>/dev/null; then exit 3; fi")
	if n := lines(t, runs); n != 3 {
		t.Fatalf("the failing command ran %d times, want 2 (a failure, a take-over): %q", n-1, stderrs)
	}
	if fmt.Sprint(count(statuses, 3), count(statuses, 0)) != "1 3" {
		t.Fatalf("statuses %v, want one 3 and three 0", statuses)
	}
	if n := e.refusals(); n != 0 {
		t.Fatalf("%v requests refused", n)
	}
}

func count(xs []int, x int) int {
	n := 0
	for _, v := range xs {
		if v == x {
			n++
		}
	}
	return n
}

// TestSubcommandsWithCredentials: lock, hand-off by a failed unlock,
// status and refcount, with credentials from flags (node a) and from the
// environment (node b).
func TestSubcommandsWithCredentials(t *testing.T) {
	e := startCredEnv(t, "a", "b")
	cert, key, tokenFile := e.files("a")
	flags := []string{"--server", e.srv.URL(), "--node", "a", "--ca", e.pki.CAFile, "--cert", cert, "--key", key, "--token-file", tokenFile}
	envB := e.env("b")
	a := func(args ...string) (string, string, int) {
		return dlockWith(t, nil, append(args, flags...)...)
	}
	if out, errOut, st := a("lock", "--resource", "r", "--human"); st != 0 || !strings.HasPrefix(out, "acquired pull:r") {
		t.Fatalf("a lock: %d %q %q", st, out, errOut)
	}
	if out, errOut, st := dlockWith(t, envB, "lock", "--resource", "r", "--human"); st != 0 || out != "queued for pull:r at position 1 behind a\n" {
		t.Fatalf("b lock: %d %q %q", st, out, errOut)
	}
	if out, errOut, st := a("unlock", "--resource", "r", "--fail", "disk full", "--human"); st != 0 || out != "released pull:r; next holder b\n" {
		t.Fatalf("a unlock --fail: %d %q %q", st, out, errOut)
	}
	if out, _, _ := dlockWith(t, envB, "status", "--resource", "r", "--human"); !strings.HasPrefix(out, "pull:r held by b") {
		t.Fatalf("status: %q", out)
	}
	if out, errOut, st := dlockWith(t, envB, "unlock", "--resource", "r", "--human"); st != 0 || out != "released pull:r; now free\n" {
		t.Fatalf("b unlock: %d %q %q", st, out, errOut)
	}
	// b's successful pull gave it a reference (refcount=server).
	if out, _, st := dlockWith(t, envB, "refcount", "--resource", "r", "--human"); st != 0 || out != "r: 1 node(s) b\n" {
		t.Fatalf("refcount: %d %q", st, out)
	}
	if out, _, st := a("refcount", "--resource", "r", "--add", "--human"); st != 0 || out != "r: 2 node(s) a, b\n" {
		t.Fatalf("refcount --add: %d %q", st, out)
	}
	// The command line wins over the environment: b's variables, a's flags.
	if out, errOut, st := dlockWith(t, envB, append([]string{"refcount", "--release"}, flags...)...); st != 0 || !strings.Contains(out, `"node_id":"a","released":1`) {
		t.Fatalf("refcount --release as a over b's environment: %d %q %q", st, out, errOut)
	}
}

// TestCredentialErrors: a missing or unusable credential stops the command
// with a message naming it, before any connection; a refused one is the
// server's clear error after one request; no message names a token.
func TestCredentialErrors(t *testing.T) {
	e := startCredEnv(t, "a", "b")
	good := e.env("a")
	with := func(k, v string) map[string]string {
		env := map[string]string{}
		for key, val := range good {
			env[key] = val
		}
		env[k] = v
		return env
	}
	dir := t.TempDir()
	garbage := filepath.Join(dir, "garbage")
	os.WriteFile(garbage, []byte("not a certificate"), 0o600)
	serverFile := filepath.Join(dir, "server-tokens")
	os.WriteFile(serverFile, []byte("# the server's file\n"+tok("a")+" a\n"+tok("b")+" b\n"), 0o600)
	_, keyB, _ := e.files("b")
	for _, tc := range []struct {
		name   string
		env    map[string]string
		status int
		want   string
	}{
		{"missing token file", with("DLOCK_TOKEN_FILE", filepath.Join(dir, "nope")), 1, "token file: open " + filepath.Join(dir, "nope") + ": no such file"},
		{"token file is a folder", with("DLOCK_TOKEN_FILE", dir), 1, "is a directory"},
		{"the server's token file", with("DLOCK_TOKEN_FILE", serverFile), 1, "holds 2 lines"},
		{"missing CA", with("DLOCK_CA", filepath.Join(dir, "nope.pem")), 1, "CA file: open"},
		{"CA not PEM", with("DLOCK_CA", garbage), 1, "holds no PEM certificate"},
		{"missing key", with("DLOCK_KEY", filepath.Join(dir, "nokey.pem")), 1, "client key: stat"},
		{"mismatched key", with("DLOCK_KEY", keyB), 1, "private key does not match public key"},
		{"cert without key", with("DLOCK_KEY", ""), 1, "needs its key"},
		{"TLS flags for http://", with("DLOCK_SERVER", "http://127.0.0.1:1"), 2, "need an https:// server"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := e.srv.Connections()
			for _, cmd := range []string{"lock", "unlock", "status", "refcount", "run"} {
				args := []string{cmd, "--resource", "r"}
				if cmd == "run" {
					args = append(args, "--", "true")
				}
				_, errOut, st := inProcess(t, tc.env, args...)
				if st != tc.status || !strings.Contains(errOut, tc.want) {
					t.Errorf("%s: status %d, %q; want %d and %q", cmd, st, errOut, tc.status, tc.want)
				}
			}
			_, errOut, st := inProcess(t, tc.env, "bench", "--scenario", "pairs", "--duration", "100ms")
			if st != tc.status || !strings.Contains(errOut, tc.want) {
				t.Errorf("bench: status %d, %q; want %d and %q", st, errOut, tc.status, tc.want)
			}
			if n := e.srv.Connections() - before; n != 0 {
				t.Errorf("%d connections made with a broken credential", n)
			}
		})
	}

	// A readable but refused token: the server's answer, once, without
	// the token.
	wrong := filepath.Join(dir, "wrong")
	os.WriteFile(wrong, []byte("s3cret-wrong\n"), 0o600)
	locks := func() float64 { return e.srv.Metric("dlock_http_request_duration_seconds", "endpoint", "/lock") }
	before, unknown := locks(), e.refusals("unknown_token")
	_, errOut, st := dlockWith(t, with("DLOCK_TOKEN_FILE", wrong), "lock", "--resource", "r")
	if st != 1 || !strings.Contains(errOut, "unauthorized") || strings.Contains(errOut, "s3cret") {
		t.Fatalf("wrong token: %d %q; want 1 and unauthorized, without the token", st, errOut)
	}
	if n := locks() - before; n != 1 {
		t.Fatalf("%v /lock requests with a wrong token, want 1", n)
	}
	if n := e.refusals("unknown_token") - unknown; n != 1 {
		t.Fatalf("%v refusals of an unknown token, want 1", n)
	}
	// Another node's token: forbidden.
	other := e.refusals("other_node")
	_, errOut, st = dlockWith(t, with("DLOCK_NODE", "b"), "run", "--resource", "r", "--", "true")
	if st != 1 || !strings.Contains(errOut, "forbidden") {
		t.Fatalf("a's credentials as node b: %d %q", st, errOut)
	}
	if e.refusals("other_node") == other {
		t.Fatal("the server counted no refusal of a's credentials as node b")
	}
}

// TestBenchWithCredentials: dlock bench against an https:// server with a
// client certificate and an operator token; the certificate names the
// operator too, for the server's CPU on /metrics.
func TestBenchWithCredentials(t *testing.T) {
	e := startCredEnv(t)
	cert, key := e.pki.ClientCert("w0", "w1", "*")
	tokenFile := filepath.Join(t.TempDir(), "op")
	os.WriteFile(tokenFile, []byte(tok("op")+" *\n"), 0o600)
	env := map[string]string{"DLOCK_SERVER": e.srv.URL(), "DLOCK_CA": e.pki.CAFile, "DLOCK_CERT": cert, "DLOCK_KEY": key, "DLOCK_TOKEN_FILE": tokenFile}
	out, errOut, st := inProcess(t, env, "bench", "--scenario", "pairs", "--duration", "1s", "--concurrency", "2", "--json")
	var res struct {
		Results []struct {
			Ops       int64
			ServerCPU float64 `json:"server_cpu_us_per_op"`
		}
	}
	if st != 0 || json.Unmarshal([]byte(out), &res) != nil || len(res.Results) != 1 || res.Results[0].Ops == 0 || res.Results[0].ServerCPU <= 0 {
		t.Fatalf("bench over TLS: %d %q %q", st, out, errOut)
	}
	// Each connection is one TLS handshake: keep-alive holds. Two
	// workers, and a scrape of /metrics before and one after.
	if n := e.srv.Connections(); n != 2+2 {
		t.Fatalf("%d connections (TLS handshakes) for two keep-alive workers and two scrapes, want 4", n)
	}
	if n := e.refusals(); n != 0 {
		t.Fatalf("%v requests refused", n)
	}
}
