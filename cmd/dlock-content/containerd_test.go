package main

import (
	"bytes"
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
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/dlock/dlock/internal/dlocktest"
)

// TestRealContainerd runs three real containerd daemons (Debian's 1.6),
// each with its own dlock-content process on one shared root, against a
// real docker-registry on 127.0.0.1. `make test` installs both packages.
func TestRealContainerd(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED LOUDLY: TestRealContainerd needs root to run containerd; run `make test` as root to include it")
	}
	for _, bin := range []string{"containerd", "ctr", "docker-registry"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Fatalf("%s is not installed: `make test` installs it (Debian packages containerd and docker-registry)", bin)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	dir, err := os.MkdirTemp("", "dlc") // short: unix socket paths are limited
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })

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
	bin := filepath.Join(dir, "dlock-content")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	shared := filepath.Join(dir, "shared")
	counter := &blobCounter{full: map[string]int{}, failed: -1}
	var nodes []*ctrNode
	for i := range 3 {
		n := &ctrNode{name: fmt.Sprint("node", i), dir: filepath.Join(dir, fmt.Sprint("n", i))}
		n.proxy = counter.proxy(t, regAddr, i)
		n.start(t, bin, shared, srv.URL())
		nodes = append(nodes, n)
	}

	pullRef := func(n *ctrNode) string { return n.proxy + "/test/img:v1" }
	var wg sync.WaitGroup
	errs := make([]error, len(nodes))
	for i, n := range nodes {
		wg.Go(func() {
			_, errs[i] = n.ctr(ctx, "images", "pull", "--plain-http", "--snapshotter", "native", "--max-concurrent-downloads", "1", pullRef(n))
		})
	}
	wg.Wait()
	// The very first blob download, whichever node made it, got a registry
	// error: that node's pull fails, another node takes the blob over.
	failedNode := counter.failedNode()
	if failedNode < 0 {
		t.Fatal("no blob download was made")
	}
	for i, err := range errs {
		if (err != nil) != (i == failedNode) {
			t.Fatalf("node%d pull: %v (the registry error went to node%d)", i, err, failedNode)
		}
	}
	if _, err := nodes[failedNode].ctr(ctx, "images", "pull", "--plain-http", "--snapshotter", "native", pullRef(nodes[failedNode])); err != nil {
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

func freePort(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func startRegistry(t *testing.T, dir string) string {
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
	waitUntil(t, "the registry answers", func() bool {
		resp, err := http.Get("http://" + addr + "/v2/")
		if err == nil {
			resp.Body.Close()
		}
		return err == nil && resp.StatusCode == 200
	})
	return addr
}

// blobCounter counts complete blob downloads across every node's proxy,
// and answers the very first blob download with a registry error.
type blobCounter struct {
	mu     sync.Mutex
	full   map[string]int
	failed int // the node that got the error, -1 before
	once   sync.Once
}

func (c *blobCounter) failedNode() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.failed
}

func (c *blobCounter) count(d string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.full[d]
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
		fail := false
		c.once.Do(func() { fail = true })
		if fail {
			c.mu.Lock()
			c.failed = node
			c.mu.Unlock()
			http.Error(w, "registry trouble", http.StatusInternalServerError)
			return
		}
		rec := &statusRecorder{ResponseWriter: w}
		rp.ServeHTTP(rec, r)
		if rec.status == http.StatusOK || (rec.status == 0 && rec.n > 0) {
			c.mu.Lock()
			c.full[r.URL.Path[i+len("/blobs/"):]]++
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
}

func (n *ctrNode) start(t *testing.T, bin, shared, server string) {
	os.MkdirAll(n.dir, 0o755)
	contentSock := filepath.Join(n.dir, "content.sock")
	dc := exec.Command(bin, "--socket", contentSock, "--root", shared, "--node", n.name, "--server", server)
	var dcLog bytes.Buffer
	dc.Stdout, dc.Stderr = &dcLog, &dcLog
	if err := dc.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		dc.Process.Signal(syscall.SIGTERM)
		dc.Wait()
		if t.Failed() {
			t.Logf("%s dlock-content log:\n%s", n.name, dcLog.String())
		}
	})
	waitUntil(t, n.name+"'s dlock-content socket", func() bool { _, err := os.Stat(contentSock); return err == nil })

	n.sock = filepath.Join(n.dir, "containerd.sock")
	cfg := filepath.Join(n.dir, "containerd.toml")
	os.WriteFile(cfg, []byte(fmt.Sprintf(`version = 2
root = %q
state = %q
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.content.v1.content"]

[grpc]
  address = %q

[ttrpc]
  address = %q

[proxy_plugins]
  [proxy_plugins.dlock]
    type = "content"
    address = %q
`, filepath.Join(n.dir, "root"), filepath.Join(n.dir, "state"), n.sock, n.sock+".ttrpc", contentSock)), 0o600)
	cd := exec.Command("containerd", "--config", cfg)
	var cdLog bytes.Buffer
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
	waitUntil(t, n.name+"'s containerd", func() bool {
		_, err := n.ctr(context.Background(), "version")
		return err == nil
	})
}

func (n *ctrNode) ctr(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "ctr", append([]string{"-a", n.sock, "-n", "default"}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("ctr %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
