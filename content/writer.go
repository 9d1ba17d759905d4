package content

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/lock"
)

// Writer opens a writer for one blob: an ordinary writer for the node that
// holds the blob's pull lock, a waiting one for the nodes in line behind
// it. It never blocks: containerd calls it inside its metadata
// transaction, and retries ErrUnavailable with back-off.
//
//   - The digest comes from the descriptor or, as containerd strips it, from
//     the ref's suffix (layer-sha256:<hex>).
//   - A blob that exists answers ErrUnavailable, not ErrAlreadyExists: in
//     containerd 1.6 that error aborts the metadata transaction and the node
//     never records the blob. The retry finds it through Info.
//   - While another node holds the pull lock: a waitWriter, in line, whose
//     Status waits until the blob is there or the lock passes to this node.
//   - A ref without a digest gets a writer without a lock; its Commit takes
//     the pull lock of the digest the data turned out to have before the
//     blob enters the shared folder, and fails when it cannot.
func (s *Store) Writer(ctx context.Context, opts ...content.WriterOpt) (content.Writer, error) {
	return s.writer(ctx, 0, opts...)
}

// writer is Writer; quick is the number of Status calls a waitWriter
// answers without waiting (Proxied).
func (s *Store) writer(ctx context.Context, quick int, opts ...content.WriterOpt) (content.Writer, error) {
	var wo content.WriterOpts
	for _, o := range opts {
		if err := o(&wo); err != nil {
			return nil, err
		}
	}
	dgst := digestOf(wo)
	if dgst == "" {
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
	res, lost, err := s.c.TryAcquire(cctx, req)
	cancel()
	switch {
	case err != nil:
		s.leaveIfGone(ctx, req)
		return nil, fmt.Errorf("content %v: pull lock: %v: %w", dgst, err, errdefs.ErrUnavailable)
	case res.Skip:
		return nil, fmt.Errorf("content %v was just pulled: %w", dgst, errdefs.ErrUnavailable)
	case !res.Acquired:
		return s.inLine(ctx, req, dgst, wo, quick, res), nil
	}
	w, found, busy, err := s.take(ctx, req, dgst, wo, res.Token, lost)
	switch {
	case busy:
		return s.inLine(ctx, req, dgst, wo, quick, res), nil
	case found:
		return nil, fmt.Errorf("content %v exists; look it up with Info: %w", dgst, errdefs.ErrUnavailable)
	case err != nil:
		if errdefs.IsAlreadyExists(err) {
			return nil, fmt.Errorf("content %v exists: %w", dgst, errdefs.ErrUnavailable)
		}
		return nil, err
	}
	s.log.Debug("pull: downloading", "digest", dgst, "token", res.Token)
	return w, nil
}

// inLine makes the waiting writer of a blob whose line this node is in;
// res is the answer that put it there.
func (s *Store) inLine(ctx context.Context, req client.Request, dgst digest.Digest, wo content.WriterOpts, quick int, res api.LockResponse) *waitWriter {
	s.joinLine(dgst, res)
	return &waitWriter{s: s, ctx: ctx, req: req, dgst: dgst, opts: wo, quick: quick, started: time.Now(), inLine: true}
}

// line is this node's place in line for a blob. The server has one place
// per node, which all the node's waiting writers of the blob share: the
// last to leave unresolved takes the node out (leaveLine), and one writer
// that containerd gives up on leaves the others their place. Once they are
// told the blob is done, the line stays until containerd finds the blob
// (waitOver), for the pull log (docs/CONTAINERD.md, "The pull log").
type line struct {
	writers int
	since   time.Time // when the node joined it
	behind  bool      // another node's pull, not this node's own writer
}

// joinLine counts a writer of this node in the blob's line, and logs the
// start of the node's wait behind another node (res names the holder; a
// wait for this node's own writer is not logged).
func (s *Store) joinLine(dgst digest.Digest, res api.LockResponse) {
	s.mu.Lock()
	l := s.lines[dgst]
	if l == nil {
		l = &line{since: time.Now()}
		s.lines[dgst] = l
	}
	l.writers++
	logged := !l.behind && !res.Acquired
	l.behind = l.behind || !res.Acquired
	s.mu.Unlock()
	if logged {
		s.log.Debug("pull: waiting for another node", "digest", dgst, "holder", res.Holder, "position", res.Position)
	}
}

// leaveLine takes a writer out of the blob's line: told done (found), its
// line stays for waitOver; given up by its last writer (giveUp), the node
// leaves the server's line too.
func (s *Store) leaveLine(req client.Request, found, giveUp bool) {
	dgst := digest.Digest(req.Resource)
	s.mu.Lock()
	l := s.lines[dgst]
	last := false
	if l != nil {
		l.writers--
		last = l.writers <= 0
		if last && !found {
			delete(s.lines, dgst)
		}
	}
	s.mu.Unlock()
	if last && giveUp {
		s.cancelWait(req)
	}
}

// take makes the writer of a blob whose pull lock this node was granted
// (token). One grant serves every writer of the node, so two of its
// pulls that want one blob would both be told "acquired": the first
// claims the blob, and busy tells the second to wait for it. found says
// that the blob is there already: promoted to holder of a blob another
// node committed meanwhile, take has unlocked with success.
func (s *Store) take(ctx context.Context, req client.Request, dgst digest.Digest, wo content.WriterOpts, token uint64, lost <-chan struct{}) (w *writer, found, busy bool, err error) {
	if !s.claim(dgst) {
		return nil, false, true, nil
	}
	if s.exists(dgst) {
		s.unlock(ctx, req, token, nil)
		s.unclaim(dgst)
		return nil, true, false, nil
	}
	s.dropLeftover(dgst)
	wo.Desc.Digest = dgst
	iw, err := s.ingest.Writer(ctx, content.WithRef(wo.Ref), content.WithDescriptor(wo.Desc))
	if err != nil {
		s.unlock(ctx, req, token, err)
		s.unclaim(dgst)
		return nil, false, false, err
	}
	return &writer{Writer: iw, s: s, dgst: dgst, req: &req, token: token, lost: lost, claimed: true}, false, false, nil
}

// claim marks a blob as written by one writer of this node, until unclaim.
func (s *Store) claim(dgst digest.Digest) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, taken := s.pulls[dgst]; taken {
		return false
	}
	s.pulls[dgst] = make(chan struct{})
	return true
}

