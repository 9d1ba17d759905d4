package main

import (
	"io"
	"sync"

	contentapi "github.com/containerd/containerd/api/services/content/v1"
	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/plugins/services/content/contentserver"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// service is containerd's content service over the store, with a Read of
// its own. containerd unpacks a layer through the proxy plugin with one
// Read call per 32 KiB; containerd's Read asks the store for the blob's
// Info (a stat and its labels) before it opens it, for the size alone,
// which the open blob gives (docs/CONTAINERD.md, "Unpacking through the
// plugin").
type service struct {
	contentapi.ContentServer
	store content.Store
}

func newService(store content.Store) *service {
	return &service{ContentServer: contentserver.New(store), store: store}
}

// readChunk is the largest reply: with its framing it stays within gRPC's
// 64 KiB buffers (bufferPool), as containerd's 32 KiB reads do.
const readChunk = 32 << 10

var readBuffers = sync.Pool{New: func() any { b := make([]byte, readChunk); return &b }}

func (s *service) Read(req *contentapi.ReadContentRequest, session contentapi.Content_ReadServer) error {
	dgst, err := digest.Parse(req.Digest)
	if err != nil {
		return status.Errorf(codes.InvalidArgument, "%v: %v", req.Digest, err)
	}
	ra, err := s.store.ReaderAt(session.Context(), ocispec.Descriptor{Digest: dgst})
	if err != nil {
		return errgrpc.ToGRPC(err)
	}
	defer ra.Close()
	offset, size, blobSize := max(req.Offset, 0), req.Size, ra.Size()
	if offset > blobSize {
		return status.Errorf(codes.OutOfRange, "read past object length %v bytes", blobSize)
	}
	if size <= 0 || offset+size > blobSize {
		size = blobSize - offset
	}
	bp := readBuffers.Get().(*[]byte)
	defer readBuffers.Put(bp)
	r := io.NewSectionReader(ra, offset, size)
	for {
		n, err := io.ReadFull(r, *bp)
		if n > 0 {
			if serr := session.Send(&contentapi.ReadContentResponse{Offset: offset, Data: (*bp)[:n]}); serr != nil {
				return serr
			}
			offset += int64(n)
		}
		switch err {
		case nil:
		case io.EOF, io.ErrUnexpectedEOF:
			return nil
		default:
			return errgrpc.ToGRPC(err)
		}
	}
}
