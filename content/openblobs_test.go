package content

import (
	"os"
	"path/filepath"
	"testing"
	"testing/synctest"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// TestOpenBlobs: readers of one blob share one open file, which stays open
// for the linger after the last closes, and closes then; a dropped file
// serves its readers still, and the next reader opens the blob anew.
func TestOpenBlobs(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		name := filepath.Join(t.TempDir(), "blob")
		if err := os.WriteFile(name, blob, 0o600); err != nil {
			t.Fatal(err)
		}
		var opened []*os.File
		open := func() (*os.File, int64, error) {
			f, err := os.Open(name)
			if err != nil {
				return nil, 0, err
			}
			opened = append(opened, f)
			return f, int64(len(blob)), nil
		}
		isOpen := func(f *os.File) bool { _, err := f.Stat(); return err == nil }
		o := &openBlobs{linger: time.Second, files: make(map[digest.Digest]*blobFile)}
		get := func() *blobReader {
			r, err := o.get(blobDigest, open)
			if err != nil {
				t.Fatal(err)
			}
			return r
		}
		r1, r2 := get(), get()
		if len(opened) != 1 {
			t.Fatalf("two readers opened the blob %d times, want once", len(opened))
		}
		r1.Close()
		r1.Close() // a second close gives nothing back twice
		buf := make([]byte, 4)
		if _, err := r2.ReadAt(buf, 2); err != nil || string(buf) != string(blob[2:6]) {
			t.Fatalf("read after the other reader closed: %q %v", buf, err)
		}
		r2.Close()
		time.Sleep(time.Second / 2)
		r3 := get()
		if len(opened) != 1 {
			t.Fatal("a reader within the linger opened the blob anew")
		}
		r3.Close()
		time.Sleep(time.Second + time.Millisecond)
		synctest.Wait()
		if isOpen(opened[0]) || len(o.files) != 0 {
			t.Fatal("the file is still open a linger after its last reader")
		}

		r4 := get()
		o.drop(blobDigest)
		r5 := get()
		if len(opened) != 3 {
			t.Fatalf("opened %d times, want 3: a reader after a drop opens anew", len(opened))
		}
		if _, err := r4.ReadAt(buf, 0); err != nil || !isOpen(opened[1]) {
			t.Fatalf("the dropped file no longer serves its reader: %v", err)
		}
		r4.Close()
		if isOpen(opened[1]) {
			t.Fatal("a dropped file stays open after its last reader")
		}
		o.close()
		if !isOpen(opened[2]) {
			t.Fatal("close closed a file a reader still reads")
		}
		r5.Close()
		if isOpen(opened[2]) {
			t.Fatal("a file stays open after close and its last reader")
		}
		r6 := get()
		r6.Close()
		if isOpen(opened[3]) {
			t.Fatal("after close, files are shared again")
		}
	})
}

// TestDeleteDropsOpenBlob: a blob read a moment ago and then deleted by
// this node is not served from its open file.
func TestDeleteDropsOpenBlob(t *testing.T) {
	e := newStoreEnv(t, nil)
	a := e.store("a")
	ctx := t.Context()
	w, err := writerFor(ctx, a, blobDigest)
	if err != nil {
		t.Fatal(err)
	}
	w.Write(blob)
	if err := w.Commit(ctx, int64(len(blob)), blobDigest); err != nil {
		t.Fatal(err)
	}
	ra, err := a.ReaderAt(ctx, ocispec.Descriptor{Digest: blobDigest})
	if err != nil {
		t.Fatal(err)
	}
	ra.Close()
	if err := a.Delete(ctx, blobDigest); err != nil {
		t.Fatal(err)
	}
	if blobExists(e.root, blobDigest) {
		t.Fatal("the blob no node references is still there")
	}
	if _, err := a.ReaderAt(ctx, ocispec.Descriptor{Digest: blobDigest}); !errdefs.IsNotFound(err) {
		t.Fatalf("ReaderAt of a deleted blob: %v, want ErrNotFound", err)
	}
}
