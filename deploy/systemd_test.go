package deploy

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	srvconfig "github.com/containerd/containerd/v2/cmd/containerd/server/config"
	"github.com/pelletier/go-toml/v2"
)

// The files of deploy/systemd, as deploy/README.md installs them.
var systemdFiles = []string{"dlock.service", "dlock-content.service", "dlock.env", "dlock-content.env"}

const installedBin = "/usr/local/bin/"

func readSystemd(t *testing.T) map[string]string {
	t.Helper()
	files := map[string]string{}
	for _, f := range systemdFiles {
		b, err := os.ReadFile(filepath.Join("systemd", f))
		if err != nil {
			t.Fatal(err)
		}
		files[f] = string(b)
	}
	return files
}

// systemdAnalyze finds systemd-analyze (Debian's systemd package). Without
// it the unit tests can only skip, and only when `make deps` could not have
// installed it.
func systemdAnalyze(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("systemd-analyze")
	if err != nil {
		if os.Geteuid() == 0 {
			t.Fatal("systemd-analyze is missing: `make deps` installs Debian's systemd package")
		}
		t.Skip("SKIPPED: systemd-analyze is missing and we are not root: the systemd units are NOT checked; run `make deps` as root")
	}
	return p
}

// unit is a unit file's settings: section → key → values, in order.
type unit map[string]map[string][]string

func parseUnit(s string) unit {
	u := unit{}
	sec := ""
	for line := range strings.Lines(s) {
		line = strings.TrimSpace(line)
		switch {
		case line == "" || line[0] == '#' || line[0] == ';':
		case line[0] == '[':
			sec = strings.Trim(line, "[]")
			u[sec] = map[string][]string{}
		default:
			k, v, _ := strings.Cut(line, "=")
			if u[sec] != nil {
				u[sec][k] = append(u[sec][k], v)
			}
		}
	}
	return u
}

func (u unit) get(sec, key string) string {
	v := u[sec][key]
	if len(v) == 0 {
		return ""
	}
	return v[len(v)-1]
}

// all is every word of every value of a list setting.
func (u unit) all(sec, key string) []string {
	var out []string
	for _, v := range u[sec][key] {
		out = append(out, strings.Fields(v)...)
	}
	return out
}

var envLine = regexp.MustCompile(`^#?\s*([A-Z][A-Z0-9_]*)=(.*)$`)

// parseEnv reads an EnvironmentFile: its settings, and the names of every
// setting shown, commented out or not.
func parseEnv(s string) (set map[string]string, named []string) {
	set = map[string]string{}
	for line := range strings.Lines(s) {
		line = strings.TrimSpace(line)
		m := envLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		named = append(named, m[1])
		if line[0] != '#' {
			set[m[1]] = m[2]
		}
	}
	return set, named
}