func (s *Store) unclaim(dgst digest.Digest) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ch, ok := s.pulls[dgst]; ok {
		close(ch)
		delete(s.pulls, dgst)
	}
}

// claimed is closed when the writer of this node that claimed the blob
// ends; nil when none has.
func (s *Store) claimed(dgst digest.Digest) <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pulls[dgst]
}

// writer is a local ingest writer that commits into this node's ingest
// folder and then, holding the blob's pull lock, moves the blob into the
// shared folder. It unlocks with the outcome: success on commit (the
// server then records this node's reference), failure on a failed commit
// or a close without one, so that the next node in line takes over at once.
type writer struct {
	content.Writer
	s     *Store
	dgst  digest.Digest   // the digest locked; "" until a lock is taken
	req   *client.Request // nil until a lock is taken
	token uint64
	lost  <-chan struct{} // the hold's, closed once it is known lost
	done  bool
	// claimed: this writer claimed its blob in the store (take), until
	// it ends.
	claimed bool
}

func (w *writer) Commit(ctx context.Context, size int64, expected digest.Digest, opts ...content.Opt) error {
	if w.done {
		return fmt.Errorf("writer already committed or closed: %w", errdefs.ErrFailedPrecondition)
	}
	if w.req == nil {
		if err := w.lockForCommit(ctx, expected); err != nil {
			return err
		}
	}
	if expected == "" {
		expected = w.dgst // the local store checks the data against it
	}
	var err error
	if expected != w.dgst {
		err = fmt.Errorf("commit of %v into a writer for %v: %w", expected, w.dgst, errdefs.ErrFailedPrecondition)
	} else {
		err = w.Writer.Commit(ctx, size, expected, opts...)
	}
	committed := false
	if err == nil || errdefs.IsAlreadyExists(err) {
		var perr error
		committed, perr = w.s.publish(w.dgst, *w.req, w.lost)
		if perr != nil {
			err = perr
		} else if !committed && err == nil {
			err = fmt.Errorf("content %v: the committed blob is gone: %w", w.dgst, errdefs.ErrAborted)
		}
	}
	w.done = true
	var opErr error
	if !committed {
		opErr = fmt.Errorf("commit: %w", err)
	}
	if committed {
		w.s.log.Debug("pull: published", "digest", w.dgst)
	}
	w.s.unlock(ctx, *w.req, w.token, opErr)
	if committed {
		w.s.remember(w.dgst)
		w.s.log.Debug("pull: unlock sent", "digest", w.dgst)
	}
	w.unclaim()
	return err
}

