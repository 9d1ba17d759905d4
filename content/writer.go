package content

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"

	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/lock"
)

// Writer opens a writer for one blob, for the one node that holds the blob's
// pull lock. It never blocks: containerd calls it inside its metadata
// transaction and retries ErrUnavailable with back-off.
//
//   - The digest comes from the descriptor or, as containerd strips it, from
//     the ref's suffix (layer-sha256:<hex>).
//   - A blob that exists answers ErrUnavailable, not ErrAlreadyExists: in
//     containerd 1.6 that error aborts the metadata transaction and the node
//     never records the blob. The retry finds it through Info.
//   - While another node holds the pull lock: ErrUnavailable at once; this
//     node keeps its place in the queue, and its next retry's /lock both
//     renews that place and confirms a hand-off grant.
func (s *Store) Writer(ctx context.Context, opts ...content.WriterOpt) (content.Writer, error) {
	var wo content.WriterOpts
	for _, o := range opts {
		if err := o(&wo); err != nil {
			return nil, err
		}
	}
	dgst := digestOf(wo)
	if dgst == "" {
		// Nothing to coordinate on before the data is there; the reference
		// is registered when the commit names the digest.
		w, err := s.ingest.Writer(ctx, opts...)
		if err != nil {
			return nil, err
		}
		return &writer{Writer: w, s: s}, nil
	}
	if err := dgst.Validate(); err != nil {
		return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	if s.exists(dgst) {
		return nil, fmt.Errorf("content %v exists; look it up with Info: %w", dgst, errdefs.ErrUnavailable)
	}
	req := client.Request{Type: lock.Pull, Resource: dgst.String(), Lease: lock.LeaseSession}
	cctx, cancel := s.call(ctx)
	res, err := s.c.TryLock(cctx, req)
	cancel()
	switch {
	case err != nil:
		return nil, fmt.Errorf("content %v: pull lock: %v: %w", dgst, err, errdefs.ErrUnavailable)
	case res.Skip:
		return nil, fmt.Errorf("content %v was just pulled: %w", dgst, errdefs.ErrUnavailable)
	case !res.Acquired:
		return nil, fmt.Errorf("content %v is being pulled by %s (this node is %d in line): %w", dgst, res.Holder, res.Position, errdefs.ErrUnavailable)
	}
	if s.exists(dgst) {
		// Promoted to holder of a blob another node committed meanwhile.
		s.unlock(ctx, req, res.Token, nil)
		return nil, fmt.Errorf("content %v exists; look it up with Info: %w", dgst, errdefs.ErrUnavailable)
	}
	wo.Desc.Digest = dgst
	w, err := s.ingest.Writer(ctx, content.WithRef(wo.Ref), content.WithDescriptor(wo.Desc))
	if err != nil {
		s.unlock(ctx, req, res.Token, err)
		if errdefs.IsAlreadyExists(err) {
			return nil, fmt.Errorf("content %v exists: %w", dgst, errdefs.ErrUnavailable)
		}
		return nil, err
	}
	return &writer{Writer: w, s: s, req: &req, token: res.Token}, nil
}

func (s *Store) exists(dgst digest.Digest) bool {
	_, err := os.Stat(s.blobPath(dgst))
	return err == nil
}

// writer is a local ingest writer that unlocks the blob's pull lock with
// its outcome: success on commit (the server then records this node's
// reference), failure on a failed commit or a close without one, so that
// the next node in line takes over at once.
type writer struct {
	content.Writer
	s     *Store
	req   *client.Request // nil when no lock was taken
	token uint64
	done  bool
}

func (w *writer) Commit(ctx context.Context, size int64, expected digest.Digest, opts ...content.Opt) error {
	err := w.Writer.Commit(ctx, size, expected, opts...)
	committed := err == nil || errdefs.IsAlreadyExists(err)
	dgst := w.Writer.Digest()
	if committed && expected != "" {
		dgst = expected
	}
	if w.req == nil {
		if committed {
			// No lock was taken: register the reference the unlock would have.
			if rerr := w.s.reference(ctx, dgst); rerr != nil {
				w.s.log.Warn("commit: registering the reference failed", "digest", dgst, "err", rerr)
			}
		}
		return err
	}
	if !w.done {
		w.done = true
		var opErr error
		if !committed {
			opErr = fmt.Errorf("commit: %w", err)
		}
		w.s.unlock(ctx, *w.req, w.token, opErr)
		if committed {
			w.s.remember(dgst)
		}
	}
	return err
}

func (w *writer) Close() error {
	err := w.Writer.Close()
	if w.req != nil && !w.done {
		w.done = true
		w.s.unlock(context.Background(), *w.req, w.token, errors.New("writer closed without a commit"))
	}
	return err
}