// checkSystemd runs systemd-analyze verify on the units, installed as
// deploy/README.md says but with ExecStart pointing at freshly built
// binaries, and checks what the units and env files must agree on.
func checkSystemd(analyze, bin string, files map[string]string, env knownEnv) error {
	var errs []error
	fail := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }

	dir, err := os.MkdirTemp(tmpRoot, "units-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	var paths []string
	for _, f := range []string{"dlock.service", "dlock-content.service"} {
		p := filepath.Join(dir, f)
		if err := os.WriteFile(p, []byte(strings.ReplaceAll(files[f], installedBin, bin+"/")), 0o644); err != nil {
			return err
		}
		paths = append(paths, p)
	}
	cmd := exec.Command(analyze, append([]string{"verify", "--man=no"}, paths...)...)
	out, err := cmd.CombinedOutput()
	// verify exits 0 on unknown keys and bad values ("…, ignoring"), so
	// every line about these units is a failure.
	reported := false
	for line := range strings.Lines(string(out)) {
		if strings.Contains(line, "dlock.service") || strings.Contains(line, "dlock-content.service") {
			fail("systemd-analyze verify: %s", strings.TrimSpace(line))
			reported = true
		}
	}
	if err != nil && !reported {
		fail("systemd-analyze verify: %v\n%s", err, out)
	}

	for _, f := range []struct{ file, binary string }{{"dlock.env", "dlock"}, {"dlock-content.env", "dlock-content"}} {
		_, named := parseEnv(files[f.file])
		for _, n := range named {
			if !env[f.binary][n] {
				fail("%s: %s reads no variable %s", f.file, f.binary, n)
			}
		}
	}

	d := parseUnit(files["dlock.service"])
	c := parseUnit(files["dlock-content.service"])
	for name, u := range map[string]unit{"dlock.service": d, "dlock-content.service": c} {
		for key, want := range map[string]string{"ProtectSystem": "strict", "NoNewPrivileges": "yes", "Type": "exec"} {
			if got := u.get("Service", key); got != want {
				fail("%s: %s=%s, want %s", name, key, got, want)
			}
		}
		if u.get("Service", "LimitNOFILE") == "" {
			fail("%s: no LimitNOFILE", name)
		}
		if u.get("Service", "User") == "" && u.get("Service", "DynamicUser") != "yes" {
			fail("%s: runs as root: set DynamicUser=yes or User=", name)
		}
	}
	if ef := d.get("Service", "EnvironmentFile"); ef != "/etc/dlock/dlock.env" {
		fail("dlock.service: EnvironmentFile=%s, want /etc/dlock/dlock.env", ef)
	}
	if ef := c.get("Service", "EnvironmentFile"); ef != "/etc/dlock/dlock-content.env" {
		fail("dlock-content.service: EnvironmentFile=%s, want /etc/dlock/dlock-content.env", ef)
	}
	// dlock's durable state in the unit's StateDirectory, whatever the
	// env file says.
	if d.get("Service", "StateDirectory") != "dlock" || !strings.Contains(d.get("Service", "ExecStart"), "--data-dir=${STATE_DIRECTORY}") {
		fail("dlock.service: --data-dir must be ${STATE_DIRECTORY} of StateDirectory=dlock")
	}
	dEnv, _ := parseEnv(files["dlock.env"])
	if dEnv["DLOCK_REFCOUNT"] != "server" {
		fail("dlock.env: DLOCK_REFCOUNT=%q: dlock-content refuses to start without server", dEnv["DLOCK_REFCOUNT"])
	}

	// dlock-content: before containerd, started with it, writing only to
	// its socket's directory and the shared root.
	if !slices.Contains(c.all("Unit", "Before"), "containerd.service") {
		fail("dlock-content.service: not Before=containerd.service")
	}
	if !slices.Contains(c.all("Install", "WantedBy"), "containerd.service") {
		fail("dlock-content.service: not WantedBy=containerd.service")
	}
	// dlock.service's dynamic user is named after it: a static user of
	// that name would be taken instead, and own the server's state.
	if u := c.get("Service", "User"); u == "" || u == "dlock" {
		fail("dlock-content.service: User=%q: want a user of its own (the shared root's files are its)", u)
	}
	cEnv, _ := parseEnv(files["dlock-content.env"])
	sock := cEnv["DLOCK_CONTENT_SOCKET"]
	if rd := c.get("Service", "RuntimeDirectory"); rd == "" || path.Dir(sock) != path.Join("/run", rd) {
		fail("dlock-content.env: DLOCK_CONTENT_SOCKET=%s is not in the unit's RuntimeDirectory=%s", sock, rd)
	}
	root := cEnv["DLOCK_CONTENT_ROOT"]
	if root == "" || !slices.Contains(c.all("Service", "ReadWritePaths"), root) || !slices.Contains(c.all("Unit", "RequiresMountsFor"), root) {
		fail("dlock-content.env: DLOCK_CONTENT_ROOT=%s must be in the unit's ReadWritePaths= and RequiresMountsFor=", root)
	}
	if b, err := os.ReadFile(dropInFile); err != nil {
		fail("%v", err)
	} else {
		var cfg srvconfig.Config
		if err := toml.Unmarshal(b, &cfg); err != nil {
			fail("%s: %v", dropInFile, err)
		} else if err := checkContentProxy(&cfg, sock); err != nil {
			fail("%s against dlock-content.env: %v", dropInFile, err)
		}
	}
	return errors.Join(errs...)
}

