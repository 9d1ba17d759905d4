package main

// The command line itself: help, completion, exit statuses and the one
// line an error prints.

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/dlock/dlock/internal/dlocktest"
)

// cliRun runs dlock in this process with env as its whole environment.
func cliRun(env map[string]string, args ...string) (stdout, stderr string, status int) {
	var out, errb bytes.Buffer
	err := run(context.Background(), args, func(k string) string { return env[k] }, strings.NewReader(""), &out, &errb)
	st := exitCode(err, &errb)
	return out.String(), errb.String(), st
}

// TestHelpDescribesEveryCommand: each command says what it does, at
// length, and shows an example; dlock --help lists every one.
func TestHelpDescribesEveryCommand(t *testing.T) {
	root := (&cli{ctx: context.Background(), getenv: func(string) string { return "" }}).rootCommand()
	top, _, st := cliRun(nil, "--help")
	if st != 0 {
		t.Fatalf("dlock --help: status %d", st)
	}
	want := []string{"serve", "token", "bench", "lock", "unlock", "status", "refcount", "run", "completion"}
	names := map[string]bool{}
	for _, cmd := range root.Commands() {
		names[cmd.Name()] = true
	}
	for _, name := range want {
		if !names[name] && name != "completion" {
			t.Errorf("no command %s", name)
		}
		if !regexp.MustCompile(`(?m)^\s+` + name + `\s+\S`).MatchString(top) {
			t.Errorf("dlock --help does not list %s:\n%s", name, top)
		}
	}
	var cmds []string
	for _, cmd := range root.Commands() {
		cmds = append(cmds, cmd.Name())
		for _, sub := range cmd.Commands() {
			cmds = append(cmds, cmd.Name()+" "+sub.Name())
		}
	}
	for _, path := range cmds {
		out, errOut, st := cliRun(nil, append(strings.Fields(path), "--help")...)
		if st != 0 || errOut != "" {
			t.Errorf("dlock %s --help: status %d, stderr %q", path, st, errOut)
		}
		for _, part := range []string{"Usage:", "Examples:", "dlock " + path} {
			if !strings.Contains(out, part) {
				t.Errorf("dlock %s --help has no %q:\n%s", path, part, out)
			}
		}
		if cmd, _, err := root.Find(strings.Fields(path)); err != nil || cmd.Short == "" || len(cmd.Long) < 80 || cmd.Example == "" {
			t.Errorf("dlock %s: a Short, a Long of a few lines and an Example are needed", path)
		}
	}
	out, _, _ := cliRun(nil, "run", "--help")
	for _, part := range []string{"waits for --resource's lock", "runs CMD", "dlock run --resource sha256:aaa -- sh -c"} {
		if !strings.Contains(out, part) {
			t.Errorf("dlock run --help does not say %q:\n%s", part, out)
		}
	}
}

// TestCompletion: dlock completion SHELL prints cobra's script, which
// asks dlock itself (dlock __complete) for the words; those are dlock's
// commands and each command's flags.
func TestCompletion(t *testing.T) {
	for _, tc := range []struct{ shell, marker string }{
		{"bash", "complete -o default -F __start_dlock dlock"},
		{"zsh", "#compdef dlock"},
		{"fish", "complete -c dlock"},
	} {
		out, errOut, st := cliRun(nil, "completion", tc.shell)
		if st != 0 || !strings.Contains(out, tc.marker) || !strings.Contains(out, "__complete") {
			t.Errorf("completion %s: status %d %q, script without %q:\n%.400s", tc.shell, st, errOut, tc.marker, out)
		}
	}
	out, _, _ := cliRun(nil, "__complete", "")
	for _, c := range []string{"serve", "lock", "unlock", "status", "refcount", "run", "token", "bench", "completion"} {
		if !regexp.MustCompile(`(?m)^` + c + `\t`).MatchString(out) {
			t.Errorf("dlock __complete '' does not offer %s:\n%s", c, out)
		}
	}
	out, _, _ = cliRun(nil, "__complete", "lock", "--")
	for _, f := range []string{"--resource", "--server", "--node", "--token-file", "--skip-recent"} {
		if !strings.Contains(out, f+"\t") {
			t.Errorf("dlock __complete lock -- does not offer %s:\n%s", f, out)
		}
	}
	if _, _, st := cliRun(nil, "completion", "tcsh"); st != 2 {
		t.Errorf("completion tcsh: status %d, want 2", st)
	}
}

