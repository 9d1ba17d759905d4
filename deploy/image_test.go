package deploy

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// The placeholders of deploy/README.md's "The image" that the tests
// replace with their own registry and address.
const (
	readmeRef  = "REGISTRY/dlock:TAG"
	readmeAddr = "127.0.0.1:7380"
)

// imageBlocks are the shell blocks of deploy/README.md's "The image", in
// order: build, build and push, pull and run, stop.
func imageBlocks(t *testing.T) (build, push, run, stop string) {
	t.Helper()
	b, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, sec, ok := strings.Cut(string(b), "\n## The image\n")
	if !ok {
		t.Fatal(`deploy/README.md has no section "## The image"`)
	}
	sec, _, _ = strings.Cut(sec, "\n## ")
	blocks := regexp.MustCompile("(?s)```sh\n(.*?)```").FindAllStringSubmatch(sec, -1)
	if len(blocks) != 4 {
		t.Fatalf(`deploy/README.md, "The image": %d sh blocks, want 4 (build, push, run, stop)`, len(blocks))
	}
	for i, want := range []string{"make image\n", "make image PUSH=", "ctr image pull", "ctr task kill"} {
		if !strings.HasPrefix(blocks[i][1], want) {
			t.Fatalf(`deploy/README.md, "The image": sh block %d starts %q, want %q`, i+1, blocks[i][1], want)
		}
	}
	return blocks[0][1], blocks[1][1], blocks[2][1], blocks[3][1]
}

// shell runs README blocks as a person would, from the repository root,
// with the test's variables and placeholders.
type shell struct {
	env   []string
	subst []string // old, new, ...
}

func newShell(vars ...string) shell {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch k {
		// A make of `make test` passes its command line down: the README's
		// make must see only what the block and the test say.
		case "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "IMAGE_OUT", "IMAGE_PLATFORMS", "PUSH",
			"SOURCE_DATE_EPOCH", "CONTAINERD_ADDRESS", "CONTAINERD_NAMESPACE", "CONTAINERD_SNAPSHOTTER":
			continue
		}
		env = append(env, kv)
	}
	return shell{env: append(env, vars...)}
}

func (sh shell) replacing(oldNew ...string) shell {
	return shell{env: sh.env, subst: append(slices.Clip(sh.subst), oldNew...)}
}

func (sh shell) run(t *testing.T, ctx context.Context, block string) string {
	t.Helper()
	for i := 0; i < len(sh.subst); i += 2 {
		if !strings.Contains(block, sh.subst[i]) {
			t.Fatalf("README block no longer has %q:\n%s", sh.subst[i], block)
		}
	}
	script := strings.NewReplacer(sh.subst...).Replace(block)
	cmd := exec.CommandContext(ctx, "bash", "-euo", "pipefail", "-c", script)
	cmd.Dir = ".."
	cmd.Env = sh.env
	// The block's make and go die with it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 10 * time.Second
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v:\n%s\noutput:\n%s", err, script, out)
	}
	t.Logf("ran:\n%s", script)
	return string(out)
}

func gitOut(t *testing.T, args ...string) string {
	t.Helper()
	cmd := exec.Command("git", args...)
	cmd.Dir = ".."
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("git %s: %v (the image tests need the repository's git history)", strings.Join(args, " "), err)
	}
	return strings.TrimSpace(string(out))
}

func needCommands(t *testing.T, names ...string) {
	t.Helper()
	for _, n := range names {
		if _, err := exec.LookPath(n); err != nil {
			t.Fatalf("%s is not installed: `make deps` installs the test dependencies (as root)", n)
		}
	}
}

// layoutIndex is the image index an OCI layout written by `make image`
// holds.
func layoutIndex(t *testing.T, dir string) v1.ImageIndex {
	t.Helper()
	p, err := layout.FromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	top, err := p.ImageIndex()
	if err != nil {
		t.Fatal(err)
	}
	m, err := top.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Manifests) != 1 {
		t.Fatalf("%s/index.json lists %d manifests, want the one image index", dir, len(m.Manifests))
	}
	idx, err := top.ImageIndex(m.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	return idx
}

