package main

import (
	"context"
	"crypto/rand"
	"io"
	"path/filepath"
	"testing"

	contentapi "github.com/containerd/containerd/api/services/content/v1"
	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/content/proxy"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/experimental"

	"github.com/dlock/dlock/internal/dlocktest"
)

// BenchmarkProxyRead reads a 4 MiB blob from dlock-content the way
// containerd's content proxy does while it unpacks a layer: one Read call
// per 32 KiB ReadAt.
func BenchmarkProxyRead(b *testing.B) {
	srv := dlocktest.Start(b, dlocktest.Options{RefCount: true})
	dir := b.TempDir()
	sock := filepath.Join(dir, "c.sock")
	ctx, cancel := context.WithCancel(b.Context())
	ready := make(chan struct{})
	errc := make(chan error, 1)
	go func() {
		errc <- run(ctx, []string{"--root", filepath.Join(dir, "shared"), "--socket", sock, "--server", srv.URL(), "--node", "n"}, func(string) string { return "" }, io.Discard, func() { close(ready) })
	}()
	defer func() { cancel(); <-errc }()
	<-ready
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()), experimental.WithBufferPool(bufferPool))
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	cs := proxy.NewContentStore(contentapi.NewContentClient(conn))
	data := make([]byte, 4<<20)
	rand.Read(data)
	d := digest.FromBytes(data)
	desc := ocispec.Descriptor{Digest: d, Size: int64(len(data))}
	if err := content.WriteBlob(ctx, cs, "layer-"+d.String(), io.NopCloser(bytesReader(data)), desc); err != nil {
		b.Fatal(err)
	}
	ra, err := cs.ReaderAt(ctx, desc)
	if err != nil {
		b.Fatal(err)
	}
	defer ra.Close()
	buf := make([]byte, 32<<10)
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		for off := int64(0); off < int64(len(data)); off += int64(len(buf)) {
			if _, err := ra.ReadAt(buf, off); err != nil {
				b.Fatal(err)
			}
		}
	}
}

func bytesReader(p []byte) io.Reader { return &sliceReader{p: p} }

type sliceReader struct{ p []byte }

func (r *sliceReader) Read(b []byte) (int, error) {
	if len(r.p) == 0 {
		return 0, io.EOF
	}
	n := copy(b, r.p)
	r.p = r.p[n:]
	return n, nil
}
