package main

import (
	"context"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/doctest"
)

// The commands of the README and of docs/ that this package's tests run as
// written (docs/DEVELOPMENT.md, "Commands in the docs"). A command that
// names the server's default address, localhost:7380, is run against a
// server of the test on another port: only the address is replaced.

// repoRoot is the repository's root, from this package's directory.
const repoRoot = "../.."

func docBlocks(t *testing.T, page string) []doctest.Block {
	t.Helper()
	all, err := doctest.Read(filepath.Join(repoRoot, page))
	if err != nil {
		t.Fatal(err)
	}
	return all
}

// markedBlocks returns the shell blocks of page whose marker names the
// calling test, which wants n of them.
func markedBlocks(t *testing.T, page string, n int) []doctest.Block {
	t.Helper()
	marked := doctest.Marked(docBlocks(t, page), t.Name())
	if len(marked) != n {
		t.Fatalf("%s: %d blocks marked %s, want %d", page, len(marked), t.Name(), n)
	}
	return marked
}

// shell runs script with bash, with the dlock binary first on PATH.
func shell(t *testing.T, ctx context.Context, dir, script string, env ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.CommandContext(ctx, "bash", "-c", script)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "PATH="+filepath.Dir(dlockBinary(t))+":"+os.Getenv("PATH"))
	cmd.Env = append(cmd.Env, env...)
	return cmd
}

func needCurl(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("curl"); err != nil {
		t.Fatalf("curl is missing (make deps installs it): the README's walk-through cannot run")
	}
}

// normalizer replaces what differs between runs (tokens, times, the epoch)
// with names given in order of first appearance, so that two texts compare
// equal when their values relate alike: the same token where the page shows
// the same token, another where it shows another.
type normalizer struct {
	names map[string]string
	n     map[string]int
}

var varying = regexp.MustCompile(`"(token|completed_at|epoch)":("[^"]*"|[0-9]+)`)

func newNormalizer() *normalizer {
	return &normalizer{names: map[string]string{}, n: map[string]int{}}
}

func (z *normalizer) norm(s string) string {
	return varying.ReplaceAllStringFunc(s, func(m string) string {
		sub := varying.FindStringSubmatch(m)
		field, v := sub[1], sub[2]
		if v == "0" || v == `""` {
			return m
		}
		key := field + "=" + v
		name, ok := z.names[key]
		if !ok {
			z.n[field]++
			name = field + "#" + strconv.Itoa(z.n[field])
			z.names[key] = name
		}
		return `"` + field + `":` + name
	})
}

// frames returns the events of a stream's text, comments (pings) left out.
func frames(s string) []string {
	var out []string
	for _, f := range strings.Split(s, "\n\n") {
		var keep []string
		for _, l := range strings.Split(f, "\n") {
			if l != "" && !strings.HasPrefix(l, ":") {
				keep = append(keep, l)
			}
		}
		if len(keep) > 0 {
			out = append(out, strings.Join(keep, "\n"))
		}
	}
	return out
}

