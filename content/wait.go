package content

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"

	"github.com/dlock/dlock/client"
)

// waitWriter is the writer containerd gets for a blob another node is
// pulling (docs/CONTAINERD.md, "How a node waits"). Writer returns it at
// once, in line for the blob's pull lock; its Status waits, outside
// containerd's metadata transaction, until the line moves:
//
//   - the holder committed the blob: Status says the write is complete,
//     containerd commits, and the commit (or the Info containerd's content
//     service makes first) finds the blob and registers this node's
//     reference. The node moves on the moment the server tells it, where
//     an ErrUnavailable would have it come back after containerd's
//     back-off, which grows to 2 s between retries.
//   - the holder failed and the lock passed to this node: the writer
//     becomes an ordinary writer with an empty ingest, and containerd
//     downloads the blob.
//
// Nothing reaches the registry before Status has answered, since
// containerd's fetch looks at the writer's status before it asks.
type waitWriter struct {
	s    *Store
	ctx  context.Context // the Writer call's: containerd's, which ends when it gives up
	req  client.Request
	dgst digest.Digest
	opts content.WriterOpts
	// quick counts the Status calls still to answer without waiting: one
	// when the store is reached through containerd's content service,
	// whose first Status answers the proxy's negotiation inside the
	// daemon's metadata transaction (Store.Proxied).
	quick   int
	started time.Time

	w       *writer // once the lock passed to this node
	done    bool    // the blob is there: another node committed it
	size    int64   // its size, once done
	updated time.Time
	closed  bool
	// inLine: counted among the node's writers in line for the blob
	// (Store.joinLine), until it resolves or closes.
	inLine bool
}

// leave takes the writer out of the node's line (leaveLine).
func (w *waitWriter) leave(found, giveUp bool) {
	if w.inLine {
		w.inLine = false
		w.s.leaveLine(w.req, found, giveUp)
	}
}

// errWaitEnded ends a wait whose writer was closed or whose store stopped.
var errWaitEnded = errors.New("the wait for another node's pull ended")

func (w *waitWriter) pending() bool { return w.w == nil && !w.done }

// wait waits in line until the blob is there or the lock is this node's.
// A server that cannot be reached is asked again, with a growing pause,
// as containerd would have retried the writer: only containerd giving up
// (its context) or the store closing ends the wait with an error.
func (w *waitWriter) wait() error {
	if w.closed {
		return fmt.Errorf("content %v: writer closed: %w", w.dgst, errdefs.ErrFailedPrecondition)
	}
	ctx, cancel := context.WithCancelCause(w.ctx)
	defer cancel(nil)
	stop := context.AfterFunc(w.s.ctx, func() { cancel(errWaitEnded) })
	defer stop()
	for pause := 100 * time.Millisecond; ; {
		if mine := w.s.claimed(w.dgst); mine != nil {
			// Another writer of this node downloads the blob.
			select {
			case <-mine:
			case <-ctx.Done():
				// Not on to Acquire: with its context ended, it would
				// cancel, and a /cancel gives up the grant this node's
				// downloading writer works under (one per node).
				return fmt.Errorf("content %v: waiting for this node's own pull: %w: %w", w.dgst, context.Cause(ctx), errdefs.ErrUnavailable)
			}
			if w.s.exists(w.dgst) {
				return w.found()
			}
		}
		// Await, not Acquire: the node's place in line is shared by its
		// writers of the blob, and the last to leave ends it (leaveLine).
		res, lost, err := w.s.c.Await(ctx, w.req)
		switch {
		case ctx.Err() != nil:
			return fmt.Errorf("content %v: waiting for another node's pull: %w: %w", w.dgst, context.Cause(ctx), errdefs.ErrUnavailable)
		case err != nil:
			w.s.log.Warn("pull: waiting for another node's pull: the lock service failed; asking again", "digest", w.dgst, "err", err, "pause", pause)
			select {
			case <-time.After(pause):
			case <-ctx.Done():
			}
			pause = min(2*pause, 2*time.Second)
		case res.Acquired:
			iw, found, busy, err := w.s.take(ctx, w.req, w.dgst, w.opts, res.Token, lost)
			switch {
			case busy:
				continue // wait for this node's own writer
			case found:
				return w.found()
			case err != nil:
				return err
			}
			w.s.log.Debug("pull: handed over", "digest", w.dgst, "token", res.Token)
			w.w = iw
			w.leave(false, false)
			return nil
		case res.Skip:
			if w.s.exists(w.dgst) {
				return w.found()
			}
			// Done, yet not in the shared folder (deleted since): the
			// next /lock finds the key free and takes it.
		}
	}
}