func indexDigest(t *testing.T, idx v1.ImageIndex) v1.Hash {
	t.Helper()
	d, err := idx.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// TestImageBuild runs deploy/README.md's `make image` three times: twice
// as it is, which must give one digest, and once with another
// SOURCE_DATE_EPOCH, which must not. It checks what the README says the
// image is.
func TestImageBuild(t *testing.T) {
	needCommands(t, "make", "git", "go", "bash")
	build, _, _, _ := imageBlocks(t)
	ctx, cancel := context.WithTimeout(t.Context(), 15*time.Minute)
	defer cancel()
	dir := t.TempDir()
	commitTime, err := strconv.ParseInt(gitOut(t, "log", "-1", "--format=%ct"), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	var digests []v1.Hash
	for _, out := range []string{"a", "b"} {
		sh := newShell("IMAGE_OUT=" + filepath.Join(dir, out))
		sh.run(t, ctx, build)
		digests = append(digests, indexDigest(t, layoutIndex(t, filepath.Join(dir, out))))
	}
	if digests[0] != digests[1] {
		t.Fatalf("two builds of one tree: %s and %s", digests[0], digests[1])
	}
	t.Logf("two builds: %s", digests[0])
	checkImage(t, layoutIndex(t, filepath.Join(dir, "a")), time.Unix(commitTime, 0))

	later := time.Unix(commitTime+3600, 0)
	sh := newShell("IMAGE_OUT="+filepath.Join(dir, "c"), fmt.Sprint("SOURCE_DATE_EPOCH=", later.Unix()))
	sh.run(t, ctx, build)
	idx := layoutIndex(t, filepath.Join(dir, "c"))
	if d := indexDigest(t, idx); d == digests[0] {
		t.Fatalf("SOURCE_DATE_EPOCH an hour after the commit: the same digest %s", d)
	}
	checkImage(t, idx, later)
}

// checkImage checks the index against deploy/README.md: both platforms,
// the user, entrypoint and settings, the labels, and static binaries of
// the right architecture.
func checkImage(t *testing.T, idx v1.ImageIndex, created time.Time) {
	t.Helper()
	m, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	wantLabels := map[string]string{
		"org.opencontainers.image.title":    "dlock",
		"org.opencontainers.image.source":   "https://github.com/dlock/dlock",
		"org.opencontainers.image.revision": gitOut(t, "rev-parse", "HEAD"),
		"org.opencontainers.image.version":  gitOut(t, "describe", "--tags", "--always", "--dirty"),
		"org.opencontainers.image.created":  created.UTC().Format(time.RFC3339),
	}
	checkLabels := func(what string, got map[string]string) {
		for k, v := range wantLabels {
			if got[k] != v {
				t.Errorf("%s: %s is %q, want %q", what, k, got[k], v)
			}
		}
		if got["org.opencontainers.image.description"] == "" {
			t.Errorf("%s: no description", what)
		}
	}
	checkLabels("index annotations", m.Annotations)
	machines := map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}
	var platforms []string
	for _, desc := range m.Manifests {
		p := desc.Platform.String()
		platforms = append(platforms, p)
		img, err := idx.Image(desc.Digest)
		if err != nil {
			t.Fatal(err)
		}
		cf, err := img.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		c := cf.Config
		if c.User != "65532:65532" || !slices.Equal(c.Entrypoint, []string{"/usr/local/bin/dlock", "serve"}) ||
			!slices.Contains(c.Env, "DLOCK_LISTEN=0.0.0.0:7380") || !slices.Contains(c.Env, "DLOCK_DATA_DIR=/var/lib/dlock") {
			t.Errorf("%s: user %q, entrypoint %q, env %q", p, c.User, c.Entrypoint, c.Env)
		}
		if !cf.Created.Equal(created) {
			t.Errorf("%s: created %s, want %s", p, cf.Created, created)
		}
		checkLabels(p+" labels", c.Labels)
		layers, err := img.Layers()
		if err != nil || len(layers) != 1 {
			t.Fatalf("%s: %d layers (%v), want 1 on an empty base", p, len(layers), err)
		}
		files := layerFiles(t, layers[0], created)
		for _, b := range []string{"usr/local/bin/dlock", "usr/local/bin/dlock-content"} {
			checkStatic(t, p+" "+b, files[b], machines[desc.Platform.Architecture])
		}
		if h := files["var/lib/dlock/"].Header; h == nil || h.Typeflag != tar.TypeDir || h.Uid != 65532 || h.Gid != 65532 || h.Mode != 0o700 {
			t.Errorf("%s: /var/lib/dlock is %+v, want a directory 0700 of 65532:65532", p, h)
		}
	}
	if !slices.Equal(platforms, []string{"linux/amd64", "linux/arm64"}) {
		t.Errorf("index platforms %v, want linux/amd64, linux/arm64", platforms)
	}
}

// layerFile is one entry of a layer; body is a regular file's content.
type layerFile struct {
	*tar.Header
	body []byte
}

// layerFiles reads a layer, checking that every entry has the image's time.
func layerFiles(t *testing.T, l v1.Layer, created time.Time) map[string]layerFile {
	t.Helper()
	rc, err := l.Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	files := map[string]layerFile{}
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return files
		}
		if err != nil {
			t.Fatal(err)
		}
		if !h.ModTime.Equal(created) {
			t.Errorf("%s: time %s, want %s", h.Name, h.ModTime, created)
		}
		body, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		files[h.Name] = layerFile{h, body}
	}
}