// TestREADMEWalkthrough runs README.md's "A walk-through with curl" as
// written, against a fresh server, and compares every answer and every
// event the page shows with what the server said.
func TestREADMEWalkthrough(t *testing.T) {
	needCurl(t)
	all := docBlocks(t, "README.md")
	var walk []doctest.Block
	for _, b := range all {
		if b.Section == "A walk-through with curl" {
			walk = append(walk, b)
		}
	}
	marked := doctest.Marked(walk, "TestREADMEWalkthrough")
	if len(marked) != 6 || marked[0].Text != "go run ./cmd/dlock serve\n" || marked[1].Lang != "sh" {
		t.Fatalf(`README.md, "A walk-through with curl": want the server's command, the streams' sh block and four console blocks, all marked; got %d marked blocks`, len(marked))
	}
	p := startServe(t)
	addr := func(s string) string {
		return strings.ReplaceAll(s, "localhost:7380", p.addr)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	// The streams, each in the background as in its own terminal.
	streams := map[string]*kit.Buffer{}
	for _, line := range strings.Split(strings.TrimSpace(marked[1].Text), "\n") {
		m := regexp.MustCompile(`node_id=(node-[a-z])`).FindStringSubmatch(line)
		if m == nil || !strings.HasPrefix(line, "curl -sN ") {
			t.Fatalf("README.md:%d: a stream's line is not curl -sN …node_id=…: %q", marked[1].Line, line)
		}
		out := &kit.Buffer{}
		cmd := shell(t, ctx, repoRoot, addr(line))
		cmd.Stdout = out
		cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cancel(); _ = cmd.Wait() })
		streams[m[1]] = out
	}
	for node, out := range streams {
		kit.WaitFor(t, node+"'s subscribed event", func() bool { return strings.Contains(out.String(), "event: subscribed") })
	}

	// Each side names its varying values in the order the page shows
	// them, so the names correspond.
	zDoc, zGot := newNormalizer(), newNormalizer()
	next := map[string]int{} // per stream, the first event not yet compared
	for _, b := range walk {
		switch {
		case b.Lang == "console":
			for _, s := range b.Steps() {
				out, err := shell(t, ctx, repoRoot, addr(s.Cmd)).Output()
				if err != nil {
					t.Fatalf("README.md:%d: %s: %v", s.Line, s.Cmd, err)
				}
				got, want := zGot.norm(strings.TrimSpace(string(out))), zDoc.norm(strings.TrimSpace(s.Out))
				if got != want {
					t.Errorf("README.md:%d: %s\n got: %s\nwant: %s", s.Line, s.Cmd, got, want)
				}
			}
		case b.Lang == "" && strings.Contains(b.Text, "event: "):
			// An event the page shows: the next one of its kind on the
			// stream of the node it names (for a completion, the
			// waiter's: node-c).
			want := frames(b.Text)
			if len(want) != 1 {
				t.Fatalf("README.md:%d: want one event in the block, got %d", b.Line, len(want))
			}
			node := "node-c"
			if m := regexp.MustCompile(`"event":"(subscribed|lock_assigned)","(?:type":"[^"]*","resource_id":"[^"]*","node_id|node_id)":"(node-[a-z])"`).FindStringSubmatch(want[0]); m != nil {
				node = m[2]
			}
			out := streams[node]
			if out == nil {
				t.Fatalf("README.md:%d: an event of %s, who has no stream in the walk", b.Line, node)
			}
			kind := regexp.MustCompile(`(?m)^event: .*$`).FindString(want[0])
			var got string
			kit.WaitFor(t, "the event of README.md:"+strconv.Itoa(b.Line)+" on "+node+"'s stream", func() bool {
				fs := frames(out.String())
				for i := next[node]; i < len(fs); i++ {
					if strings.Contains(fs[i], kind+"\n") {
						got, next[node] = fs[i], i+1
						return true
					}
				}
				return false
			})
			if g, w := zGot.norm(got), zDoc.norm(want[0]); g != w {
				t.Errorf("README.md:%d: %s's stream\n got: %s\nwant: %s", b.Line, node, g, w)
			}
		}
	}
	// Nothing but what the page shows reached the streams.
	for node, out := range streams {
		fs := frames(out.String())
		if len(fs) != 2 {
			t.Errorf("%s's stream got %d events, the page shows 2 (subscribed and one more):\n%s", node, len(fs), out.String())
		}
	}
}

// TestREADMEFirstCommands runs the two commands README.md gives a newcomer:
// `go run ./cmd/dlock serve` as written, from the repository's root (with
// DLOCK_LISTEN, the flag's environment fallback, moving it off the default
// port, which another test or a server of the machine may hold, and
// DLOCK_DATA_DIR off the machine's), until it
// answers; and `make test`, which is what CI runs: .ci/run must run it.
func TestREADMEFirstCommands(t *testing.T) {
	marked := markedBlocks(t, "README.md", 1)
	var cmds []string
	for _, l := range strings.Split(strings.TrimSpace(marked[0].Text), "\n") {
		c, _, _ := strings.Cut(l, "#")
		cmds = append(cmds, strings.TrimSpace(c))
	}
	if len(cmds) != 2 || cmds[0] != "go run ./cmd/dlock serve" || cmds[1] != "make test" {
		t.Fatalf("README.md:%d: want `go run ./cmd/dlock serve` and `make test`, got %q", marked[0].Line, cmds)
	}
	ci, err := os.ReadFile(filepath.Join(repoRoot, ".ci/run"))
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`(?m)^(exec )?make test$`).Match(ci) {
		t.Errorf(".ci/run does not run `make test`, README.md's test command:\n%s", ci)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute) // bounds a broken run only
	defer cancel()
	cmd := shell(t, ctx, repoRoot, "exec "+cmds[0], "DLOCK_LISTEN=127.0.0.1:0", "DLOCK_DATA_DIR="+t.TempDir())
	var logs kit.Buffer
	cmd.Stderr = &logs
	// go run does not pass a signal on to the program it runs: the
	// server gets SIGTERM as a terminal's Ctrl-C reaches both, through
	// their process group.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM) }
	cmd.WaitDelay = time.Minute
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	serving := regexp.MustCompile(`msg="dlock serving" addr=(\S+)`)
	var a string
	// go run compiles first: minutes on a loaded machine, bounded by ctx.
	for a == "" {
		select {
		case err := <-exited:
			t.Fatalf("go run ./cmd/dlock serve ended: %v\n%s", err, logs.String())
		case <-time.After(50 * time.Millisecond):
		}
		if m := serving.FindStringSubmatch(logs.String()); m != nil {
			a = m[1]
		}
	}
	res, err := http.Get("http://" + a + "/healthz")
	if err != nil {
		t.Fatalf("GET /healthz of go run ./cmd/dlock serve: %v", err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusOK {
		t.Errorf("GET /healthz of go run ./cmd/dlock serve: %s", res.Status)
	}
	cancel()
	<-exited
}

// freePorts returns n ports that were free on 127.0.0.1 a moment ago.
func freePorts(t *testing.T, n int) []string {
	t.Helper()
	var ports []string
	var ls []net.Listener
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ls = append(ls, l)
		_, p, _ := net.SplitHostPort(l.Addr().String())
		ports = append(ports, p)
	}
	for _, l := range ls {
		l.Close()
	}
	return ports
}

