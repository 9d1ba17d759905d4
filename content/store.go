// Package content is a containerd content store shared by several nodes and
// coordinated by dlock (docs/DESIGN.md): each blob is downloaded by one node while
// the others wait and then use it, a failed download passes to the next node
// in line, and no node's garbage collector removes a blob another node uses.
//
// Blobs live in one shared directory (ROOT/blobs, containerd's local layout).
// Each node writes in an ingest folder of its own inside the root, so
// commits are renames, made under the blob's pull lock. Every file
// operation in the root goes through an os.Root, and nothing in it is used
// through a symlink (docs/SECURITY.md). References are kept by the dlock server
// (refcount=server): a node that reads a blob references it, its garbage
// collector's Delete releases the reference, and the blob goes when none is
// left.
package content

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"sync"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/plugins/content/local"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/lock"
)

// Config configures a Store.
type Config struct {
	// Root is the shared directory: blobs in Root/blobs, labels in
	// Root/labels, deletions in progress in Root/trash.
	Root string
	// Ingest is this node's ingest folder, inside Root (so that commits
	// are renames on one filesystem, made through the root's os.Root).
	// Default Root/nodes/<node>.
	Ingest string
	// Client is this node's dlock client. Its server must run with
	// --refcount=server. Its session stream keeps this node's locks.
	Client *client.Client
	// CallTimeout bounds each call to the dlock server, one attempt each:
	// Writer and Commit run inside containerd's metadata transaction and
	// must not block there. Default 500 ms.
	CallTimeout time.Duration
	// Logger; nil discards.
	Logger *slog.Logger
}

// Store is the shared content store. It implements containerd's
// content.Store.
type Store struct {
	cfg       Config
	c         *client.Client
	log       *slog.Logger
	root      *os.Root    // the shared root: every file operation in it goes through here
	ingestRel string      // this node's ingest folder, relative to the root
	labels    *labelStore // the shared blobs' labels
	ingest    content.Store

	mu       sync.Mutex
	refs     map[digest.Digest]struct{} // blobs this node has registered a reference for
	refEpoch string                     // the server epoch refs belong to
	// pulls holds the blobs a writer of this node downloads, each closed
	// and removed when that writer ends (claim).
	pulls map[digest.Digest]chan struct{}
	open  openBlobs // blobs being read
	// lines holds, by blob, this node's place in line (joinLine).
	lines map[digest.Digest]*line

	// testHook, set by tests only, runs in held, before the check: a test
	// stops a call there, between two of its steps.
	testHook func(step string, lost <-chan struct{})

	// background retries of unlocks that failed inside containerd's calls;
	// none starts once closing is set (under mu), so that each is added to
	// wg before Close waits for it.
	ctx     context.Context
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	closing bool
}

var _ content.Store = (*Store)(nil)

// ErrNoRefCounting is a dlock server without --refcount=server: without its
// exclusion between delete, pull and reference-add, one node's garbage
// collector can remove a blob another node has just committed.
var ErrNoRefCounting = errors.New("content: the dlock server does not count references (run it with --refcount=server)")

