package content

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/lock"
)

// files lists every name under dir, for checks that nothing was written
// or removed there.
func files(t *testing.T, dir string) []string {
	t.Helper()
	var names []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p != dir {
			rel, _ := filepath.Rel(dir, p)
			names = append(names, rel)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return names
}

// TestRefusesSymlinkedRoot: the store does not start when the root or one
// of its folders is a symlink, and creates nothing where it points.
func TestRefusesSymlinkedRoot(t *testing.T) {
	srv := newStoreEnv(t, nil).srv
	c := &client.Client{Server: srv.URL(), Node: "n", MaxRetries: -1, RequestTimeout: 500 * time.Millisecond}
	defer c.Close()
	for _, link := range []string{"", "blobs", "blobs/sha256", "labels", "labels/sha256", "trash", "nodes", "nodes/n", "nodes/n/ingest", "nodes/n/blobs", "nodes/n/blobs/sha256"} {
		t.Run("ROOT/"+link, func(t *testing.T) {
			base, outside := t.TempDir(), t.TempDir()
			root := filepath.Join(base, "root")
			if link == "" {
				if err := os.Symlink(outside, root); err != nil {
					t.Fatal(err)
				}
			} else {
				p := filepath.Join(root, link)
				if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.Symlink(outside, p); err != nil {
					t.Fatal(err)
				}
			}
			s, err := New(t.Context(), Config{Root: root, Client: c})
			if err == nil {
				s.Close()
			}
			if !errors.Is(err, ErrUnsafeRoot) {
				t.Errorf("%s a symlink: %v, want ErrUnsafeRoot", "ROOT/"+link, err)
			}
			if names := files(t, outside); len(names) != 0 {
				t.Errorf("created outside the root: %v", names)
			}
		})
	}
	// The link earlier versions made from the ingest folder to the shared
	// blobs is replaced by a folder.
	root := t.TempDir()
	os.MkdirAll(filepath.Join(root, "nodes", "n"), 0o755)
	os.Symlink(filepath.Join(root, "blobs"), filepath.Join(root, "nodes", "n", "blobs"))
	s, err := New(t.Context(), Config{Root: root, Client: c})
	if err != nil {
		t.Fatalf("a root of an earlier version: %v", err)
	}
	s.Close()
	if fi, err := os.Lstat(filepath.Join(root, "nodes", "n", "blobs")); err != nil || !fi.IsDir() {
		t.Fatalf("the old link to the shared blobs: %v %v, want a folder", fi, err)
	}
	// The ingest folder must be inside the root: publish moves blobs
	// through the root's os.Root.
	if _, err := New(t.Context(), Config{Root: t.TempDir(), Ingest: t.TempDir(), Client: c}); err == nil {
		t.Error("an ingest folder outside the root was accepted")
	}
}

// TestPlantedSymlinks: symlinks planted in the shared root after start
// (a blob, labels/, trash/) neither serve a foreign file as a blob nor
// make the store write or delete outside the root.
func TestPlantedSymlinks(t *testing.T) {
	e := newStoreEnv(t, nil)
	a := e.store("a")
	ctx := t.Context()
	outside := t.TempDir()

	t.Run("blob", func(t *testing.T) {
		secret := []byte("a file outside the root, not a blob")
		d := digest.FromBytes(secret)
		p := filepath.Join(outside, "secret")
		os.WriteFile(p, secret, 0o600)
		os.MkdirAll(filepath.Join(e.root, "blobs", "sha256"), 0o755)
		if err := os.Symlink(p, filepath.Join(e.root, "blobs", "sha256", d.Encoded())); err != nil {
			t.Fatal(err)
		}
		if _, err := a.Info(ctx, d); !errdefs.IsNotFound(err) {
			t.Errorf("Info of a symlink to a foreign file: %v, want NotFound", err)
		}
		if ra, err := a.ReaderAt(ctx, ocispec.Descriptor{Digest: d}); !errdefs.IsNotFound(err) {
			if err == nil {
				ra.Close()
			}
			t.Errorf("ReaderAt of a symlink to a foreign file: %v, want NotFound", err)
		}
		var seen []digest.Digest
		a.Walk(ctx, func(i content.Info) error { seen = append(seen, i.Digest); return nil })
		if len(seen) != 0 {
			t.Errorf("Walk lists %v", seen)
		}
		a.Delete(ctx, d)
		if got, err := os.ReadFile(p); err != nil || string(got) != string(secret) {
			t.Errorf("the foreign file after Delete: %q %v", got, err)
		}
	})

	t.Run("labels", func(t *testing.T) {
		d := commitBlob(t, a, []byte("labelled"))
		outLabels := filepath.Join(outside, "labels")
		os.MkdirAll(filepath.Join(outLabels, "sha256"), 0o755)
		foreign := filepath.Join(outLabels, "sha256", d.Encoded())
		os.WriteFile(foreign, []byte(`{"k":"foreign"}`), 0o600)
		plant(t, filepath.Join(e.root, "labels"), outLabels)
		a.Update(ctx, content.Info{Digest: d, Labels: map[string]string{"k": "v"}}, "labels.k")
		if got, _ := os.ReadFile(foreign); string(got) != `{"k":"foreign"}` {
			t.Errorf("Update wrote outside the root: %q", got)
		}
		if names := files(t, outLabels); len(names) != 2 {
			t.Errorf("outside labels after Update: %v", names)
		}
		a.Delete(ctx, d)
		if _, err := os.Stat(foreign); err != nil {
			t.Errorf("Delete removed a file outside the root: %v", err)
		}
	})

	t.Run("trash", func(t *testing.T) {
		d := commitBlob(t, a, []byte("to be deleted"))
		outTrash := filepath.Join(outside, "trash")
		os.MkdirAll(outTrash, 0o755)
		plant(t, filepath.Join(e.root, "trash"), outTrash)
		var trashed []string
		a.testHook = func(step string, _ <-chan struct{}) {
			if step == stepUnlink {
				trashed = files(t, outTrash)
			}
		}
		defer func() { a.testHook = nil }()
		if err := a.Delete(ctx, d); err != nil {
			t.Fatal(err)
		}
		if len(trashed) != 0 {
			t.Errorf("the blob was moved outside the root: %v", trashed)
		}
		if !blobExists(e.root, d) {
			t.Error("the blob is gone: the delete went through a trash outside the root")
		}
	})
}

// plant replaces the folder dir by a symlink to target.
func plant(t *testing.T, dir, target string) {
	t.Helper()
	if err := os.Rename(dir, dir+".moved"); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, dir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		os.Remove(dir)
		os.Rename(dir+".moved", dir)
	})
}