func TestSystemdUnits(t *testing.T) {
	analyze := systemdAnalyze(t)
	if err := checkSystemd(analyze, binDir(t), readSystemd(t), helpOf(t)); err != nil {
		t.Fatal(err)
	}
}

// TestSystemdTypos: each case changes one thing in a copy of the files and
// expects checkSystemd to fail.
func TestSystemdTypos(t *testing.T) {
	analyze := systemdAnalyze(t)
	bin, env := binDir(t), helpOf(t)
	cases := []struct{ file, old, new, want string }{
		{"dlock.service", "ProtectSystem=strict", "ProtectSytem=strict", "Unknown key"},
		{"dlock.service", "NoNewPrivileges=yes", "NoNewPrivileges=yse", "NoNewPrivileges"},
		{"dlock.service", "ExecStart=/usr/local/bin/dlock ", "ExecStart=/usr/local/bin/dlok ", "dlok"},
		{"dlock.service", "RestrictAddressFamilies=AF_INET ", "RestrictAddressFamilies=AF_INTE ", "AF_INTE"},
		{"dlock.service", "[Service]", "[Servcie]", "Servcie"},
		{"dlock-content.service", "Before=containerd.service", "Before=containerd.socket", "Before=containerd.service"},
		{"dlock-content.service", "ReadWritePaths=/srv/dlock-content", "ReadWritePaths=/srv/dlock-contents", "ReadWritePaths"},
		{"dlock-content.service", "ExecStart=/usr/local/bin/dlock-content", "ExecStart=/usr/local/bin/dlock-contnet", "dlock-contnet"},
		{"dlock.env", "DLOCK_REFCOUNT=server", "DLOCK_REFCOUNTS=server", "DLOCK_REFCOUNTS"},
		{"dlock.env", "#DLOCK_SESSION_GRACE=5s", "#DLOCK_SESION_GRACE=5s", "DLOCK_SESION_GRACE"},
		{"dlock-content.env", "DLOCK_CONTENT_SOCKET=/run/dlock-content/content.sock", "DLOCK_CONTENT_SOCKET=/run/dlock/content.sock", "RuntimeDirectory"},
	}
	for _, tc := range cases {
		t.Run(tc.file+":"+tc.new, func(t *testing.T) {
			files := readSystemd(t)
			if n := strings.Count(files[tc.file], tc.old); n != 1 {
				t.Fatalf("%s: %q occurs %d times; the case must change exactly one place", tc.file, tc.old, n)
			}
			files[tc.file] = strings.Replace(files[tc.file], tc.old, tc.new, 1)
			err := checkSystemd(analyze, bin, files, env)
			if err == nil {
				t.Fatalf("%s: %q → %q: every check passed", tc.file, tc.old, tc.new)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("%s: %q → %q: the error does not say %q:\n%v", tc.file, tc.old, tc.new, tc.want, err)
			}
			t.Log(err)
		})
	}
}

