package main

import (
	"bytes"
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

// proxyReader starts dlock-content on a fresh store with one random 4 MiB
// blob in it, and opens the blob through containerd's content proxy, as
// the daemon does with a content plugin.
func proxyReader(tb testing.TB) (content.ReaderAt, []byte) {
	srv := dlocktest.Start(tb, dlocktest.Options{RefCount: true})
	dir := tb.TempDir()
	sock := filepath.Join(dir, "c.sock")
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan struct{})
	errc := make(chan error, 1)
	go func() {
		errc <- run(ctx, []string{"--root", filepath.Join(dir, "shared"), "--socket", sock, "--server", srv.URL(), "--node", "n"}, func(string) string { return "" }, io.Discard, func() { close(ready) })
	}()
	tb.Cleanup(func() { cancel(); <-errc })
	select {
	case <-ready:
	case err := <-errc:
		tb.Fatal(err)
	}
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()), experimental.WithBufferPool(bufferPool))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { conn.Close() })
	cs := proxy.NewContentStore(contentapi.NewContentClient(conn))
	data := make([]byte, 4<<20)
	rand.Read(data)
	d := digest.FromBytes(data)
	desc := ocispec.Descriptor{Digest: d, Size: int64(len(data))}
	if err := content.WriteBlob(ctx, cs, "layer-"+d.String(), bytes.NewReader(data), desc); err != nil {
		tb.Fatal(err)
	}
	ra, err := cs.ReaderAt(ctx, desc)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { ra.Close() })
	return ra, data
}

// readBy32K reads the blob as containerd unpacks it: 32 KiB per ReadAt.
func readBy32K(tb testing.TB, ra content.ReaderAt, into []byte) {
	for off := 0; off < len(into); off += 32 << 10 {
		if _, err := ra.ReadAt(into[off:min(off+32<<10, len(into))], int64(off)); err != nil {
			tb.Fatal(err)
		}
	}
}

// TestProxyRead: a blob read through the proxy 32 KiB at a time is the
// blob.
func TestProxyRead(t *testing.T) {
	ra, data := proxyReader(t)
	got := make([]byte, len(data))
	readBy32K(t, ra, got)
	if !bytes.Equal(got, data) {
		t.Fatal("the blob read through the proxy differs from the blob written")
	}
}

// BenchmarkProxyRead reads a 4 MiB blob from dlock-content the way
// containerd's content proxy does while it unpacks a layer: one Read call
// per 32 KiB ReadAt (docs/CONTAINERD.md, "Unpacking through the plugin").
func BenchmarkProxyRead(b *testing.B) {
	ra, data := proxyReader(b)
	buf := make([]byte, len(data))
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		readBy32K(b, ra, buf)
	}
}
