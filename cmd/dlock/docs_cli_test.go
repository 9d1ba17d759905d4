package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestDocsCLIRace runs docs/CLI.md's eight racing `dlock run` as written,
// against a server of the test (DLOCK_SERVER, the --server flag's
// environment fallback, where the page assumes the default address), and
// compares the lines they print with the page's, in any order and with
// each node's HOST:PID as the page's.
func TestDocsCLIRace(t *testing.T) {
	marked := markedBlocks(t, "docs/CLI.md", 1)
	steps := marked[0].Steps()
	if len(steps) != 1 {
		t.Fatalf("docs/CLI.md:%d: %d commands, want 1", marked[0].Line, len(steps))
	}
	p := startServe(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute) // bounds a broken run only
	defer cancel()
	cmd := shell(t, ctx, t.TempDir(), steps[0].Cmd, "DLOCK_SERVER=http://"+p.addr)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("docs/CLI.md:%d: %v\n%s", steps[0].Line, err, out)
	}
	norm := func(s string) []string {
		lines := strings.Split(strings.TrimSpace(hostPID.ReplaceAllString(s, "HOST:PID")), "\n")
		slices.Sort(lines)
		return lines
	}
	if got, want := norm(string(out)), norm(steps[0].Out); !slices.Equal(got, want) {
		t.Errorf("docs/CLI.md:%d printed\n%s\nthe page shows (in any order)\n%s", steps[0].Line, strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// smallScale is appended to each `dlock bench` line of docs/PERFORMANCE.md
// by TestDocsPerformance: the same scenarios, in seconds.
var smallScale = []string{"--duration", "1s", "--waiters", "100", "--sessions", "100", "--held", "1000",
	"--held-nodes", "10", "--nodes", "30", "--holders", "3", "--fleet-held", "300", "--idle", "1s", "--recheck", "0"}

// TestDocsPerformance runs the commands of docs/PERFORMANCE.md's "Measure
// it yourself" as written but at a small scale (smallScale appended to each
// bench line), and with the server's port the test's: a full run takes
// minutes and needs the machine to itself. Each bench must succeed and
// report every scenario it names.
func TestDocsPerformance(t *testing.T) {
	for _, b := range []string{"etcd", "redis-server"} {
		if _, err := exec.LookPath(b); err != nil {
			if os.Geteuid() != 0 {
				t.Skipf("SKIPPED: %s is not installed and only root can install it (make deps): docs/PERFORMANCE.md's commands are NOT run", b)
			}
			t.Fatalf("%s is missing: make deps installs it", b)
		}
	}
	needCurl(t)
	marked := markedBlocks(t, "docs/PERFORMANCE.md", 3)
	port := freePorts(t, 1)[0]
	// `make etcd` and bin/etcd are the repository's: the block runs
	// elsewhere.
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range marked {
		var script []string
		var scenarios [][]string
		for _, l := range strings.Split(strings.TrimSpace(b.Text), "\n") {
			l = strings.ReplaceAll(l, "127.0.0.1:7380", "127.0.0.1:"+port)
			if strings.HasPrefix(l, "make ") {
				l = "make -C " + root + l[len("make"):]
			}
			l = strings.ReplaceAll(l, " --etcd bin/etcd ", " --etcd "+filepath.Join(root, "bin", "etcd")+" ")
			if i := strings.Index(l, "dlock bench "); i >= 0 {
				m := regexp.MustCompile(`--scenario (\S+)`).FindStringSubmatch(l)
				if m == nil {
					t.Fatalf("docs/PERFORMANCE.md:%d: a bench line without --scenario: %q", b.Line, l)
				}
				scenarios = append(scenarios, strings.Split(m[1], ","))
				l += " " + strings.Join(smallScale, " ")
				if !strings.Contains(l, "--backend etcd") {
					l += " --server http://127.0.0.1:" + port
				}
			}
			script = append(script, l)
		}
		dir := t.TempDir()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute) // bounds a broken run only
		cmd := shell(t, ctx, dir, "set -e\n"+strings.Join(script, "\n"))
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		out, err := os.Create(filepath.Join(dir, "out"))
		if err != nil {
			t.Fatal(err)
		}
		cmd.Stdout, cmd.Stderr = out, out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		err = cmd.Wait()
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // the block's server
		cancel()
		out.Close()
		text, _ := os.ReadFile(out.Name())
		if err != nil {
			t.Fatalf("docs/PERFORMANCE.md:%d: %v\n%s", b.Line, err, text)
		}
		for _, sc := range scenarios {
			for _, s := range sc {
				if !strings.Contains(string(text), s) {
					t.Errorf("docs/PERFORMANCE.md:%d: bench printed nothing about %s:\n%s", b.Line, s, text)
				}
			}
		}
	}
}
