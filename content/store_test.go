package content

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/internal/dlocktest"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/memory"
)

type storeEnv struct {
	t    *testing.T
	srv  *dlocktest.Server
	root string
}

func newStoreEnv(t *testing.T, cfg func(*memory.Config)) *storeEnv {
	return &storeEnv{t: t, srv: dlocktest.Start(t, dlocktest.Options{RefCount: true, Config: cfg}), root: t.TempDir()}
}

func (e *storeEnv) store(node string) *Store {
	c := &client.Client{Server: e.srv.URL(), Node: node, MaxRetries: -1, RequestTimeout: 500 * time.Millisecond}
	s, err := New(e.t.Context(), Config{Root: e.root, Client: c})
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { s.Close(); c.Close() })
	return s
}

func (e *storeEnv) refs(d digest.Digest) []string {
	rc, err := e.srv.Backend.RefCount(e.t.Context(), d.String())
	if err != nil {
		e.t.Fatal(err)
	}
	return rc.Nodes
}

func (e *storeEnv) holder(t lock.Type, d digest.Digest) string {
	st, err := e.srv.Backend.Status(e.t.Context(), t, d.String(), "")
	if err != nil {
		e.t.Fatal(err)
	}
	return st.Holder
}

var blob = []byte("a layer's worth of bytes")
var blobDigest = digest.FromBytes(blob)

// writerFor opens a writer the way containerd's metadata layer does: the
// digest only in the ref's suffix, the descriptor's digest stripped.
func writerFor(ctx context.Context, s *Store, d digest.Digest) (content.Writer, error) {
	return s.Writer(ctx, content.WithRef("default/1/layer-"+d.String()), content.WithDescriptor(ocispec.Descriptor{Size: int64(len(blob))}))
}

func TestNewRefusals(t *testing.T) {
	plain := dlocktest.Start(t, dlocktest.Options{})
	c := &client.Client{Server: plain.URL(), Node: "n", MaxRetries: -1}
	defer c.Close()
	if _, err := New(t.Context(), Config{Root: t.TempDir(), Client: c}); !errors.Is(err, ErrNoRefCounting) {
		t.Fatalf("server without refcount=server: %v", err)
	}
	down := &client.Client{Server: "http://127.0.0.1:1", Node: "n", MaxRetries: -1}
	defer down.Close()
	if _, err := New(t.Context(), Config{Root: t.TempDir(), Client: down}); err == nil || !strings.Contains(err.Error(), "127.0.0.1:1") {
		t.Fatalf("unreachable server: %v", err)
	}
	file := filepath.Join(t.TempDir(), "file")
	os.WriteFile(file, nil, 0o600)
	if _, err := New(t.Context(), Config{Root: filepath.Join(file, "root"), Client: c}); err == nil {
		t.Fatal("a root that cannot be created was accepted")
	}
}

func TestWriterHandOff(t *testing.T) {
	e := newStoreEnv(t, nil)
	a, b := e.store("a"), e.store("b")
	ctx := t.Context()

	wa, err := writerFor(ctx, a, blobDigest)
	if err != nil {
		t.Fatal(err)
	}
	if h := e.holder(lock.Pull, blobDigest); h != "a" {
		t.Fatalf("pull lock held by %q, want a: the digest comes from the ref", h)
	}
	wb, err := writerFor(ctx, b, blobDigest)
	if err != nil {
		t.Fatalf("second node's writer: %v, want one that waits", err)
	}
	if st, _ := e.srv.Backend.Status(t.Context(), lock.Pull, blobDigest.String(), "b"); st.Position != 1 {
		t.Fatalf("b keeps no place in line: %+v", st)
	}
	wa.Write(blob[:5])
	wa.Close() // a gives up: b is next
	if h := e.holder(lock.Pull, blobDigest); h != "b" {
		t.Fatalf("after a's close without commit the lock is %q's, want b's", h)
	}
	// b's writer takes the lock over: an empty write to make.
	if st, err := wb.Status(); err != nil || st.Offset != 0 {
		t.Fatalf("b's writer after the hand-off: %+v %v", st, err)
	}
	wb.Write(blob)
	if wb.Digest() != blobDigest {
		t.Fatalf("writer digest %s, want %s", wb.Digest(), blobDigest)
	}
	if err := wb.Commit(ctx, int64(len(blob)), ""); err != nil {
		t.Fatal(err)
	}
	if h := e.holder(lock.Pull, blobDigest); h != "" {
		t.Fatalf("lock still held by %q after the commit", h)
	}
	if refs := e.refs(blobDigest); len(refs) != 1 || refs[0] != "b" {
		t.Fatalf("references after b's commit: %v", refs)
	}
	// The blob exists: a writer is ErrUnavailable, never ErrAlreadyExists.
	if _, err := writerFor(ctx, a, blobDigest); !errdefs.IsUnavailable(err) {
		t.Fatalf("writer for an existing blob: %v, want ErrUnavailable", err)
	}
	// a finds it through Info, which registers a's reference.
	info, err := a.Info(ctx, blobDigest)
	if err != nil || info.Size != int64(len(blob)) {
		t.Fatalf("info: %+v %v", info, err)
	}
	if refs := e.refs(blobDigest); len(refs) != 2 {
		t.Fatalf("references after a's Info: %v", refs)
	}
	if _, err := a.Info(ctx, digest.FromString("nothing")); !errdefs.IsNotFound(err) {
		t.Fatalf("info of a missing blob: %v", err)
	}
	// Ingests are per node.
	if st, err := a.ListStatuses(ctx); err != nil || len(st) != 1 {
		t.Fatalf("a's ingests: %v %v, want its one abandoned write", st, err)
	}
	if st, _ := b.ListStatuses(ctx); len(st) != 0 {
		t.Fatalf("b sees ingests: %v", st)
	}
}