// lockForCommit takes the pull lock for a writer opened without a digest,
// before its blob can reach the shared folder: without it, nothing would
// keep a concurrent delete of the same digest from removing the blob just
// committed. It never waits (Commit runs inside containerd's metadata
// transaction): a lock held by another node fails the commit with
// ErrUnavailable, and this node leaves the queue. A blob already there
// ends the write with ErrAlreadyExists, as containerd's local store does.
func (w *writer) lockForCommit(ctx context.Context, expected digest.Digest) error {
	dgst := expected
	if dgst == "" {
		dgst = w.Writer.Digest()
	}
	if err := dgst.Validate(); err != nil {
		return fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	if w.s.exists(dgst) {
		return w.alreadyThere(ctx, dgst)
	}
	req := client.Request{Type: lock.Pull, Resource: dgst.String(), Lease: lock.LeaseSession}
	cctx, cancel := w.s.call(ctx)
	res, lost, err := w.s.c.TryAcquire(cctx, req)
	cancel()
	switch {
	case err != nil:
		w.s.leaveIfGone(ctx, req)
		return fmt.Errorf("content %v: pull lock for the commit: %v: %w", dgst, err, errdefs.ErrUnavailable)
	case res.Skip:
		if w.s.exists(dgst) {
			return w.alreadyThere(ctx, dgst)
		}
		return fmt.Errorf("content %v was just pulled: %w", dgst, errdefs.ErrUnavailable)
	case !res.Acquired:
		w.s.cancelWait(req)
		return fmt.Errorf("content %v is being pulled, deleted or updated by %s: %w", dgst, res.Holder, errdefs.ErrUnavailable)
	}
	if !w.s.claim(dgst) {
		return fmt.Errorf("content %v is being written by another writer of this node: %w", dgst, errdefs.ErrUnavailable)
	}
	if w.s.exists(dgst) {
		w.s.unlock(ctx, req, res.Token, nil)
		w.s.unclaim(dgst)
		return w.alreadyThere(ctx, dgst)
	}
	w.s.dropLeftover(dgst)
	w.dgst, w.req, w.token, w.lost, w.claimed = dgst, &req, res.Token, lost, true
	return nil
}

// alreadyThere ends a write whose blob another node committed: the ingest
// goes, this node references the blob, and the answer is ErrAlreadyExists,
// which containerd's copy takes as success.
func (w *writer) alreadyThere(ctx context.Context, dgst digest.Digest) error {
	w.done = true
	ref := ""
	if st, err := w.Writer.Status(); err == nil {
		ref = st.Ref
	}
	w.Writer.Close()
	if ref != "" {
		if err := w.s.ingest.Abort(ctx, ref); err != nil && !errdefs.IsNotFound(err) {
			w.s.log.Warn("commit: removing the ingest failed", "ref", ref, "err", err)
		}
	}
	if err := w.s.reference(ctx, dgst); err != nil {
		w.s.log.Warn("commit: registering the reference failed", "digest", dgst, "err", err)
	}
	return fmt.Errorf("content %v: %w", dgst, errdefs.ErrAlreadyExists)
}

func (w *writer) Close() error {
	err := w.Writer.Close()
	if w.req != nil && !w.done {
		w.done = true
		w.s.unlock(context.Background(), *w.req, w.token, errors.New("writer closed without a commit"))
	}
	w.unclaim()
	return err
}

func (w *writer) unclaim() {
	if w.claimed {
		w.claimed = false
		w.s.unclaim(w.dgst)
	}
}
