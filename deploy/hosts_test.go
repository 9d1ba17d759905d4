package deploy

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
)

// A test host is this machine seen through namespaces of its own, so that
// deploy/README.md's commands run as written, as root, on three "fresh
// hosts" at once without touching this machine: a mount namespace in which
// /etc, /root, /usr/local, /var, /run and /srv are overlays whose changes
// go to a directory of the test (the rest, the repository and the Go
// toolchain among it, is this machine's), a host name of its own (UTS
// namespace), and a PID namespace whose init reaps what the commands leave
// running and whose end kills it all. The network is this machine's: the
// hosts' servers listen on loopback addresses of their own (127.0.0.1,
// 127.0.0.2, ...). systemctl, journalctl and ssh are the emulations of
// sysemu_test.go.
type host struct {
	name string
	dir  string
	init int // its init's pid, as this process sees it
}

// overlaid are the directories a test host has of its own.
var overlaid = []string{"/etc", "/root", "/usr/local", "/var", "/run", "/srv"}

// The environment variables that make this test binary a test host's init
// (hostInit).
const (
	hostNameEnv = "DLOCK_DEPLOY_HOST_NAME"
	hostDirEnv  = "DLOCK_DEPLOY_HOST_DIR"
	// Where a command on a test host finds this machine's /proc.
	hostProcEnv = "DLOCK_DEPLOY_HOSTPROC"
)

// requireHosts skips or fails a test that needs test hosts where they
// cannot be made: they need root (namespaces, mounts, other users).
func requireHosts(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: test hosts (namespaces and overlay mounts) need root: deploy/README.md's commands are NOT run")
	}
	for _, b := range []string{"unshare", "nsenter", "setpriv"} {
		if _, err := exec.LookPath(b); err != nil {
			t.Fatalf("%s is missing (util-linux)", b)
		}
	}
}

var emulatorOnce = sync.OnceValues(func() (string, error) {
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	dir := filepath.Join(tmpRoot, "emulated")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	for _, n := range []string{"systemctl", "journalctl", "ssh"} {
		if err := os.Symlink(self, filepath.Join(dir, n)); err != nil {
			return "", err
		}
	}
	return dir, nil
})

// hostsDir holds each test host's init pid, for the ssh emulation.
func hostsDir(t *testing.T) string {
	t.Helper()
	d := filepath.Join(tmpRoot, "hosts")
	if err := os.MkdirAll(d, 0o755); err != nil {
		t.Fatal(err)
	}
	return d
}

// newHost starts a test host named name; the test's end removes it and
// everything that runs in it.
func newHost(t *testing.T, name string) *host {
	t.Helper()
	requireHosts(t)
	dir := t.TempDir()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("unshare", "--mount", "--uts", "--pid", "--fork",
		"--kill-child=SIGKILL", "--propagation", "private", self)
	cmd.Env = append(os.Environ(), hostNameEnv+"="+name, hostDirEnv+"="+dir)
	cmd.Stderr = os.Stderr
	// When this test process dies, its hosts die with it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || strings.TrimSpace(line) != "ready" {
		t.Fatalf("test host %s did not start: %q %v", name, line, err)
	}
	// unshare's one child is the host's init.
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", cmd.Process.Pid, cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatalf("unshare's children: %q", b)
	}
	h := &host{name: name, dir: dir, init: pid}
	if err := os.WriteFile(filepath.Join(hostsDir(t), name+".pid"), []byte(strconv.Itoa(pid)), 0o644); err != nil {
		t.Fatal(err)
	}
	return h
}

