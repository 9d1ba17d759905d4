package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/dlock/dlock/internal/dlocktest"
	"github.com/dlock/dlock/internal/dlocktest/kit"
)

// containerd2Env names the directory holding the containerd 2.x daemon
// and its ctr, built from containerd's Go module by `make containerd2`
// (the Makefile pins the version and sets this variable for `make test`).
const containerd2Env = "DLOCK_CONTAINERD2_BIN"

// A flavour is one kind of containerd daemon the real-daemon test runs.
type flavour struct {
	name string
	// dir holds the containerd and ctr binaries; "" looks them up in PATH.
	dir string
	// major is the version both binaries must report: the test must not
	// pass by running the same containerd twice.
	major string
	// config is the version of containerd's config file to write.
	config int
	// pull is added to every `ctr images pull`.
	pull []string
	// plugins is added to the config's [plugins] table.
	plugins string
}

func (f flavour) bin(name string) string {
	if f.dir == "" {
		return name
	}
	return filepath.Join(f.dir, name)
}

// flavours lists the daemons the test runs: Debian's containerd 1.6, and
// containerd 2.x pulling twice, once in ctr through the daemon's content
// API (--local, what 1.6 always does), once in the daemon itself (the
// transfer service, 2.x's default). Every pull reaches dlock-content
// through the daemon's metadata store either way.
func flavours() []flavour {
	dir2 := os.Getenv(containerd2Env)
	// The transfer service's settings for what ctr's flags say with --local:
	// one download at a time, and unpacking into the native snapshotter
	// (its default list has only the default snapshotter, overlayfs).
	transfer := fmt.Sprintf(`
  [plugins."io.containerd.transfer.v1.local"]
    max_concurrent_downloads = 1
    [[plugins."io.containerd.transfer.v1.local".unpack_config]]
      platform = "linux/%s"
      snapshotter = "native"
`, runtime.GOARCH)
	return []flavour{
		{name: "containerd-1.6", major: "1.6.", config: 2, pull: []string{"--max-concurrent-downloads", "1"}},
		{name: "containerd-2.x-local", dir: dir2, major: "2.", config: 3, pull: []string{"--local", "--max-concurrent-downloads", "1"}},
		{name: "containerd-2.x-transfer", dir: dir2, major: "2.", config: 3, plugins: transfer},
	}
}

// TestRealContainerd runs, for each flavour, three real containerd daemons,
// each with its own dlock-content process on one shared root, against a
// real docker-registry on 127.0.0.1. `make test` installs Debian's
// containerd 1.6 and docker-registry, and builds containerd 2.x.
func TestRealContainerd(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED LOUDLY: TestRealContainerd needs root to run containerd; run `make test` as root to include it")
	}
	if _, err := exec.LookPath("docker-registry"); err != nil {
		t.Fatal("docker-registry is not installed: `make test` installs it (Debian package docker-registry)")
	}
	dir, err := os.MkdirTemp("", "dlc") // short: unix socket paths are limited
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	bin := filepath.Join(dir, "dlock-content")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	checkDocsCommand(t)
	for i, f := range flavours() {
		t.Run(f.name, func(t *testing.T) {
			if f.major == "2." && f.dir == "" {
				t.Skipf("SKIPPED LOUDLY: %s is not set: run `make test`, or `make containerd2` and set %s to the directory it prints", containerd2Env, containerd2Env)
			}
			f.check(t)
			testRealContainerd(t, f, bin, filepath.Join(dir, fmt.Sprint(i)))
		})
	}
}

// check makes sure the flavour's binaries are there and are the version
// the flavour says.
func (f flavour) check(t testing.TB) {
	for _, name := range []string{"containerd", "ctr"} {
		out, err := exec.Command(f.bin(name), "--version").CombinedOutput()
		if err != nil {
			if f.dir == "" {
				t.Fatalf("%s: %v: `make test` installs it (Debian package containerd)", name, err)
			}
			t.Fatalf("%s: %v: `make containerd2` builds it into %s", f.bin(name), err, f.dir)
		}
		// "containerd github.com/containerd/containerd/v2 2.4.2+unknown ..."
		fields := strings.Fields(string(out))
		if len(fields) < 3 || !strings.HasPrefix(fields[2], f.major) {
			t.Fatalf("%s --version says %q, want version %s*", f.bin(name), strings.TrimSpace(string(out)), f.major)
		}
		t.Logf("%s", strings.TrimSpace(string(out)))
	}
}