// TestNoDigestWriterTakesPullLock: a writer whose ref names no digest
// cannot commit into the shared blobs while another node holds the blob's
// delete (or pull) lock; its commit takes the pull lock, and succeeds once
// the resource is free.
func TestNoDigestWriterTakesPullLock(t *testing.T) {
	e := newStoreEnv(t, nil)
	a := e.store("a")
	ctx := t.Context()
	data := []byte("a blob whose ref has no digest")
	d := digest.FromBytes(data)

	gc, err := e.srv.Backend.TryLock(ctx, lock.LockRequest{Type: lock.Delete, Resource: d.String(), Node: "gc", Lease: lock.LeaseTTL})
	if err != nil || !gc.Acquired {
		t.Fatalf("gc's delete lock: %+v %v", gc, err)
	}
	w, err := a.Writer(ctx, content.WithRef("default/1/no-digest-here"))
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	w.Write(data)
	if err := w.Commit(ctx, int64(len(data)), d); !errdefs.IsUnavailable(err) {
		t.Fatalf("commit while gc deletes the blob: %v, want ErrUnavailable", err)
	}
	if blobExists(e.root, d) {
		t.Fatal("the blob entered the shared folder while gc held its delete lock")
	}
	if _, err := e.srv.Backend.Unlock(ctx, lock.UnlockRequest{Type: lock.Delete, Resource: d.String(), Node: "gc", Success: false, Error: "not deleted"}); err != nil {
		t.Fatal(err)
	}

	// Another node pulls it: the commit fails at once, and a leaves no
	// queue entry behind.
	b, err := e.srv.Backend.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: d.String(), Node: "b", Lease: lock.LeaseTTL})
	if err != nil || !b.Acquired {
		t.Fatalf("b's pull lock: %+v %v", b, err)
	}
	if err := w.Commit(ctx, int64(len(data)), ""); !errdefs.IsUnavailable(err) {
		t.Fatalf("commit while b pulls the blob: %v, want ErrUnavailable", err)
	}
	if st, _ := e.srv.Backend.Status(t.Context(), lock.Pull, d.String(), "a"); st.Position != 0 || blobExists(e.root, d) {
		t.Fatalf("after the refused commit: a at position %d, blob there: %v", st.Position, blobExists(e.root, d))
	}
	if _, err := e.srv.Backend.Cancel(context.Background(), lock.Pull, d.String(), "b"); err != nil {
		t.Fatal(err)
	}

	if err := w.Commit(ctx, int64(len(data)), ""); err != nil {
		t.Fatalf("commit of a free blob: %v", err)
	}
	if !blobExists(e.root, d) {
		t.Fatal("committed blob not in the shared folder")
	}
	if h := e.holder(lock.Pull, d); h != "" {
		t.Fatalf("pull lock still held by %q after the commit", h)
	}
	if refs := e.refs(d); len(refs) != 1 || refs[0] != "a" {
		t.Fatalf("references after a's commit: %v", refs)
	}
}