// TestDocsCompletion runs docs/CLI.md's completion command in bash, with the
// built dlock on PATH, and completes "dlock lo" and "dlock lock --reso"
// with it.
func TestDocsCompletion(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash")
	}
	marked := markedBlocks(t, "docs/CLI.md", 1)
	m := regexp.MustCompile(`(?m)^\$ (.*dlock completion bash.*)$`).FindStringSubmatch(marked[0].Text)
	if m == nil {
		t.Fatal("docs/CLI.md shows no `$ … dlock completion bash` command")
	}
	// cobra's bash script needs the bash-completion package (make deps).
	const bashCompletion = "/usr/share/bash-completion/bash_completion"
	if _, err := os.Stat(bashCompletion); err != nil {
		if os.Geteuid() == 0 {
			t.Fatalf("%v: `make deps` installs Debian's bash-completion", err)
		}
		t.Skipf("NOTE: %v: bash completion NOT checked; run `make deps` as root", err)
	}
	script := ". " + bashCompletion + "\n" + m[1] + `
complete -p dlock
compopt() { :; } # the builtin works only while bash itself completes
try() { COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMP_LINE="$*"; COMP_POINT=${#COMP_LINE}; COMPREPLY=(); __start_dlock; echo "${COMPREPLY[*]}"; }
try dlock lo
try dlock lock --reso
`
	cmd := exec.Command(bash, "-e", "-c", script)
	cmd.Env = append(os.Environ(), "PATH="+filepath.Dir(dlockBinary(t))+":"+os.Getenv("PATH"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) != 3 || !strings.Contains(lines[0], "__start_dlock") || strings.TrimSpace(lines[1]) != "lock" || strings.TrimSpace(lines[2]) != "--resource" {
		t.Fatalf("completion in bash:\n%s", out)
	}
}

// TestUsageErrors: every bad command line is status 2 with one line that
// names the fault, in every command.
func TestUsageErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string // in the line
		not  string // not in the line
	}{
		{args: nil, want: "no command given"},
		{args: []string{"lcok"}, want: `unknown command "lcok": did you mean lock?`},
		{args: []string{"lock", "--bogus"}, want: "unknown flag: --bogus"},
		{args: []string{"lock", "--resource"}, want: "flag needs an argument"},
		{args: []string{"lock"}, want: "--resource is required"},
		{args: []string{"lock", "extra", "--resource", "x"}, want: `got "extra"`, not: "--resource"},
		{args: []string{"lock", "extra"}, want: `got "extra"`, not: "--resource"},
		{args: []string{"unlock", "--resource", "x", "stray"}, want: `got "stray"`},
		{args: []string{"status", "--resource", "x", "--node", ""}, want: "--node is empty"},
		{args: []string{"status", "--resource", "x"}, env: map[string]string{"DLOCK_NODE": "a\x01"}, want: "--node"},
		{args: []string{"lock", "--resource", "x", "--server", "127.0.0.1:7380"}, want: "--server wants a URL like http://127.0.0.1:7380"},
		{args: []string{"lock", "--resource", "x"}, env: map[string]string{"DLOCK_SERVER": "localhost:7380"}, want: "--server wants a URL like http://127.0.0.1:7380"},
		{args: []string{"run", "--resource", "x", "--server", "http://127.0.0.1:1,127.0.0.1:2", "--", "true"}, want: "--server wants a URL"},
		{args: []string{"run", "--resource", "x"}, want: "run needs a command"},
		{args: []string{"run", "--resource", "x", "--skip-exit-code", "300", "--", "true"}, want: "--skip-exit-code 300: an exit status is 0 to 255"},
		{args: []string{"run", "--resource", "x", "--skip-exit-code", "-1", "--", "true"}, want: "--skip-exit-code -1"},
		{args: []string{"run", "--renew-interval", "soon", "--resource", "x", "--", "true"}, want: `invalid argument "soon"`},
		{args: []string{"run", "--renew-interval", "-5s", "--resource", "x", "--", "true"}, want: "--renew-interval must be positive, not -5s"},
		{args: []string{"run", "--renew-interval", "0s", "--resource", "x", "--", "true"}, want: "--renew-interval must be positive"},
		{args: []string{"refcount", "--add", "--release", "--resource", "x"}, want: "exclude each other"},
		{args: []string{"refcount"}, want: "--resource is required"},
		{args: []string{"lock", "--resource", "x"}, env: map[string]string{"DLOCK_HUMAN": "maybe"}, want: "DLOCK_HUMAN"},
		{args: []string{"serve", "--bogus"}, want: "unknown flag: --bogus"},
		{args: []string{"serve", "extra"}, want: `got "extra"`},
		{args: []string{"serve", "--backend", "sqlite"}, want: "--backend must be memory or etcd"},
		{args: []string{"bench", "--bogus"}, want: "unknown flag: --bogus"},
		{args: []string{"bench", "extra"}, want: `got "extra"`},
		{args: []string{"bench", "--server", "127.0.0.1:7380"}, want: "--server wants a URL"},
		{args: []string{"bench", "--server", "http://127.0.0.1:1", "--etcd", "/bin/true"}, want: "--etcd needs --backend etcd or --compare etcd"},
		{args: []string{"bench", "--server", "http://127.0.0.1:1", "--compare", "redis", "--etcd", "/bin/true"}, want: "--etcd needs --backend etcd or --compare etcd"},
		{args: []string{"token"}, want: "dlock token new NODE_ID"},
		{args: []string{"token", "old"}, want: `unknown subcommand "old"`},
		{args: []string{"token", "new"}, want: "one NODE_ID"},
		{args: []string{"token", "new", "--bogus", "a"}, want: "unknown flag"},
		{args: []string{"completion", "bash", "extra"}, want: "extra"},
	} {
		out, errOut, st := cliRun(tc.env, tc.args...)
		lines := strings.Split(strings.TrimSpace(errOut), "\n")
		last := lines[len(lines)-1]
		if st != 2 || !strings.HasPrefix(last, "dlock: ") || strings.HasPrefix(last, "dlock: dlock:") || !strings.Contains(last, tc.want) || (tc.not != "" && strings.Contains(last, tc.not)) {
			t.Errorf("%q (env %q): status %d, stderr %q, want 2 and one line with %q", tc.args, tc.env, st, errOut, tc.want)
		}
		if len(tc.args) > 0 && len(lines) != 1 {
			t.Errorf("%q: %d lines on stderr, want one:\n%s", tc.args, len(lines), errOut)
		}
		if out != "" && len(tc.args) > 0 && tc.args[0] != "token" {
			t.Errorf("%q: stdout %q", tc.args, out)
		}
	}
	// The process's status, not only run's.
	cmd := exec.Command(dlockBinary(t), "lock", "extra", "--resource", "x")
	var errb bytes.Buffer
	cmd.Stderr = &errb
	cmd.Run()
	if st := cmd.ProcessState.ExitCode(); st != 2 || !strings.Contains(errb.String(), `"extra"`) {
		t.Errorf("dlock lock extra --resource x: status %d %q, want 2", st, errb.String())
	}
}

