package content

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/metadata"
	"github.com/containerd/containerd/v2/core/remotes"
	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	clog "github.com/containerd/log"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	bolt "go.etcd.io/bbolt"
	"go.uber.org/goleak"
	"golang.org/x/sync/semaphore"

	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/internal/dlocktest"
)

func TestMain(m *testing.M) {
	// The local store warns about fsverity on every open.
	_ = clog.SetLevel("error")
	goleak.VerifyTestMain(m,
		// containerd's metadata and docker resolver keep package-level workers.
		goleak.IgnoreTopFunction("go.opencensus.io/stats/view.(*worker).start"),
		goleak.IgnoreAnyFunction("net/http.(*persistConn).writeLoop"),
		goleak.IgnoreAnyFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreAnyFunction("internal/poll.runtime_pollWait"),
	)
}

// countingRegistry is an in-process OCI registry that counts, per blob,
// the complete and the partial downloads it served, and can break the
// first download of a chosen blob halfway.
type countingRegistry struct {
	h http.Handler

	mu      sync.Mutex
	full    map[string]map[string]int // digest → node (User-Agent) → complete downloads
	partial map[string]int
	breakAt map[string]bool // digest → break its next download halfway
}

func newRegistry() *countingRegistry {
	return &countingRegistry{
		h:       registry.New(registry.Logger(log.New(io.Discard, "", 0))),
		full:    map[string]map[string]int{},
		partial: map[string]int{},
		breakAt: map[string]bool{},
	}
}

type countingWriter struct {
	http.ResponseWriter
	status   int
	n, limit int64
}

func (w *countingWriter) WriteHeader(code int) {
	w.status = code
	w.ResponseWriter.WriteHeader(code)
}

func (w *countingWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	if w.limit > 0 && w.n+int64(len(p)) > w.limit {
		p = p[:w.limit-w.n]
		n, _ := w.ResponseWriter.Write(p)
		w.n += int64(n)
		if f, ok := w.ResponseWriter.(http.Flusher); ok {
			f.Flush()
		}
		panic(http.ErrAbortHandler) // the connection drops mid-body
	}
	n, err := w.ResponseWriter.Write(p)
	w.n += int64(n)
	return n, err
}

func (r *countingRegistry) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	i := strings.Index(req.URL.Path, "/blobs/sha256:")
	if req.Method != http.MethodGet || i < 0 {
		r.h.ServeHTTP(w, req)
		return
	}
	dgst := req.URL.Path[i+len("/blobs/"):]
	r.mu.Lock()
	brk, broken := r.breakAt[dgst]
	if brk {
		r.breakAt[dgst] = false
	}
	r.mu.Unlock()
	if broken && !brk && req.Header.Get("Range") != "" {
		// containerd resumes a broken download with a range request: the
		// registry keeps failing that node, so the download is lost.
		http.Error(w, "registry trouble", http.StatusServiceUnavailable)
		return
	}
	cw := &countingWriter{ResponseWriter: w}
	if brk {
		cw.limit = 1000
	}
	defer func() {
		r.mu.Lock()
		switch {
		case cw.limit > 0:
			r.partial[dgst]++
		case cw.status == http.StatusOK:
			if r.full[dgst] == nil {
				r.full[dgst] = map[string]int{}
			}
			r.full[dgst][req.Header.Get("User-Agent")]++
		}
		r.mu.Unlock()
	}()
	r.h.ServeHTTP(cw, req)
}

// counts returns a blob's complete downloads, leaving out those by the
// nodes named in except (pulls that failed: their attempts do not count),
// and its broken ones.
func (r *countingRegistry) counts(d string, except ...string) (full, partial int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for node, n := range r.full[d] {
		if !slices.Contains(except, node) {
			full += n
		}
	}
	return full, r.partial[d]
}

// node is one containerd "node": its own metadata database over its own
// Store on the shared root.
type node struct {
	name  string
	c     *client.Client
	store *Store
	db    *metadata.DB
	bdb   *bolt.DB
}

func newNode(t testing.TB, name, root, server string) *node {
	c := &client.Client{Server: server, Node: name, MaxRetries: -1, RequestTimeout: 500 * time.Millisecond, PollInterval: 50 * time.Millisecond}
	return newNodeWithClient(t, root, c)
}