// checkStatic: an executable of the machine with no interpreter and no
// shared library, which is what runs on an empty base.
func checkStatic(t *testing.T, what string, h layerFile, machine elf.Machine) {
	t.Helper()
	if h.Header == nil || h.Typeflag != tar.TypeReg {
		t.Errorf("%s: missing", what)
		return
	}
	if h.Mode != 0o755 || h.Uid != 0 {
		t.Errorf("%s: mode %o, owner %d", what, h.Mode, h.Uid)
	}
	f, err := elf.NewFile(bytes.NewReader(h.body))
	if err != nil {
		t.Errorf("%s: %v", what, err)
		return
	}
	defer f.Close()
	if f.Machine != machine || f.Type != elf.ET_EXEC {
		t.Errorf("%s: %s %s, want %s ET_EXEC", what, f.Machine, f.Type, machine)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP || p.Type == elf.PT_DYNAMIC {
			t.Errorf("%s: has %s: not static", what, p.Type)
		}
	}
}

// TestImageContainerd runs the rest of deploy/README.md's "The image": the
// image pushed to a docker-registry on 127.0.0.1, pulled and run by a
// containerd of the test's own (its root, state, socket and namespace),
// the server in the container asked for a lock, the container stopped and
// removed. Whatever the test leaves, its cleanup removes: the container's
// processes, the shim, mounts, cgroups, containerd and the registry.
func TestImageContainerd(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED LOUDLY: TestImageContainerd needs root to run containerd and a container; the image is NOT run; run `make test` as root")
	}
	needCommands(t, "make", "git", "go", "bash", "curl", "docker-registry", "containerd", "ctr", "runc")
	_, push, run, stop := imageBlocks(t)
	ctx, cancel := context.WithTimeout(t.Context(), 15*time.Minute)
	defer cancel()
	dir, err := os.MkdirTemp("", "dli") // short: unix socket paths are limited
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })

	ref := startRegistry(t, dir) + "/dlock:test"
	sh := newShell("IMAGE_OUT="+filepath.Join(dir, "image")).replacing(readmeRef, ref)
	out := sh.run(t, ctx, push)
	built := indexDigest(t, layoutIndex(t, filepath.Join(dir, "image")))
	if !strings.Contains(out, "pushed "+ref+"@"+built.String()) {
		t.Fatalf("make image PUSH=%s built %s, but said:\n%s", ref, built, out)
	}
	r, err := name.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	desc, err := remote.Head(r, remote.WithContext(ctx))
	if err != nil {
		t.Fatal(err)
	}
	if desc.Digest != built || desc.MediaType != "application/vnd.oci.image.index.v1+json" {
		t.Fatalf("the registry has %s (%s), the layout %s", desc.Digest, desc.MediaType, built)
	}

	c := startContainerd(t, dir)
	addr := freeAddr(t)
	ctrEnv := newShell("CONTAINERD_ADDRESS="+c.sock, "CONTAINERD_NAMESPACE="+c.ns)
	out = ctrEnv.replacing(readmeRef, ref, readmeAddr, addr).run(t, ctx, run)
	if !strings.Contains(out, `"status":"ok"`) {
		t.Fatalf("the container's /healthz:\n%s", out)
	}
	if line := c.ctrLine(t, ctx, []string{"image", "ls"}, ref); !strings.Contains(line, built.String()) {
		t.Fatalf("containerd pulled %q, want digest %s", line, built)
	}
	pid := c.taskPID(t, ctx)
	checkContained(t, pid, addr)
	lockUnlock(t, "http://"+addr)

	// ctr task rm warns of an exit code other than 0: SIGTERM must let
	// dlock finish and exit cleanly.
	if out := ctrEnv.run(t, ctx, stop); strings.Contains(out, "exit code") {
		t.Errorf("the README's stop:\n%s", out)
	}
	if out := c.ctr(t, ctx, "task", "ls", "-q"); strings.TrimSpace(out) != "" {
		t.Errorf("tasks left after the README's stop: %q", out)
	}
	if out := c.ctr(t, ctx, "container", "ls", "-q"); strings.TrimSpace(out) != "" {
		t.Errorf("containers left after the README's stop: %q", out)
	}
	if m := mountsUnder(dir); len(m) > 0 {
		t.Errorf("mounts left after the README's stop: %q", m)
	}
	if resp, err := http.Get("http://" + addr + "/healthz"); err == nil {
		resp.Body.Close()
		t.Errorf("%s still answers after the README's stop: %s", addr, resp.Status)
	}
	waitFor(t, "the shim to exit", func() bool { return len(c.shims()) == 0 })
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// waitFor polls cond until it holds; the deadline only keeps a broken run
// from hanging the test.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited 60 s for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// startRegistry runs Debian's docker-registry on a free port of 127.0.0.1.
func startRegistry(t *testing.T, dir string) string {
	t.Helper()
	addr := freeAddr(t)
	cfg := filepath.Join(dir, "registry.yml")
	err := os.WriteFile(cfg, fmt.Appendf(nil, `version: 0.1
log:
  level: error
storage:
  filesystem:
    rootdirectory: %s
http:
  addr: %s
`, filepath.Join(dir, "registry"), addr), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("docker-registry", "serve", cfg)
	var log bytes.Buffer
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		if t.Failed() {
			t.Logf("docker-registry log:\n%s", log.String())
		}
	})
	waitFor(t, "the registry", func() bool {
		resp, err := http.Get("http://" + addr + "/v2/")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return addr
}

type containerd struct {
	dir, sock string
	// ns is the test's containerd namespace, which also names the
	// container's cgroups (/sys/fs/cgroup/*/NS/ID) and runc's state
	// (/run/containerd/runc/NS): unique, so that cleanup touches only
	// what this test made.
	ns string
}

// startContainerd runs Debian's containerd with its own root, state and
// socket under dir. Its cleanup stops it and removes whatever a failed
// run left.
func startContainerd(t *testing.T, dir string) *containerd {
	t.Helper()
	c := &containerd{dir: dir, sock: filepath.Join(dir, "c.sock"), ns: fmt.Sprintf("dlock-image-test-%d", os.Getpid())}
	cfg := filepath.Join(dir, "containerd.toml")
	err := os.WriteFile(cfg, fmt.Appendf(nil, `version = 2
root = %q
state = %q
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = %q

[ttrpc]
  address = %q
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), c.sock, c.sock+".ttrpc"), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("containerd", "--config", cfg)
	var log bytes.Buffer
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// What the README's stop did not: the container first, then
		// containerd, then what neither removed.
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if out, _ := c.run(ctx, "task", "ls", "-q"); strings.TrimSpace(out) != "" {
			c.run(ctx, "task", "kill", "-s", "SIGKILL", "dlock")
			c.run(ctx, "task", "rm", "-f", "dlock")
		}
		if out, _ := c.run(ctx, "container", "ls", "-q"); strings.TrimSpace(out) != "" {
			c.run(ctx, "container", "rm", "dlock")
		}
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
		for _, pid := range c.shims() {
			t.Logf("killing shim %d", pid)
			syscall.Kill(pid, syscall.SIGKILL)
		}
		if err := c.removeCgroups(); err != nil {
			t.Error(err)
		}
		for _, m := range slices.Backward(mountsUnder(dir)) {
			t.Logf("unmounting %s", m)
			if err := syscall.Unmount(m, syscall.MNT_DETACH); err != nil {
				t.Errorf("unmount %s: %v", m, err)
			}
		}
		// runc's state of the namespace's containers, and the socket of a
		// shim that was killed (containerd 1.6 names it by the hash of its
		// address, namespace and container), are outside dir.
		if err := os.RemoveAll(filepath.Join("/run/containerd/runc", c.ns)); err != nil {
			t.Error(err)
		}
		shimSock := sha256.Sum256([]byte(filepath.Join(c.sock, c.ns, "dlock")))
		if err := os.Remove(fmt.Sprintf("/run/containerd/s/%x", shimSock)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			t.Error(err)
		}
		if t.Failed() {
			t.Logf("containerd log:\n%s", log.String())
		}
	})
	waitFor(t, "containerd", func() bool {
		_, err := c.run(context.Background(), "version")
		return err == nil
	})
	return c
}

func (c *containerd) run(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "ctr", append([]string{"--address", c.sock, "--namespace", c.ns}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("ctr %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

func (c *containerd) ctr(t *testing.T, ctx context.Context, args ...string) string {
	t.Helper()
	out, err := c.run(ctx, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// ctrLine is the line of a ctr listing whose first field is first.
func (c *containerd) ctrLine(t *testing.T, ctx context.Context, args []string, first string) string {
	t.Helper()
	out := c.ctr(t, ctx, args...)
	for line := range strings.Lines(out) {
		if f := strings.Fields(line); len(f) > 0 && f[0] == first {
			return line
		}
	}
	t.Fatalf("ctr %s lists no %s:\n%s", strings.Join(args, " "), first, out)
	return ""
}

// taskPID is the host pid of the container's process, running.
func (c *containerd) taskPID(t *testing.T, ctx context.Context) int {
	t.Helper()
	f := strings.Fields(c.ctrLine(t, ctx, []string{"task", "ls"}, "dlock"))
	if len(f) != 3 || f[2] != "RUNNING" {
		t.Fatalf("ctr task ls: %q, want dlock PID RUNNING", f)
	}
	pid, err := strconv.Atoi(f[1])
	if err != nil {
		t.Fatal(err)
	}
	return pid
}

// shims are the pids of the runc shims serving this containerd.
func (c *containerd) shims() []int {
	var pids []int
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil || !bytes.Contains(b, []byte("containerd-shim")) ||
			!bytes.Contains(b, []byte("\x00-address\x00"+c.sock+"\x00")) {
			continue
		}
		if pid, err := strconv.Atoi(filepath.Base(filepath.Dir(p))); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids
}

// removeCgroups removes the namespace's cgroups, which containerd leaves
// behind, killing any process still in them (a failed run's).
func (c *containerd) removeCgroups() error {
	roots, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup/*", c.ns))
	if unified := filepath.Join("/sys/fs/cgroup", c.ns); dirExists(unified) {
		roots = append(roots, unified)
	}
	var errs []error
	for _, root := range roots {
		var dirs []string
		filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for _, d := range slices.Backward(dirs) {
			b, _ := os.ReadFile(filepath.Join(d, "cgroup.procs"))
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil {
					syscall.Kill(pid, syscall.SIGKILL)
				}
			}
			// A killed process leaves its cgroup a moment later.
			deadline := time.Now().Add(10 * time.Second)
			for {
				err := syscall.Rmdir(d)
				if err == nil || errors.Is(err, fs.ErrNotExist) {
					break
				}
				if !errors.Is(err, syscall.EBUSY) || time.Now().After(deadline) {
					errs = append(errs, fmt.Errorf("rmdir %s: %w", d, err))
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
		}
	}
	return errors.Join(errs...)
}

func dirExists(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.IsDir()
}

// mountsUnder lists the mount points below dir, outermost first.
func mountsUnder(dir string) []string {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	var ms []string
	for line := range strings.Lines(string(b)) {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			ms = append(ms, f[4])
		}
	}
	return ms
}

// checkContained: the process serving addr is the image's dlock, in a
// mount namespace of its own, as uid and gid 65532, with the image's data
// directory.
func checkContained(t *testing.T, pid int, addr string) {
	t.Helper()
	proc := fmt.Sprintf("/proc/%d/", pid)
	status, err := os.ReadFile(proc + "status")
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"Uid", "Gid"} {
		m := regexp.MustCompile(`(?m)^` + id + `:\s+(.*)$`).FindSubmatch(status)
		if m == nil || !slices.Equal(strings.Fields(string(m[1])), []string{"65532", "65532", "65532", "65532"}) {
			t.Errorf("the container's process: %s %q, want 65532 (real, effective, saved, fs)", id, m)
		}
	}
	if exe, err := os.Readlink(proc + "exe"); err != nil || exe != "/usr/local/bin/dlock" {
		t.Errorf("the container's process runs %q (%v), want /usr/local/bin/dlock", exe, err)
	}
	ours, _ := os.Readlink("/proc/self/ns/mnt")
	if theirs, err := os.Readlink(proc + "ns/mnt"); err != nil || theirs == ours {
		t.Errorf("the container's mount namespace %q (%v) is the test's", theirs, err)
	}
	env, err := os.ReadFile(proc + "environ")
	if err != nil {
		t.Fatal(err)
	}
	vars := strings.Split(string(env), "\x00")
	for _, v := range []string{"DLOCK_LISTEN=" + addr, "DLOCK_DATA_DIR=/var/lib/dlock"} {
		if !slices.Contains(vars, v) {
			t.Errorf("the container's environment %q lacks %s", vars, v)
		}
	}
	fi, err := os.Stat(proc + "root/var/lib/dlock/dlock.lock")
	if err != nil {
		t.Fatalf("the server's data directory in the container: %v", err)
	}
	if st := fi.Sys().(*syscall.Stat_t); st.Uid != 65532 {
		t.Errorf("the container's /var/lib/dlock/dlock.lock belongs to uid %d", st.Uid)
	}
}

// lockUnlock takes and releases a lock (docs/API.md, POST /lock and
// /unlock), checking /status between.
func lockUnlock(t *testing.T, base string) {
	t.Helper()
	client := &http.Client{Timeout: 10 * time.Second}
	defer client.CloseIdleConnections()
	call := func(method, path, body string, into any) {
		t.Helper()
		req, err := http.NewRequest(method, base+path, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s %s %s: %s %s", method, path, body, resp.Status, b)
		}
		if err := json.Unmarshal(b, into); err != nil {
			t.Fatalf("%s %s: %v: %s", method, path, err, b)
		}
	}
	const key = `"type":"pull","resource_id":"sha256:image-test","node_id":"n1"`
	var lock struct {
		Acquired bool  `json:"acquired"`
		Token    int64 `json:"token"`
	}
	call("POST", "/lock", `{`+key+`,"lease":"ttl"}`, &lock)
	if !lock.Acquired || lock.Token <= 0 {
		t.Fatalf("/lock: %+v, want acquired with a token", lock)
	}
	var status struct {
		State  string `json:"state"`
		Holder string `json:"holder"`
		Token  int64  `json:"token"`
	}
	call("GET", "/status?type=pull&resource_id=sha256:image-test", "", &status)
	if status.State != "held" || status.Holder != "n1" || status.Token != lock.Token {
		t.Fatalf("/status after /lock: %+v, want held by n1 with token %d", status, lock.Token)
	}
	var unlock struct {
		Released bool `json:"released"`
	}
	call("POST", "/unlock", fmt.Sprintf(`{%s,"success":true,"token":%d}`, key, lock.Token), &unlock)
	if !unlock.Released {
		t.Fatalf("/unlock: %+v", unlock)
	}
	call("GET", "/status?type=pull&resource_id=sha256:image-test", "", &status)
	if status.State != "free" || status.Holder != "" {
		t.Fatalf("/status after /unlock: %+v, want free", status)
	}
	t.Logf("the container's server granted token %d and released it", lock.Token)
}