// New opens the shared store. It refuses a root, or a folder of it, that
// is a symlink (ErrUnsafeRoot), checks that the dlock server is reachable
// and counts references, and opens this node's session stream.
func New(ctx context.Context, cfg Config) (*Store, error) {
	if cfg.Client == nil || cfg.Root == "" {
		return nil, errors.New("content: Root and Client are required")
	}
	if cfg.CallTimeout <= 0 {
		cfg.CallTimeout = 500 * time.Millisecond
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	abs, err := filepath.Abs(cfg.Root)
	if err != nil {
		return nil, err
	}
	cfg.Root = abs
	if cfg.Ingest == "" {
		cfg.Ingest = filepath.Join(abs, "nodes", cfg.Client.Node)
	}
	if cfg.Ingest, err = filepath.Abs(cfg.Ingest); err != nil {
		return nil, err
	}
	ingestRel, err := filepath.Rel(abs, cfg.Ingest)
	if err != nil || ingestRel == "." || !filepath.IsLocal(ingestRel) {
		return nil, fmt.Errorf("content: the ingest folder %s must be inside the root %s", cfg.Ingest, abs)
	}
	ingestRel = filepath.ToSlash(ingestRel)
	if err := os.MkdirAll(abs, 0o755); err != nil {
		return nil, fmt.Errorf("content: %w", err)
	}
	if err := checkRootPath(abs); err != nil {
		return nil, err
	}
	root, err := os.OpenRoot(abs)
	if err != nil {
		return nil, fmt.Errorf("content: %w", err)
	}
	ok := false
	defer func() {
		if !ok {
			root.Close()
		}
	}()
	if err := prepareRoot(root, ingestRel); err != nil {
		return nil, err
	}
	if err := probeWritable(root); err != nil {
		return nil, err
	}
	ingest, err := local.NewStore(cfg.Ingest)
	if err != nil {
		return nil, fmt.Errorf("content: %w", err)
	}
	if _, err := cfg.Client.RefCount(ctx, "sha256:0000000000000000000000000000000000000000000000000000000000000000"); err != nil {
		if errors.Is(err, client.ErrNotFound) {
			return nil, ErrNoRefCounting
		}
		return nil, fmt.Errorf("content: dlock server: %w", err)
	}
	if err := cfg.Client.Connect(ctx); err != nil {
		return nil, fmt.Errorf("content: %w", err)
	}
	s := &Store{
		cfg: cfg, c: cfg.Client, log: cfg.Logger, root: root, ingestRel: ingestRel,
		labels: &labelStore{root: root}, ingest: ingest, refs: make(map[digest.Digest]struct{}),
		pulls: make(map[digest.Digest]chan struct{}), lines: make(map[digest.Digest]*line),
		open: openBlobs{linger: time.Second, files: make(map[digest.Digest]*blobFile)},
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	ok = true
	return s, nil
}

// prepareRoot makes the root's folders and this node's ingest folders,
// each checked to be a directory and not a symlink. containerd's local
// store, which writes the ingests with plain paths, thus starts on
// folders that resolve where they seem to; its commits land in
// <ingest>/blobs, from where publish moves them through the root.
func prepareRoot(root *os.Root, ingestRel string) error {
	// Earlier versions made <ingest>/blobs a symlink to the shared blobs;
	// that one, and only that one, is replaced by a folder.
	link := path.Join(ingestRel, "blobs")
	if fi, err := root.Lstat(link); err == nil && fi.Mode()&fs.ModeSymlink != 0 {
		if target, err := root.Readlink(link); err == nil && target == filepath.Join(root.Name(), "blobs") {
			if err := root.Remove(link); err != nil {
				return fmt.Errorf("content: %w", err)
			}
		}
	}
	dirs := []string{"trash", path.Join(ingestRel, "ingest")}
	for _, alg := range algorithms {
		dirs = append(dirs, path.Join("blobs", alg.String()), path.Join("labels", alg.String()), path.Join(ingestRel, "blobs", alg.String()))
	}
	for _, d := range dirs {
		if err := mkdirs(root, d); err != nil {
			return err
		}
	}
	return nil
}

// Close stops background work. It does not close the client.
func (s *Store) Close() error {
	s.mu.Lock()
	s.closing = true
	s.mu.Unlock()
	s.cancel()
	s.wg.Wait()
	s.open.close()
	return s.root.Close()
}

func (s *Store) call(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, s.cfg.CallTimeout)
}

// reference registers this node's reference to a blob it uses, once per
// blob and server epoch.
func (s *Store) reference(ctx context.Context, dgst digest.Digest) error {
	epoch := s.c.Epoch()
	s.mu.Lock()
	if epoch != s.refEpoch {
		clear(s.refs)
		s.refEpoch = epoch
	}
	_, known := s.refs[dgst]
	s.mu.Unlock()
	if known {
		return nil
	}
	cctx, cancel := s.call(ctx)
	defer cancel()
	if _, err := s.c.AddRef(cctx, dgst.String()); err != nil {
		if errors.Is(err, client.ErrDeleting) {
			return fmt.Errorf("content %v is being deleted: %w", dgst, errdefs.ErrNotFound)
		}
		return fmt.Errorf("content %v: registering this node's reference: %v: %w", dgst, err, errdefs.ErrUnavailable)
	}
	// The caller saw the blob before the reference was added: the last
	// other reference may have been released and the blob deleted in
	// between (a waiting writer told done, then its own node's garbage
	// collector and the holder's delete before containerd commits it), and
	// the server adds a reference to a blob that is gone. Once the
	// reference is in, no delete can start, so one look now settles it.
	if !s.exists(dgst) {
		rctx, cancel := s.call(ctx)
		if _, err := s.c.ReleaseRef(rctx, dgst.String()); err != nil {
			s.log.Warn("releasing the reference to a blob deleted meanwhile failed", "digest", dgst, "err", err)
		}
		cancel()
		return fmt.Errorf("content %v was deleted meanwhile: %w", dgst, errdefs.ErrNotFound)
	}
	s.remember(dgst)
	return nil
}

func (s *Store) remember(dgst digest.Digest) {
	s.mu.Lock()
	s.refs[dgst] = struct{}{}
	s.mu.Unlock()
}

func (s *Store) forget(dgst digest.Digest) {
	s.mu.Lock()
	delete(s.refs, dgst)
	s.mu.Unlock()
}

// Info describes a shared blob and registers this node's reference to it: a
// node that finds a blob already there only calls Info before using it.
func (s *Store) Info(ctx context.Context, dgst digest.Digest) (content.Info, error) {
	info, err := s.info(dgst)
	if err != nil {
		return content.Info{}, err
	}
	if err := s.reference(ctx, dgst); err != nil {
		return content.Info{}, err
	}
	s.waitOver(dgst)
	return info, nil
}

// waitOver ends the node's line for a blob its waiting writers were told
// is done, once containerd finds the blob, and logs it.
func (s *Store) waitOver(dgst digest.Digest) {
	s.mu.Lock()
	l := s.lines[dgst]
	over := l != nil && l.writers == 0
	if over {
		delete(s.lines, dgst)
	}
	s.mu.Unlock()
	if over && l.behind {
		s.log.Debug("pull: found the blob another node pulled", "digest", dgst, "waited", time.Since(l.since).Round(time.Millisecond))
	}
}

// ReaderAt opens a shared blob and registers this node's reference to it.
func (s *Store) ReaderAt(ctx context.Context, desc ocispec.Descriptor) (content.ReaderAt, error) {
	ra, err := s.readerAt(desc.Digest)
	if err != nil {
		return nil, err
	}
	if err := s.reference(ctx, desc.Digest); err != nil {
		ra.Close()
		return nil, err
	}
	return ra, nil
}

// Walk walks every shared blob; it registers no reference (containerd's
// garbage collector walks everything).
func (s *Store) Walk(ctx context.Context, fn content.WalkFunc, filters ...string) error {
	return s.walk(ctx, fn, filters...)
}

// Status, ListStatuses and Abort see this node's ingests only.
func (s *Store) Status(ctx context.Context, ref string) (content.Status, error) {
	return s.ingest.Status(ctx, ref)
}

// ListStatuses lists this node's ingests.
func (s *Store) ListStatuses(ctx context.Context, filters ...string) ([]content.Status, error) {
	return s.ingest.ListStatuses(ctx, filters...)
}

// Abort removes one of this node's ingests.
func (s *Store) Abort(ctx context.Context, ref string) error {
	return s.ingest.Abort(ctx, ref)
}

// Delete is called by this node's garbage collector for every blob its
// metadata does not reference. It releases this node's reference and, when
// no node references the blob any more, removes it under the delete lock:
// the blob is moved to a trash name carrying the lock's token and unlinked
// only if the unlock with that token succeeds, so a delete whose lock expired
// meanwhile can never remove a blob a new pull committed. Its labels go
// with it. A hold known lost before the move or before the unlock stops
// the delete there (held), and the blob is put back. Delete returns an
// error, wrapping client.ErrLockLost, only when its hold turned out lost:
// the node is likely cut off from the lock service, and the error stops
// its collector's walk. It returns nil whenever it leaves the blob in
// place for another reason.
func (s *Store) Delete(ctx context.Context, dgst digest.Digest) error {
	if err := dgst.Validate(); err != nil {
		return fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	s.forget(dgst)
	s.open.drop(dgst)
	s.mu.Lock()
	if l := s.lines[dgst]; l != nil && l.writers == 0 {
		delete(s.lines, dgst) // told done, never found: containerd gave up
	}
	s.mu.Unlock()
	cctx, cancel := s.call(ctx)
	rc, err := s.c.ReleaseRef(cctx, dgst.String())
	cancel()
	if err != nil {
		s.log.Warn("delete: releasing the reference failed; blob kept", "digest", dgst, "err", err)
		return nil
	}
	if rc.Count > 0 {
		return nil // other nodes use it
	}
	req := client.Request{Type: lock.Delete, Resource: dgst.String(), Lease: lock.LeaseSession}
	cctx, cancel = s.call(ctx)
	res, lost, err := s.c.TryAcquire(cctx, req)
	cancel()
	if err != nil {
		return nil // in use, being pulled or deleted: the blob stays for now
	}
	if !res.Acquired {
		s.cancelWait(req)
		return nil
	}
	// The trash name carries the lock's token; every name resolves inside
	// the root, and a rename or removal acts on the name itself, never on
	// what a symlink planted there points to.
	blob := blobPath(dgst)
	trash := fmt.Sprintf("trash/%s-%s-%d", dgst.Algorithm(), dgst.Encoded(), res.Token)
	if err := s.held(req, lost, stepTrash); err != nil {
		s.unlock(ctx, req, res.Token, err)
		return err
	}
	if err := s.root.Rename(blob, trash); err != nil {
		opErr := err
		if errors.Is(err, fs.ErrNotExist) {
			opErr = nil // gone already: the delete is done
		}
		s.unlock(ctx, req, res.Token, opErr)
		return nil
	}
	if err := s.labels.move(dgst, trash+labelsSuffix); err != nil {
		s.log.Warn("delete: moving the labels into the trash failed", "digest", dgst, "err", err)
	}
	// A successful unlock is what licenses the unlink: the check before
	// the unlink comes before the unlock, after which the hold is over.
	if err := s.held(req, lost, stepUnlink); err != nil {
		s.restore(dgst, trash, err)
		s.unlock(ctx, req, res.Token, err)
		return err
	}
	cctx, cancel = s.call(ctx)
	_, err = s.c.Release(cctx, req, res.Token, nil)
	cancel()
	if err != nil {
		// Not confirmed (the lock may have expired and a pull committed the
		// blob anew): put it back unless a new copy is there already.
		s.restore(dgst, trash, err)
		if errors.Is(err, client.ErrNotHolder) || errors.Is(err, client.ErrStaleToken) {
			return fmt.Errorf("content %v: the unlock that confirms the delete was refused: %w: %w", dgst, client.ErrLockLost, err)
		}
		return nil
	}
	s.root.Remove(trash)
	s.root.Remove(trash + labelsSuffix)
	return nil
}

// labelsSuffix names the labels of a blob in the trash, beside it.
const labelsSuffix = ".labels"

// restore puts back a blob that a delete moved into the trash and must not
// unlink, with its labels, unless a new copy is in place already; the
// trashed copy goes then.
func (s *Store) restore(dgst digest.Digest, trash string, why error) {
	blob := blobPath(dgst)
	if _, err := s.root.Lstat(blob); errors.Is(err, fs.ErrNotExist) {
		if err := s.root.Rename(trash, blob); err == nil {
			if err := s.labels.restore(dgst, trash+labelsSuffix); err != nil {
				s.log.Warn("delete undone; its labels could not be put back", "digest", dgst, "err", err)
			}
			s.log.Warn("delete undone: its hold is lost or its unlock unconfirmed; blob restored", "digest", dgst, "err", why)
			return
		}
	}
	s.root.Remove(trash)
	s.root.Remove(trash + labelsSuffix)
}

// The steps taken under a lock that other nodes see, as held names them.
const (
	stepTrash   = "moving the blob into the trash"
	stepUnlink  = "unlinking the trashed blob"
	stepPublish = "moving the committed blob into the shared folder"
	stepLabels  = "changing the labels"
)

// held comes right before each step that changes the shared root under a
// lock: when this node's client knows the hold is lost (lost is closed),
// it returns an error wrapping client.ErrLockLost, and errdefs'
// ErrUnavailable for containerd, and the caller does not take the step.
func (s *Store) held(req client.Request, lost <-chan struct{}, step string) error {
	if s.testHook != nil {
		s.testHook(step, lost)
	}
	// Held is exact at this moment, where a look at lost alone is not
	// after a pause: the lease timer that closes lost may not have run.
	select {
	case <-lost:
	default:
		if s.c.Held(req) {
			return nil
		}
	}
	return fmt.Errorf("content %s: %s skipped: this node's %s lock is lost: %w: %w", req.Resource, step, req.Type, client.ErrLockLost, errdefs.ErrUnavailable)
}

// Update changes a blob's labels under the update lock, which the server
// refuses while the blob is being deleted, or, with
// --update-requires-no-ref, while it is referenced.
func (s *Store) Update(ctx context.Context, info content.Info, fieldpaths ...string) (content.Info, error) {
	req := client.Request{Type: lock.Update, Resource: info.Digest.String(), Lease: lock.LeaseSession}
	cctx, cancel := s.call(ctx)
	res, lost, err := s.c.TryAcquire(cctx, req)
	cancel()
	switch {
	case errors.Is(err, client.ErrInUse), errors.Is(err, client.ErrDeleting):
		return content.Info{}, fmt.Errorf("content %v: %v: %w", info.Digest, err, errdefs.ErrFailedPrecondition)
	case err != nil:
		return content.Info{}, fmt.Errorf("content %v: %v: %w", info.Digest, err, errdefs.ErrUnavailable)
	case !res.Acquired:
		s.cancelWait(req)
		return content.Info{}, fmt.Errorf("content %v: another node is updating it: %w", info.Digest, errdefs.ErrUnavailable)
	}
	if err := s.held(req, lost, stepLabels); err != nil {
		s.unlock(ctx, req, res.Token, err)
		return content.Info{}, err
	}
	out, err := s.updateLabels(info, fieldpaths...)
	s.unlock(ctx, req, res.Token, err)
	return out, err
}

// unlock releases a lock; if the server cannot be reached within the call
// timeout it keeps trying in the background, so that the next node is not
// held up until this node's session ends.
func (s *Store) unlock(ctx context.Context, req client.Request, token uint64, opErr error) {
	cctx, cancel := s.call(ctx)
	_, err := s.c.Release(cctx, req, token, opErr)
	cancel()
	if err == nil || !retryableUnlock(err) {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closing {
		return // retries end with the store: s.ctx has ended
	}
	s.wg.Go(func() {
		for wait := 100 * time.Millisecond; ; wait = min(2*wait, 5*time.Second) {
			select {
			case <-time.After(wait):
			case <-s.ctx.Done():
				return
			}
			cctx, cancel := s.call(s.ctx)
			_, err := s.c.Release(cctx, req, token, opErr)
			cancel()
			if err == nil || !retryableUnlock(err) {
				return
			}
		}
	})
}

func retryableUnlock(err error) bool {
	return !errors.Is(err, client.ErrNotHolder) && !errors.Is(err, client.ErrStaleToken) && !errors.Is(err, client.ErrInvalid)
}

// cancelWait leaves a queue this node must not wait in. It leaves the
// pull lock of a blob another writer of this node downloads alone: the
// server has one grant per node, and a /cancel would end it under that
// writer and pass the lock to the next node, which would download the
// blob again.
func (s *Store) cancelWait(req client.Request) {
	if req.Type == lock.Pull && s.claimed(digest.Digest(req.Resource)) != nil {
		return
	}
	cctx, cancel := s.call(s.ctx)
	defer cancel()
	if res, err := s.c.Cancel(cctx, req); err == nil && res.Released {
		s.log.Info("gave back a lock granted while leaving its queue", "key", req.Type.String()+":"+req.Resource)
	}
}

// leaveIfGone gives back whatever a /lock whose caller gave up may have won:
// the request can reach the server after the caller's context ended, and
// a session-leased grant nobody knows of would then be held for as long as
// this process lives (containerd 2.x cancels every writer of a failed pull
// at once). While the caller is still there it retries, and its retry
// finds its grant or its place in line.
func (s *Store) leaveIfGone(ctx context.Context, req client.Request) {
	if ctx.Err() != nil {
		s.cancelWait(req)
	}
}

// refDigest finds the digest at the end of a writer ref, as containerd's
// remotes make them (layer-sha256:<hex>, name@sha256:<hex>).
var refDigest = regexp.MustCompile(`(sha256:[a-f0-9]{64}|sha384:[a-f0-9]{96}|sha512:[a-f0-9]{128})$`)

func digestOf(opts content.WriterOpts) digest.Digest {
	if opts.Desc.Digest != "" {
		return opts.Desc.Digest
	}
	if m := refDigest.FindString(opts.Ref); m != "" {
		if d, err := digest.Parse(m); err == nil {
			return d
		}
	}
	return ""
}