// TestSystemdExecStart runs both units' ExecStart by hand, with their env
// files, as systemd would (this machine has no systemd as PID 1): the
// server must answer /healthz, and dlock-content, which refuses to start
// unless the server counts references, must open its socket. Only where
// this machine differs from an installed one is a flag added (flags win
// over the env files): the server listens on a free local port, and the
// plugin's root and socket are in a temporary directory.
func TestSystemdExecStart(t *testing.T) {
	bin := binDir(t)
	files := readSystemd(t)
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	if err := os.Mkdir(state, 0o700); err != nil {
		t.Fatal(err)
	}

	server := start(t, bin, files, "dlock.service", "dlock.env", map[string]string{"STATE_DIRECTORY": state}, "--listen=127.0.0.1:0")
	addr := server.waitLog(t, regexp.MustCompile(`msg="dlock serving" addr=(\S+)`))
	resp, err := http.Get("http://" + addr + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/healthz: %s", resp.Status)
	}
	if _, err := os.Stat(filepath.Join(state, "refcount.db")); err != nil {
		t.Fatalf("the server keeps no references in its StateDirectory: %v", err)
	}

	sock := filepath.Join(dir, "content.sock")
	content := start(t, bin, files, "dlock-content.service", "dlock-content.env", nil,
		"--server=http://"+addr, "--root="+filepath.Join(dir, "shared"), "--socket="+sock)
	content.waitLog(t, regexp.MustCompile(`msg="dlock-content (serving)"`))
	if fi, err := os.Stat(sock); err != nil || fi.Mode().Type() != os.ModeSocket {
		t.Fatalf("dlock-content serves but %s is no socket: %v", sock, err)
	}
	content.stop(t)
	server.stop(t)
}

type process struct {
	cmd   *exec.Cmd
	lines chan string
	log   *bytes.Buffer
	done  chan struct{}
}

// start runs a unit's ExecStart with its env file (and extra variables
// systemd sets, and extra flags), as the README's "by hand" step does.
func start(t *testing.T, bin string, files map[string]string, unitFile, envFile string, extra map[string]string, flags ...string) *process {
	t.Helper()
	env, _ := parseEnv(files[envFile])
	for k, v := range extra {
		env[k] = v
	}
	args := strings.Fields(parseUnit(files[unitFile]).get("Service", "ExecStart"))
	for i, a := range args {
		args[i] = os.Expand(a, func(k string) string { return env[k] })
	}
	args[0] = strings.Replace(args[0], installedBin, bin+"/", 1)
	cmd := exec.Command(args[0], append(args[1:], flags...)...)
	cmd.Env = []string{"PATH=/usr/bin:/bin", "HOME=" + t.TempDir()}
	for k, v := range env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &process{cmd: cmd, lines: make(chan string, 100), log: &bytes.Buffer{}, done: make(chan struct{})}
	go func() {
		defer close(p.done)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			select {
			case p.lines <- sc.Text():
			default:
			}
		}
		io.Copy(io.Discard, stderr)
	}()
	t.Cleanup(func() {
		if p.cmd.ProcessState == nil {
			p.cmd.Process.Kill()
			<-p.done
			p.cmd.Wait()
		}
	})
	return p
}

// waitLog waits for a log line matching re and returns its first group. The
// deadline only keeps a broken start from hanging the test.
func (p *process) waitLog(t *testing.T, re *regexp.Regexp) string {
	t.Helper()
	deadline := time.After(60 * time.Second)
	for {
		select {
		case line := <-p.lines:
			p.log.WriteString(line + "\n")
			if m := re.FindStringSubmatch(line); m != nil {
				return m[1]
			}
		case <-p.done:
			p.cmd.Wait()
			t.Fatalf("%s exited (%v) before logging %s:\n%s", p.cmd.Path, p.cmd.ProcessState, re, p.log)
		case <-deadline:
			t.Fatalf("%s did not log %s:\n%s", p.cmd.Path, re, p.log)
		}
	}
}

// stop sends SIGTERM, as systemctl stop does, and expects a clean exit.
func (p *process) stop(t *testing.T) {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	<-p.done // the reader never blocks: it drops lines nobody waits for
	if err := p.cmd.Wait(); err != nil {
		t.Fatalf("%s after SIGTERM: %v", p.cmd.Path, err)
	}
}