func testRealContainerd(t *testing.T, f flavour, bin, dir string) {
	// Three subtests stay within go test's default 10-minute timeout: a
	// hung pull fails with the logs rather than the binary panicking.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	regAddr := startRegistry(t, dir)
	img, err := random.Image(1<<20, 4)
	if err != nil {
		t.Fatal(err)
	}
	ref, _ := name.ParseReference(regAddr+"/test/img:v1", name.Insecure)
	if err := remote.Write(ref, img); err != nil {
		t.Fatal(err)
	}
	var blobs []string
	cfgName, _ := img.ConfigName()
	blobs = append(blobs, cfgName.String())
	layers, _ := img.Layers()
	for _, l := range layers {
		d, _ := l.Digest()
		blobs = append(blobs, d.String())
	}

	srv := dlocktest.Start(t, dlocktest.Options{RefCount: true})
	shared := filepath.Join(dir, "shared")
	counter := &blobCounter{full: map[string]int{}, failed: -1}
	var nodes []*ctrNode
	for i := range 3 {
		n := &ctrNode{name: fmt.Sprint("node", i), dir: filepath.Join(dir, fmt.Sprint("n", i)), flavour: f}
		n.proxy = counter.proxy(t, regAddr, i)
		n.start(t, bin, shared, srv.URL())
		nodes = append(nodes, n)
	}

	pullRef := func(n *ctrNode) string { return n.proxy + "/test/img:v1" }
	pull := func(n *ctrNode) (string, error) {
		args := append([]string{"images", "pull", "--plain-http", "--snapshotter", "native"}, f.pull...)
		return n.ctr(ctx, append(args, pullRef(n))...)
	}
	var wg sync.WaitGroup
	errs := make([]error, len(nodes))
	for i, n := range nodes {
		wg.Go(func() { _, errs[i] = pull(n) })
	}
	wg.Wait()
	// The very first blob download, whichever node made it, got a registry
	// error: that node's pull fails, another node takes the blob over.
	// The failed node's second pull finds every blob in the shared store.
	counter.heal()
	failedNode := counter.failedNode()
	if failedNode < 0 {
		t.Fatalf("no blob download was made; pulls: %v", errs)
	}
	for i, err := range errs {
		if (err != nil) != (i == failedNode) {
			t.Fatalf("node%d pull: %v (the registry error went to node%d)", i, err, failedNode)
		}
	}
	if _, err := pull(nodes[failedNode]); err != nil {
		t.Fatalf("node%d's second pull: %v", failedNode, err)
	}
	for _, b := range blobs {
		if n := counter.count(b); n != 1 {
			t.Errorf("blob %s downloaded %d times, want once", b, n)
		}
	}
	t.Logf("downloads per blob: %v; registry error served to node%d: %v", counter.full, failedNode, errs[failedNode])

	// ctr images rm --sync on one node leaves the others' images intact.
	if _, err := nodes[0].ctr(ctx, "images", "rm", "--sync", pullRef(nodes[0])); err != nil {
		t.Fatal(err)
	}
	for _, b := range blobs {
		if !sharedBlob(shared, b) {
			t.Fatalf("blob %s removed while node1 and node2 have the image", b)
		}
	}
	for _, n := range nodes[1:] {
		if out, err := n.ctr(ctx, "images", "check"); err != nil || !strings.Contains(out, "complete") {
			t.Fatalf("%s image check: %v\n%s", n.name, err, out)
		}
	}
	// Once every node removed the image, its blobs are gone.
	for _, n := range nodes[1:] {
		if _, err := n.ctr(ctx, "images", "rm", "--sync", pullRef(n)); err != nil {
			t.Fatal(err)
		}
	}
	for _, b := range blobs {
		if sharedBlob(shared, b) {
			t.Errorf("blob %s is still in the shared root after every node removed the image", b)
		}
	}
}