// TestSingleDashFlags: the flag package took -resource for --resource,
// and scripts may still say it; what follows "--", and a flag's value,
// stay as written.
func TestSingleDashFlags(t *testing.T) {
	srv := startServer(t, nil).URL()
	out, errOut, st := cliRun(nil, "lock", "-resource", "r", "-node=a", "-human", "-server", srv)
	if st != 0 || !strings.HasPrefix(out, "acquired pull:r, token ") {
		t.Fatalf("lock -resource r -node=a -human: %d %q %q", st, out, errOut)
	}
	out, errOut, st = cliRun(nil, "unlock", "-resource", "r", "-node", "a", "-fail", "-human", "-server", srv, "--human")
	if st != 0 || !strings.Contains(out, "released pull:r") {
		t.Fatalf("unlock -fail -human: %d %q %q", st, out, errOut)
	}
	out, _, _ = cliRun(nil, "status", "--resource", "r", "--server", srv)
	var sa statusAnswer
	if json.Unmarshal([]byte(out), &sa) != nil || sa.LastCompleted == nil || sa.LastCompleted.Error != "-human" {
		t.Errorf("--fail's value -human was read as a flag: %s", out)
	}
	dir := t.TempDir()
	// The binary: dlock run starts its command through itself.
	out, errOut, st = dlockWith(t, nil, "run", "-resource", "r2", "-server", srv, "--", "sh", "-c", "echo -resource > "+filepath.Join(dir, "out"))
	if st != 0 {
		t.Fatalf("run -resource r2 -- sh -c …: %d %q %q", st, out, errOut)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "out")); string(b) != "-resource\n" {
		t.Errorf("the command's own arguments changed: %q", b)
	}
}