// hostPID is how the commands name a node by default: HOST:PID; rfc3339 is
// how they print a time.
var (
	hostPID = regexp.MustCompile(`\S+:[0-9]+\b`)
	rfc3339 = regexp.MustCompile(`\b[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:.]+Z\b`)
)

// asShown replaces what differs from run to run in a command's output.
func asShown(s string) string {
	return hostPID.ReplaceAllString(rfc3339.ReplaceAllString(strings.TrimSpace(s), "TIME"), "HOST:PID")
}

// TestDocsHA runs docs/HA.md's try-it block as written: one etcd, three
// servers on it, dlock run naming all three, the first server killed, and
// the next command served by the others. Only the ports are the test's
// (etcd's 2379 and 2380, the servers' 7381–7383), so that it runs beside
// other tests and servers.
func TestDocsHA(t *testing.T) {
	if _, err := exec.LookPath("etcd"); err != nil {
		if os.Geteuid() != 0 {
			t.Skip("SKIPPED: etcd is not installed and only root can install it (make deps): docs/HA.md's block is NOT run")
		}
		t.Fatal("etcd is missing: make deps installs it (Debian package etcd-server)")
	}
	needCurl(t)
	all := docBlocks(t, "docs/HA.md")
	marked := markedBlocks(t, "docs/HA.md", 1)
	var shown string // the plain block right after it: what it prints
	for i, b := range all {
		if b.Line == marked[0].Line && i+1 < len(all) && all[i+1].Lang == "" {
			shown = all[i+1].Text
		}
	}
	if shown == "" {
		t.Fatal("docs/HA.md: no block after the try-it block shows what it prints")
	}
	ports := freePorts(t, 5)
	script := strings.NewReplacer(
		"127.0.0.1:2379", "127.0.0.1:"+ports[0],
		"127.0.0.1:2380", "127.0.0.1:"+ports[1],
		"127.0.0.1:7381", "127.0.0.1:"+ports[2],
		"127.0.0.1:7382", "127.0.0.1:"+ports[3],
		"127.0.0.1:7383", "127.0.0.1:"+ports[4],
		"7381 7382 7383", ports[2]+" "+ports[3]+" "+ports[4],
	).Replace(marked[0].Text)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute) // bounds a broken run only
	defer cancel()
	dir := t.TempDir()
	cmd := shell(t, ctx, dir, script, "TMPDIR="+dir)
	// The block leaves etcd and two servers running, as a terminal would:
	// its process group ends them after the test.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	// Files, not pipes: what the block leaves running keeps its output
	// open, and Wait would wait for it.
	stdout, err := os.Create(filepath.Join(dir, "stdout"))
	if err != nil {
		t.Fatal(err)
	}
	defer stdout.Close()
	stderr, err := os.Create(filepath.Join(dir, "stderr"))
	if err != nil {
		t.Fatal(err)
	}
	defer stderr.Close()
	cmd.Stdout, cmd.Stderr = stdout, stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pgid := cmd.Process.Pid
	t.Cleanup(func() { _ = syscall.Kill(-pgid, syscall.SIGKILL) })
	err = cmd.Wait()
	out, _ := os.ReadFile(stdout.Name())
	errs, _ := os.ReadFile(stderr.Name())
	logs, _ := os.ReadFile(filepath.Join(dir, "dlock-servers.log"))
	if err != nil {
		t.Fatalf("docs/HA.md:%d: %v\nstdout:\n%s\nstderr:\n%s\nservers:\n%s", marked[0].Line, err, out, errs, logs)
	}
	// The page's kill ended the first server, and the others served on.
	if res, err := http.Get("http://127.0.0.1:" + ports[2] + "/healthz"); err == nil {
		res.Body.Close()
		t.Errorf("docs/HA.md:%d: the first server still answers after the block killed it", marked[0].Line)
	}
	for _, p := range ports[3:] {
		res, err := http.Get("http://127.0.0.1:" + p + "/healthz")
		if err != nil {
			t.Fatalf("docs/HA.md:%d: a server the block left running: %v", marked[0].Line, err)
		}
		res.Body.Close()
	}
	if got, want := asShown(string(out)), asShown(shown); got != want {
		t.Errorf("docs/HA.md:%d printed\n%s\nthe page shows\n%s\nstderr:\n%s", marked[0].Line, got, want, errs)
	}
}