func sharedBlob(root, d string) bool {
	_, err := os.Stat(filepath.Join(root, "blobs", "sha256", strings.TrimPrefix(d, "sha256:")))
	return err == nil
}

func freePort(t testing.TB) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func startRegistry(t testing.TB, dir string) string {
	addr := freePort(t)
	cfg := filepath.Join(dir, "registry.yml")
	os.WriteFile(cfg, []byte(fmt.Sprintf(`version: 0.1
log:
  level: error
storage:
  filesystem:
    rootdirectory: %s
  delete:
    enabled: true
http:
  addr: %s
`, filepath.Join(dir, "registry"), addr)), 0o600)
	cmd := exec.Command("docker-registry", "serve", cfg)
	cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	kit.WaitFor(t, "the registry answers", func() bool {
		resp, err := http.Get("http://" + addr + "/v2/")
		if err == nil {
			resp.Body.Close()
		}
		return err == nil && resp.StatusCode == 200
	})
	return addr
}

// blobCounter counts complete blob downloads across every node's proxy,
// and breaks the very first blob download: that blob answers a registry
// error to the node that asked first, to every request of that node
// (containerd 2.x retries a 500 once, 1.6 does not), until heal.
type blobCounter struct {
	mu     sync.Mutex
	full   map[string]int
	failed int    // the node that got the error, -1 before
	blob   string // the blob that answers it
	healed bool
	served int // registry errors served
}

func (c *blobCounter) failedNode() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.failed
}

func (c *blobCounter) heal() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.healed = true
}

func (c *blobCounter) count(d string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.full[d]
}

// fail says whether node's request of blob gets the registry error.
func (c *blobCounter) fail(node int, blob string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.failed < 0 {
		c.failed, c.blob = node, blob
	}
	if c.healed || c.failed != node || c.blob != blob {
		return false
	}
	c.served++
	return true
}

// proxy puts a counting reverse proxy in front of the registry for one node.
func (c *blobCounter) proxy(t *testing.T, registry string, node int) string {
	target, _ := url.Parse("http://" + registry)
	rp := httputil.NewSingleHostReverseProxy(target)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		i := strings.Index(r.URL.Path, "/blobs/sha256:")
		if r.Method != http.MethodGet || i < 0 {
			rp.ServeHTTP(w, r)
			return
		}
		blob := r.URL.Path[i+len("/blobs/"):]
		if c.fail(node, blob) {
			http.Error(w, "registry trouble", http.StatusInternalServerError)
			return
		}
		rec := &statusRecorder{ResponseWriter: w}
		rp.ServeHTTP(rec, r)
		if rec.status == http.StatusOK || (rec.status == 0 && rec.n > 0) {
			c.mu.Lock()
			c.full[blob]++
			c.mu.Unlock()
		}
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: h}
	go hs.Serve(ln)
	t.Cleanup(func() { hs.Close() })
	return ln.Addr().String()
}

type statusRecorder struct {
	http.ResponseWriter
	status int
	n      int64
}

func (r *statusRecorder) WriteHeader(code int) { r.status = code; r.ResponseWriter.WriteHeader(code) }
func (r *statusRecorder) Write(p []byte) (int, error) {
	n, err := r.ResponseWriter.Write(p)
	r.n += int64(n)
	return n, err
}

type ctrNode struct {
	name, dir, proxy string
	sock             string
	flavour          flavour
	// contentArgs is added to dlock-content's command line.
	contentArgs []string
	// contentLog is what dlock-content writes.
	contentLog kit.Buffer
}

// start starts the node's dlock-content on the shared root, then its
// containerd with dlock-content as its only content store.
func (n *ctrNode) start(t testing.TB, bin, shared, server string) {
	n.startContainerd(t, n.startContent(t, bin, shared, server))
}