// found records that the blob another node pulled is there.
func (w *waitWriter) found() error {
	info, err := w.s.info(w.dgst)
	if err != nil {
		return err
	}
	w.done, w.size, w.updated = true, info.Size, time.Now()
	w.leave(true, false)
	w.s.log.Debug("pull: told done", "digest", w.dgst, "waited", time.Since(w.started).Round(time.Millisecond))
	return nil
}

func (w *waitWriter) settle() error {
	if w.pending() {
		return w.wait()
	}
	return nil
}

func (w *waitWriter) Status() (content.Status, error) {
	if w.pending() && w.quick > 0 {
		w.quick--
		return content.Status{Ref: w.opts.Ref, Total: w.opts.Desc.Size, StartedAt: w.started, UpdatedAt: w.started}, nil
	}
	if err := w.settle(); err != nil {
		return content.Status{}, err
	}
	if w.w != nil {
		return w.w.Status()
	}
	return content.Status{Ref: w.opts.Ref, Offset: w.size, Total: w.size, StartedAt: w.started, UpdatedAt: w.updated}, nil
}

func (w *waitWriter) Digest() digest.Digest {
	if w.w != nil {
		return w.w.Digest()
	}
	return w.dgst
}

func (w *waitWriter) Write(p []byte) (int, error) {
	if err := w.settle(); err != nil {
		return 0, err
	}
	if w.w == nil {
		return 0, fmt.Errorf("content %v was committed by another node: %w", w.dgst, errdefs.ErrFailedPrecondition)
	}
	return w.w.Write(p)
}

func (w *waitWriter) Truncate(size int64) error {
	if err := w.settle(); err != nil {
		return err
	}
	if w.w == nil {
		return fmt.Errorf("content %v was committed by another node: %w", w.dgst, errdefs.ErrFailedPrecondition)
	}
	return w.w.Truncate(size)
}

// Commit of a blob another node committed checks what containerd expects
// and registers this node's reference, as Info does.
func (w *waitWriter) Commit(ctx context.Context, size int64, expected digest.Digest, opts ...content.Opt) error {
	if err := w.settle(); err != nil {
		return err
	}
	if w.w != nil {
		return w.w.Commit(ctx, size, expected, opts...)
	}
	switch {
	case expected != "" && expected != w.dgst:
		return fmt.Errorf("commit of %v into a writer for %v: %w", expected, w.dgst, errdefs.ErrFailedPrecondition)
	case size != 0 && size != w.size:
		return fmt.Errorf("content %v: commit of %d bytes, the blob has %d: %w", w.dgst, size, w.size, errdefs.ErrFailedPrecondition)
	}
	if err := w.s.reference(ctx, w.dgst); err != nil {
		return err
	}
	w.s.waitOver(w.dgst)
	return nil
}

// Close of a writer still in line leaves the line; the node leaves it with
// its last writer there.
func (w *waitWriter) Close() error {
	if w.w != nil {
		return w.w.Close()
	}
	w.leave(false, !w.done)
	w.closed = true
	return nil
}

// Proxied is the store as containerd reaches it through its content proxy
// plugin, over containerd's content gRPC service (dlock-content): there,
// a writer's first Status answers the proxy's negotiation, which the
// daemon makes inside its metadata transaction, where no call may wait.
// A writer waiting for another node's pull answers that one at once and
// waits on the next, which containerd's fetch makes before it downloads.
func (s *Store) Proxied() content.Store { return proxied{s} }

type proxied struct{ *Store }

func (p proxied) Writer(ctx context.Context, opts ...content.WriterOpt) (content.Writer, error) {
	return p.writer(ctx, 1, opts...)
}