// newNodeWithClient is newNode with a Client the test configured.
func newNodeWithClient(t testing.TB, root string, c *client.Client) *node {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := New(ctx, Config{Root: root, Client: c})
	if err != nil {
		t.Fatal(err)
	}
	bdb, err := bolt.Open(filepath.Join(t.TempDir(), "meta.db"), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	db := metadata.NewDB(bdb, s, nil)
	if err := db.Init(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		s.Close()
		c.Close()
		bdb.Close()
	})
	return &node{name: c.Node, c: c, store: s, db: db, bdb: bdb}
}

func nsctx(ctx context.Context) context.Context { return namespaces.WithNamespace(ctx, "default") }

// pull fetches an image through containerd's real fetch code and records it.
func (n *node) pull(ctx context.Context, ref string) error {
	ctx = nsctx(ctx)
	resolver := docker.NewResolver(docker.ResolverOptions{
		Hosts:   docker.ConfigureDefaultRegistries(docker.WithPlainHTTP(docker.MatchAllHosts)),
		Headers: http.Header{"User-Agent": {n.name}}, // lets the registry tell nodes apart
	})
	name, desc, err := resolver.Resolve(ctx, ref)
	if err != nil {
		return err
	}
	fetcher, err := resolver.Fetcher(ctx, name)
	if err != nil {
		return err
	}
	cs := n.db.ContentStore()
	h := images.Handlers(remotes.FetchHandler(cs, fetcher), images.SetChildrenLabels(cs, images.ChildrenHandler(cs)))
	// One download at a time per node: a failing download then never cuts
	// short another of the same node, and the registry's counts stay exact.
	if err := images.Dispatch(ctx, h, semaphore.NewWeighted(1), desc); err != nil {
		return err
	}
	is := metadata.NewImageStore(n.db)
	if _, err := is.Create(ctx, images.Image{Name: name, Target: desc}); err != nil {
		if !errdefs.IsAlreadyExists(err) {
			return err
		}
		if _, err := is.Update(ctx, images.Image{Name: name, Target: desc}); err != nil {
			return err
		}
	}
	return nil
}

// remove forgets an image and collects garbage, as `ctr images rm --sync`.
func (n *node) remove(ctx context.Context, ref string) error {
	ctx = nsctx(ctx)
	if err := metadata.NewImageStore(n.db).Delete(ctx, ref); err != nil {
		return err
	}
	_, err := n.db.GarbageCollect(ctx)
	return err
}

// readAll reads every blob through the node's metadata content store.
func (n *node) readAll(ctx context.Context, blobs []digest.Digest) error {
	ctx = nsctx(ctx)
	for _, d := range blobs {
		info, err := n.db.ContentStore().Info(ctx, d)
		if err != nil {
			return fmt.Errorf("%s: info %s: %w", n.name, d, err)
		}
		ra, err := n.db.ContentStore().ReaderAt(ctx, ocispecDesc(d, info.Size))
		if err != nil {
			return fmt.Errorf("%s: read %s: %w", n.name, d, err)
		}
		got, err := digest.FromReader(io.NewSectionReader(ra, 0, ra.Size()))
		ra.Close()
		if err != nil || got != d {
			return fmt.Errorf("%s: %s reads as %s (%v)", n.name, d, got, err)
		}
	}
	return nil
}