// startContent starts the node's dlock-content and returns its socket.
func (n *ctrNode) startContent(t testing.TB, bin, shared, server string) string {
	os.MkdirAll(n.dir, 0o755)
	contentSock := filepath.Join(n.dir, "content.sock")
	args := append([]string{"--socket", contentSock, "--root", shared, "--node", n.name, "--server", server}, n.contentArgs...)
	dc := exec.Command(bin, args...)
	dc.Stdout, dc.Stderr = &n.contentLog, &n.contentLog
	if err := dc.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		dc.Process.Signal(syscall.SIGTERM)
		dc.Wait()
		if t.Failed() {
			t.Logf("%s dlock-content log:\n%s", n.name, n.contentLog.String())
		}
	})
	kit.WaitFor(t, n.name+"'s dlock-content socket", func() bool { _, err := os.Stat(contentSock); return err == nil })
	return contentSock
}

// startContainerd starts the node's containerd: with the content store
// behind contentSock, or with its own built-in one when contentSock is "".
func (n *ctrNode) startContainerd(t testing.TB, contentSock string) {
	os.MkdirAll(n.dir, 0o755)
	n.sock = filepath.Join(n.dir, "containerd.sock")
	cfg := filepath.Join(n.dir, "containerd.toml")
	// The same settings in config version 2 (containerd 1.6; 2.x reads it
	// too) and 3 (2.x): with dlock-content, the built-in content store off
	// and dlock-content the only content plugin; and the sharing policy
	// containerd defaults to written out, because "isolated" breaks the
	// retry of a blob that exists (docs/CONTAINERD.md).
	disabled, proxy := `"io.containerd.grpc.v1.cri"`, ""
	if contentSock != "" {
		disabled += `, "io.containerd.content.v1.content"`
		proxy = fmt.Sprintf(`
[proxy_plugins]
  [proxy_plugins.dlock]
    type = "content"
    address = %q
`, contentSock)
	}
	os.WriteFile(cfg, []byte(fmt.Sprintf(`version = %d
root = %q
state = %q
disabled_plugins = [%s]

[grpc]
  address = %q

[ttrpc]
  address = %q
%s
[plugins]
  [plugins."io.containerd.metadata.v1.bolt"]
    content_sharing_policy = "shared"
%s`, n.flavour.config, filepath.Join(n.dir, "root"), filepath.Join(n.dir, "state"), disabled, n.sock, n.sock+".ttrpc", proxy, n.flavour.plugins)), 0o600)
	cd := exec.Command(n.flavour.bin("containerd"), "--config", cfg)
	var cdLog kit.Buffer
	cd.Stdout, cd.Stderr = &cdLog, &cdLog
	if err := cd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cd.Process.Signal(syscall.SIGTERM)
		cd.Wait()
		if t.Failed() {
			t.Logf("%s containerd log:\n%s", n.name, cdLog.String())
		}
	})
	kit.WaitFor(t, n.name+"'s containerd", func() bool {
		_, err := n.ctr(context.Background(), "version")
		return err == nil
	})
}

func (n *ctrNode) ctr(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, n.flavour.bin("ctr"), append([]string{"-a", n.sock, "-n", "default"}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("ctr %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// checkDocsCommand holds docs/CONTAINERD.md's way to run this test alone to
// what `make test` runs: `make containerd2`, then this test with the
// directory it built in containerd2Env.
func checkDocsCommand(t *testing.T) {
	blocks := containerdBlocks(t, "TestRealContainerd")
	if len(blocks) != 1 {
		t.Fatalf("%s: %d blocks marked TestRealContainerd, want 1", containerdPage, len(blocks))
	}
	lines := strings.Split(strings.TrimSpace(blocks[0].Text), "\n")
	mk, err := os.ReadFile("../../Makefile")
	if err != nil {
		t.Fatal(err)
	}
	version := regexp.MustCompile(`(?m)^CONTAINERD2_VERSION \?= (\S+)$`).FindSubmatch(mk)
	if version == nil {
		t.Fatal("Makefile: no CONTAINERD2_VERSION")
	}
	want := containerd2Env + "=~/.cache/dlock/containerd-" + string(version[1]) + "/bin go test -race -run TestRealContainerd ./cmd/dlock-content/"
	if len(lines) != 2 || lines[0] != "make containerd2" || lines[1] != want {
		t.Errorf("%s:%d: want\nmake containerd2\n%s\ngot\n%s", containerdPage, blocks[0].Line, want, blocks[0].Text)
	}
}