// TestErrorLines: a request that fails prints one line that says what is
// wrong and what to do, against real listeners: a closed port, a TLS
// server spoken to in plain HTTP (httptest's and dlock serve's), a web
// server's page.
func TestErrorLines(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := "http://" + ln.Addr().String()
	ln.Close()
	tlsSrv := httptest.NewTLSServer(http.NotFoundHandler())
	defer tlsSrv.Close()
	html := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		w.Write([]byte("<!DOCTYPE html><html><body><h1>It works!</h1></body></html>\n"))
	}))
	defer html.Close()
	html404 := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		w.WriteHeader(http.StatusNotFound)
		w.Write([]byte("<html><body>Not Found</body></html>\n"))
	}))
	defer html404.Close()
	dlockTLS := dlocktest.Start(t, dlocktest.Options{Auth: &dlocktest.Auth{PKI: dlocktest.NewPKI(t)}})
	plainOfTLS := func(u string) string { return "http://" + strings.TrimPrefix(u, "https://") }
	for _, tc := range []struct {
		name, server string
		args         []string
		want         string
	}{
		{"closed port", closed, []string{"lock"}, "dlock: cannot reach " + closed + ": connection refused (is dlock serve running there?)"},
		{"closed port, run", closed, []string{"run", "--max-retries", "0"}, "dlock: cannot reach " + closed + ": connection refused (is dlock serve running there?)"},
		{"httptest TLS", plainOfTLS(tlsSrv.URL), []string{"lock"}, "dlock: server at " + plainOfTLS(tlsSrv.URL) + " speaks TLS: use https://"},
		{"dlock serve TLS", plainOfTLS(dlockTLS.URL()), []string{"status"}, "dlock: server at " + plainOfTLS(dlockTLS.URL()) + " speaks TLS: use https://"},
		{"an HTML page", html.URL, []string{"lock"}, "dlock: " + html.URL + ": not a dlock server (got HTML)"},
		{"an HTML 404", html404.URL, []string{"unlock"}, "dlock: " + html404.URL + ": not a dlock server (got HTML)"},
		{"an HTML page, refcount", html.URL, []string{"refcount"}, "dlock: " + html.URL + ": not a dlock server (got HTML)"},
		{"an HTML page, run", html.URL, []string{"run", "--max-retries", "0"}, "dlock: " + html.URL + ": not a dlock server (got HTML)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append(tc.args, "--resource", "r", "--server", tc.server)
			if tc.args[0] == "run" {
				args = append(args, "--", "true")
			}
			_, errOut, st := cliRun(nil, args...)
			if st != 1 || errOut != tc.want+"\n" {
				t.Errorf("%q: status %d, stderr\n%q, want 1 and\n%q", args, st, errOut, tc.want+"\n")
			}
		})
	}
}

// TestNodeFromTokenFile: with a token file holding the server's line
// "TOKEN node-1", the node is node-1 (it was the host name, refused 403);
// --node and DLOCK_NODE still win; an operator's line names no node.
func TestNodeFromTokenFile(t *testing.T) {
	node1, op := strings.Repeat("n", 43), strings.Repeat("o", 43)
	srv := dlocktest.Start(t, dlocktest.Options{Auth: &dlocktest.Auth{Tokens: map[string]string{node1: "node-1", op: "*"}}})
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	line, alone, opLine := write("line", node1+" node-1\n"), write("alone", node1+"\n"), write("op", op+" *\n")
	for _, tc := range []struct {
		name   string
		args   []string
		env    map[string]string
		status int
		holder string
	}{
		{name: "the line's node", args: []string{"--token-file", line}, status: 0, holder: "node-1"},
		{name: "from DLOCK_TOKEN_FILE", env: map[string]string{"DLOCK_TOKEN_FILE": line}, status: 0, holder: "node-1"},
		{name: "--node wins", args: []string{"--token-file", line, "--node", "node-2"}, status: 1},
		{name: "DLOCK_NODE wins", args: []string{"--token-file", line}, env: map[string]string{"DLOCK_NODE": "node-2"}, status: 1},
		{name: "--node the same", args: []string{"--token-file", line, "--node", "node-1"}, status: 0, holder: "node-1"},
		{name: "a token alone: the host name", args: []string{"--token-file", alone}, status: 1},
		{name: "an operator's line: the host name", args: []string{"--token-file", opLine}, status: 0, holder: hostname()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := "r-" + strings.ReplaceAll(tc.name, " ", "-")
			args := append([]string{"lock", "--resource", res, "--server", srv.URL()}, tc.args...)
			_, errOut, st := cliRun(tc.env, args...)
			if st != tc.status {
				t.Fatalf("%q: status %d %q, want %d", args, st, errOut, tc.status)
			}
			if tc.status == 1 && !strings.Contains(errOut, "403") && !strings.Contains(errOut, "forbidden") {
				t.Errorf("%q: %q, want a refusal", args, errOut)
			}
			if tc.holder != "" {
				out, errOut, _ := cliRun(nil, "status", "--resource", res, "--server", srv.URL(), "--token-file", opLine)
				var got statusAnswer
				if err := json.Unmarshal([]byte(out), &got); err != nil || got.Holder != tc.holder {
					t.Errorf("status: %q %q, want holder %q", out, errOut, tc.holder)
				}
			}
		})
	}
}
