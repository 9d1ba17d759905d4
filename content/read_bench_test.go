package content

import (
	"crypto/rand"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/internal/dlocktest"
)

// BenchmarkReadPath: what containerd's content service asks of the store
// for each ReadAt of a blob through the proxy plugin, one Read call each
// (unpacking reads a layer 32 KiB at a time): Info, ReaderAt, a 32 KiB
// read, Close.
func BenchmarkReadPath(b *testing.B) {
	srv := dlocktest.Start(b, dlocktest.Options{RefCount: true})
	c := &client.Client{Server: srv.URL(), Node: "a", MaxRetries: -1, RequestTimeout: time.Second}
	defer c.Close()
	s, err := New(b.Context(), Config{Root: b.TempDir(), Client: c})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	data := make([]byte, 4<<20)
	rand.Read(data)
	d := digest.FromBytes(data)
	w, err := s.Writer(b.Context(), content.WithRef("default/1/layer-"+d.String()), content.WithDescriptor(ocispec.Descriptor{Size: int64(len(data))}))
	if err != nil {
		b.Fatal(err)
	}
	w.Write(data)
	if err := w.Commit(b.Context(), int64(len(data)), d); err != nil {
		b.Fatal(err)
	}
	buf := make([]byte, 32<<10)
	var off int64
	for b.Loop() {
		if _, err := s.Info(b.Context(), d); err != nil {
			b.Fatal(err)
		}
		ra, err := s.ReaderAt(b.Context(), ocispec.Descriptor{Digest: d})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := ra.ReadAt(buf, off); err != nil {
			b.Fatal(err)
		}
		ra.Close()
		off = (off + int64(len(buf))) % int64(len(data))
	}
	b.SetBytes(int64(len(buf)))
}