// pushImage pushes a random image and returns its reference and the
// digests of its config and layers.
func pushImage(t testing.TB, host, repo string, layers int, layerSize int64) (string, []digest.Digest, v1.Image) {
	img, err := random.Image(layerSize, int64(layers))
	if err != nil {
		t.Fatal(err)
	}
	ref := host + "/" + repo + ":v1"
	r, err := name.ParseReference(ref, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(r, img); err != nil {
		t.Fatal(err)
	}
	var blobs []digest.Digest
	cfg, _ := img.ConfigName()
	blobs = append(blobs, digest.Digest(cfg.String()))
	ls, _ := img.Layers()
	for _, l := range ls {
		d, _ := l.Digest()
		blobs = append(blobs, digest.Digest(d.String()))
	}
	return ref, blobs, img
}

func pullAll[N puller](ctx context.Context, nodes []N, ref string) []error {
	errs := make([]error, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		wg.Go(func() { errs[i] = n.pull(ctx, ref) })
	}
	wg.Wait()
	return errs
}

// pullOnceReadEverywhere pulls ref on every node at once and checks that
// each of its blobs was downloaded once, in full, and that every node
// reads every blob.
func pullOnceReadEverywhere(ctx context.Context, t *testing.T, reg *countingRegistry, nodes []*node, ref string, blobs []digest.Digest) {
	t.Helper()
	for i, err := range pullAll(ctx, nodes, ref) {
		if err != nil {
			t.Fatalf("node-%d pull: %v", i, err)
		}
	}
	for _, d := range blobs {
		if full, partial := reg.counts(d.String()); full != 1 || partial != 0 {
			t.Errorf("blob %s served fully %d times (partially %d), want once", d, full, partial)
		}
	}
	for _, n := range nodes {
		if err := n.readAll(ctx, blobs); err != nil {
			t.Fatal(err)
		}
	}
}

func blobExists(root string, d digest.Digest) bool {
	_, err := os.Stat(filepath.Join(root, "blobs", d.Algorithm().String(), d.Encoded()))
	return err == nil
}

// TestSharedPull is docs/CONTAINERD.md end to end in one process: three nodes, each
// with containerd's metadata database over its own Store on one shared
// directory, pull the same images through containerd's fetch code.
func TestSharedPull(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	srv := dlocktest.Start(t, dlocktest.Options{RefCount: true})
	reg := newRegistry()
	rs := httptest.NewServer(reg)
	defer rs.Close()
	host := strings.TrimPrefix(rs.URL, "http://")
	root := t.TempDir()
	var nodes []*node
	for i := range 3 {
		nodes = append(nodes, newNode(t, fmt.Sprint("node-", i), root, srv.URL()))
	}

	// 1. Every blob is downloaded once; every node can read every blob.
	ref1, blobs1, _ := pushImage(t, host, "test/one", 4, 256<<10)
	pullOnceReadEverywhere(ctx, t, reg, nodes, ref1, blobs1)

	// 2. A download that breaks midway on one node is completed by another.
	ref2, blobs2, _ := pushImage(t, host, "test/two", 3, 256<<10)
	broken := blobs2[1]
	reg.mu.Lock()
	reg.breakAt[broken.String()] = true
	reg.mu.Unlock()
	errs := pullAll(ctx, nodes, ref2)
	var failed []string
	for i, err := range errs {
		if err != nil {
			failed = append(failed, nodes[i].name)
			// The node whose download broke retries, as a user would.
			if err := nodes[i].pull(ctx, ref2); err != nil {
				t.Fatalf("node-%d pull after the broken download: %v", i, err)
			}
		}
	}
	if len(failed) != 1 {
		t.Fatalf("pulls of %v failed, want exactly the one whose download broke", failed)
	}
	if full, partial := reg.counts(broken.String()); full != 1 || partial != 1 {
		t.Errorf("broken blob served fully %d and partially %d times, want 1 and 1", full, partial)
	}
	if full, _ := reg.counts(broken.String(), failed...); full != 1 {
		t.Errorf("the broken download was not completed by another node")
	}
	for _, d := range blobs2 {
		if full, _ := reg.counts(d.String()); full != 1 {
			t.Errorf("blob %s served fully %d times, want once", d, full)
		}
	}
	for _, n := range nodes {
		if err := n.readAll(ctx, blobs2); err != nil {
			t.Fatal(err)
		}
	}

	// 3. Garbage collection on one node after removing its image leaves the
	// others' blobs intact; a dlock server restart in the middle loses no
	// reference; once every node removed the image its blobs are gone.
	name1 := ref1
	if err := nodes[0].remove(ctx, name1); err != nil {
		t.Fatal(err)
	}
	for _, d := range blobs1 {
		if !blobExists(root, d) {
			t.Fatalf("blob %s removed while nodes 1 and 2 use it", d)
		}
	}
	srv.Restart()
	rc, err := nodes[1].c.RefCount(ctx, blobs1[1].String())
	if err != nil || rc.Count != 2 {
		t.Fatalf("after the restart blob %s has references %v (%v), want node-1 and node-2", blobs1[1], rc.Nodes, err)
	}
	for _, n := range nodes[1:] {
		if err := n.remove(ctx, name1); err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range blobs1 {
		if blobExists(root, d) {
			t.Errorf("blob %s of an image no node has any more is still there", d)
		}
	}
	for _, d := range blobs2 {
		if !blobExists(root, d) {
			t.Errorf("blob %s of an image every node has was removed", d)
		}
	}
	if entries, _ := os.ReadDir(filepath.Join(root, "trash")); len(entries) != 0 {
		t.Errorf("trash not emptied: %d entries", len(entries))
	}
}

func ocispecDesc(d digest.Digest, size int64) ocispec.Descriptor {
	return ocispec.Descriptor{Digest: d, Size: size}
}
