package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"testing"

	contentapi "github.com/containerd/containerd/api/services/content/v1"
	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/plugins/content/local"
	"github.com/containerd/containerd/v2/plugins/services/content/contentserver"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
)

// readSession collects what a Read sends.
type readSession struct {
	grpc.ServerStream
	ctx  context.Context
	data bytes.Buffer
}

func (s *readSession) Context() context.Context { return s.ctx }
func (s *readSession) Send(r *contentapi.ReadContentResponse) error {
	s.data.Write(r.Data)
	return nil
}

// TestReadMatchesContainerd holds the service's own Read to containerd's:
// the same bytes and the same error codes for every offset and size, in
// range or not, and for digests that are bad or missing.
func TestReadMatchesContainerd(t *testing.T) {
	store, err := local.NewStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	data := make([]byte, 3*readChunk+123)
	rand.Read(data)
	d := digest.FromBytes(data)
	if err := content.WriteBlob(t.Context(), store, "blob", bytes.NewReader(data), ocispec.Descriptor{Digest: d, Size: int64(len(data))}); err != nil {
		t.Fatal(err)
	}
	ours, theirs := newService(store), contentserver.New(store)
	n := int64(len(data))
	offsets := []int64{-5, 0, 1, readChunk - 1, readChunk, n - 1, n, n + 1}
	sizes := []int64{-1, 0, 1, readChunk, readChunk + 1, n, n + 10}
	var reqs []*contentapi.ReadContentRequest
	for _, off := range offsets {
		for _, size := range sizes {
			reqs = append(reqs, &contentapi.ReadContentRequest{Digest: d.String(), Offset: off, Size: size})
		}
	}
	reqs = append(reqs,
		&contentapi.ReadContentRequest{Digest: "sha256:nothex"},
		&contentapi.ReadContentRequest{Digest: digest.FromString("missing").String()},
	)
	for _, req := range reqs {
		t.Run(fmt.Sprintf("%s@%d+%d", req.Digest[:12], req.Offset, req.Size), func(t *testing.T) {
			a, b := &readSession{ctx: t.Context()}, &readSession{ctx: t.Context()}
			errA, errB := ours.Read(req, a), theirs.Read(req, b)
			if status.Code(errA) != status.Code(errB) {
				t.Fatalf("error: ours %v, containerd's %v", errA, errB)
			}
			if !bytes.Equal(a.data.Bytes(), b.data.Bytes()) {
				t.Fatalf("ours read %d bytes, containerd's %d, or other bytes", a.data.Len(), b.data.Len())
			}
		})
	}
}