func commitBlob(t *testing.T, s *Store, data []byte) digest.Digest {
	d := digest.FromBytes(data)
	w, err := s.Writer(t.Context(), content.WithRef("default/1/layer-"+d.String()), content.WithDescriptor(ocispec.Descriptor{Digest: d, Size: int64(len(data))}))
	if err != nil {
		t.Fatal(err)
	}
	w.Write(data)
	if err := w.Commit(t.Context(), int64(len(data)), d); err != nil {
		t.Fatal(err)
	}
	return d
}

func TestDelete(t *testing.T) {
	e := newStoreEnv(t, nil)
	a, b := e.store("a"), e.store("b")
	ctx := t.Context()
	d := commitBlob(t, a, []byte("shared"))
	if _, err := b.Info(ctx, d); err != nil {
		t.Fatal(err)
	}
	if err := a.Delete(ctx, d); err != nil {
		t.Fatalf("delete while b uses it: %v, want nil (one error stops the GC walk)", err)
	}
	if !blobExists(e.root, d) {
		t.Fatal("blob removed while b uses it")
	}
	if refs := e.refs(d); len(refs) != 1 || refs[0] != "b" {
		t.Fatalf("after a's delete: %v", refs)
	}
	var seen []digest.Digest
	a.Walk(ctx, func(i content.Info) error { seen = append(seen, i.Digest); return nil })
	if len(seen) != 1 || seen[0] != d {
		t.Fatalf("walk: %v", seen)
	}
	if err := b.Delete(ctx, d); err != nil {
		t.Fatal(err)
	}
	if blobExists(e.root, d) {
		t.Fatal("blob kept after its last reference went")
	}
	if entries, _ := os.ReadDir(filepath.Join(e.root, "trash")); len(entries) != 0 {
		t.Fatalf("trash: %v", entries)
	}
	if err := b.Delete(ctx, d); err != nil {
		t.Fatalf("delete of a blob already gone: %v", err)
	}
}

// TestDeleteNotConfirmed: when the delete lock is lost between the rename
// and the unlock, the blob is put back.
func TestDeleteNotConfirmed(t *testing.T) {
	e := newStoreEnv(t, nil)
	a := e.store("a")
	d := commitBlob(t, a, []byte("precious"))
	a.testHook = func(step string, _ <-chan struct{}) {
		if step != stepUnlink {
			return
		}
		// The server takes the lock back (as an expiry would).
		if _, err := e.srv.Backend.Cancel(context.Background(), lock.Delete, d.String(), "a"); err != nil {
			t.Error(err)
		}
	}
	if err := a.Delete(t.Context(), d); !errors.Is(err, client.ErrLockLost) {
		t.Fatalf("delete whose unlock is refused: %v, want ErrLockLost", err)
	}
	if !blobExists(e.root, d) {
		t.Fatal("blob removed although the delete was not confirmed")
	}
}

func TestDeleteRefusedWhilePulled(t *testing.T) {
	e := newStoreEnv(t, nil)
	a, b := e.store("a"), e.store("b")
	d := commitBlob(t, a, []byte("x"))
	if err := a.Delete(t.Context(), d); err != nil { // a's reference goes, the blob too
		t.Fatal(err)
	}
	// b pulls it again; while b's pull lock is held a's GC must not delete.
	w, err := writerFor(t.Context(), b, d)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	os.WriteFile(filepath.Join(e.root, "blobs", "sha256", d.Encoded()), []byte("x"), 0o644) // committed, not yet unlocked
	if err := a.Delete(t.Context(), d); err != nil {
		t.Fatal(err)
	}
	if !blobExists(e.root, d) {
		t.Fatal("a deleted a blob b's pull holds")
	}
}

func TestUpdateLabels(t *testing.T) {
	e := newStoreEnv(t, func(c *memory.Config) { c.UpdateRequiresNoRef = true })
	a := e.store("a")
	d := commitBlob(t, a, []byte("labelled"))
	if _, err := a.Update(t.Context(), content.Info{Digest: d, Labels: map[string]string{"k": "v"}}, "labels.k"); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("update of a referenced blob with update_requires_no_ref: %v", err)
	}
	if _, err := e.srv.Backend.RefRelease(t.Context(), d.String(), "a"); err != nil {
		t.Fatal(err)
	}
	info, err := a.Update(t.Context(), content.Info{Digest: d, Labels: map[string]string{"k": "v"}}, "labels.k")
	if err != nil || info.Labels["k"] != "v" {
		t.Fatalf("update: %+v %v", info, err)
	}
	if h := e.holder(lock.Update, d); h != "" {
		t.Fatalf("update lock still held by %q", h)
	}
}