// hostInit is a test host's init, PID 1 of its PID namespace: it mounts
// the overlays and a /proc of its PID namespace, sets the host name, says
// "ready", and reaps children until it is killed. This machine's /proc
// stays at DIR/hostproc, where ssh finds the other hosts.
func hostInit() int {
	name, dir := os.Getenv(hostNameEnv), os.Getenv(hostDirEnv)
	hostProc := filepath.Join(dir, "hostproc")
	if err := os.MkdirAll(hostProc, 0o755); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if err := syscall.Mount("/proc", hostProc, "", syscall.MS_BIND|syscall.MS_REC, ""); err != nil {
		fmt.Fprintf(os.Stderr, "bind /proc: %v\n", err)
		return 1
	}
	if err := syscall.Mount("proc", "/proc", "proc", syscall.MS_NOSUID|syscall.MS_NOEXEC|syscall.MS_NODEV, ""); err != nil {
		fmt.Fprintf(os.Stderr, "mount /proc: %v\n", err)
		return 1
	}
	for _, d := range overlaid {
		upper := filepath.Join(dir, "fs", strings.Trim(d, "/"))
		work := upper + ".work"
		for _, p := range []string{upper, work} {
			if err := os.MkdirAll(p, 0o755); err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 1
			}
		}
		if err := syscall.Mount("overlay", d, "overlay", 0, "lowerdir="+d+",upperdir="+upper+",workdir="+work); err != nil {
			fmt.Fprintf(os.Stderr, "overlay on %s: %v\n", d, err)
			return 1
		}
	}
	if err := syscall.Sethostname([]byte(name)); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	chld := make(chan os.Signal, 1)
	signal.Notify(chld, syscall.SIGCHLD)
	fmt.Println("ready")
	os.Stdout.Close()
	for {
		for {
			var ws syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
		<-chld
	}
}

// shellEnv is the environment of the commands run on a test host: root's
// login, and the Go toolchain of this test.
func shellEnv(t *testing.T) []string {
	t.Helper()
	env, err := shellEnvOnce()
	if err != nil {
		t.Fatal(err)
	}
	return slices.Clone(env)
}

var shellEnvOnce = sync.OnceValues(func() ([]string, error) {
	emu, err := emulatorOnce()
	if err != nil {
		return nil, err
	}
	goEnv := func(v string) (string, error) {
		out, err := exec.Command("go", "env", v).Output()
		return strings.TrimSpace(string(out)), err
	}
	goroot, err := goEnv("GOROOT")
	if err != nil {
		return nil, err
	}
	env := []string{
		"PATH=" + emu + ":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:" + filepath.Join(goroot, "bin"),
		"HOME=/root", "USER=root", "LOGNAME=root", "LANG=C.UTF-8", "DEBIAN_FRONTEND=noninteractive",
		"DLOCK_DEPLOY_HOSTS=" + filepath.Join(tmpRoot, "hosts"),
	}
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "GO") {
			env = append(env, kv)
		}
	}
	// The toolchain's caches where this test's go has them: what go
	// wrote under the overlaid /root would be the host's alone, and lost.
	for _, v := range []string{"GOCACHE", "GOMODCACHE", "GOPATH"} {
		val, err := goEnv(v)
		if err != nil {
			return nil, err
		}
		env = append(env, v+"="+val)
	}
	return env, nil
})

// sh runs script with sh -e on the host, from the repository's root, and
// returns what it printed. Its output goes to a file, not a pipe: what it
// leaves running in the background must not hold the test up.
func (h *host) sh(t *testing.T, script string) (string, error) {
	t.Helper()
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.CreateTemp(h.dir, "out-")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd := exec.Command("nsenter", "--target", strconv.Itoa(h.init), "--mount", "--uts", "--pid", "--",
		"/bin/sh", "-ec", "cd "+root+"\n"+script)
	cmd.Env = append(shellEnv(t), hostProcEnv+"="+filepath.Join(h.dir, "hostproc"))
	cmd.Stdin = nil
	cmd.Stdout, cmd.Stderr = f, f
	runErr := cmd.Run()
	out, err := os.ReadFile(f.Name())
	if err != nil {
		t.Fatal(err)
	}
	if ee, ok := errors.AsType[*exec.ExitError](runErr); ok {
		runErr = fmt.Errorf("exit status %d", ee.ExitCode())
	}
	return string(out), runErr
}

// mustSh is sh, failing the test on an error.
func (h *host) mustSh(t *testing.T, script string) string {
	t.Helper()
	out, err := h.sh(t, script)
	if err != nil {
		t.Fatalf("on %s: %v:\n%s\n--- output:\n%s%s", h.name, err, script, out, h.unitLogs())
	}
	return out
}

// unitLogs is what the units started on the host wrote (journalctl -u).
func (h *host) unitLogs() string {
	var b strings.Builder
	logs, _ := filepath.Glob(filepath.Join(h.dir, "fs", strings.TrimPrefix(unitStateDir, "/"), "*.log"))
	for _, l := range logs {
		out, _ := os.ReadFile(l)
		fmt.Fprintf(&b, "--- %s on %s:\n%s", filepath.Base(l), h.name, out)
	}
	return b.String()
}
