package content

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"strings"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/pkg/filters"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"

	"github.com/dlock/dlock/client"
)

// The shared blobs, in containerd's local layout (blobs/<alg>/<hex>), read
// and written through the store's os.Root only. containerd's local store,
// which would do the same with plain paths, is used for this node's
// ingests only, inside a folder checked at start.

func blobPath(d digest.Digest) string {
	return path.Join("blobs", d.Algorithm().String(), d.Encoded())
}

// blobStat describes a shared blob: a regular file at its name. Anything
// else there (a planted symlink) is no blob: ErrNotFound.
func (s *Store) blobStat(d digest.Digest) (fs.FileInfo, error) {
	if err := d.Validate(); err != nil {
		return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	fi, err := lstatRegular(s.root, blobPath(d))
	switch {
	case errors.Is(err, errNotRegular):
		s.log.Warn("not a blob: ignored", "digest", d, "err", err)
		return nil, fmt.Errorf("content %v: %v: %w", d, err, errdefs.ErrNotFound)
	case errors.Is(err, fs.ErrNotExist):
		return nil, fmt.Errorf("content %v: %w", d, errdefs.ErrNotFound)
	}
	return fi, err
}

func (s *Store) exists(d digest.Digest) bool {
	_, err := s.blobStat(d)
	return err == nil
}

func (s *Store) blobInfo(d digest.Digest, fi fs.FileInfo) (content.Info, error) {
	labels, err := s.labels.Get(d)
	if err != nil {
		return content.Info{}, err
	}
	return content.Info{Digest: d, Size: fi.Size(), CreatedAt: fi.ModTime(), UpdatedAt: atime(fi), Labels: labels}, nil
}

func (s *Store) info(d digest.Digest) (content.Info, error) {
	fi, err := s.blobStat(d)
	if err != nil {
		return content.Info{}, err
	}
	return s.blobInfo(d, fi)
}

// readerAt opens a shared blob, never through a symlink, or shares the
// file its other readers have open (openBlobs).
func (s *Store) readerAt(d digest.Digest) (content.ReaderAt, error) {
	if err := d.Validate(); err != nil {
		return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	return s.open.get(d, func() (*os.File, int64, error) {
		f, fi, err := openRegular(s.root, blobPath(d))
		switch {
		case errors.Is(err, errNotRegular):
			s.log.Warn("not a blob: not served", "digest", d, "err", err)
			return nil, 0, fmt.Errorf("content %v: %v: %w", d, err, errdefs.ErrNotFound)
		case errors.Is(err, fs.ErrNotExist):
			return nil, 0, fmt.Errorf("content %v: %w", d, errdefs.ErrNotFound)
		case err != nil:
			return nil, 0, err
		}
		return f, fi.Size(), nil
	})
}

// walk calls fn for every shared blob that matches the filters. Names that
// are not regular files are skipped, like names that are not digests.
func (s *Store) walk(ctx context.Context, fn content.WalkFunc, filterArgs ...string) error {
	filter, err := filters.ParseAll(filterArgs...)
	if err != nil {
		return fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	for _, alg := range algorithms {
		dir, err := s.root.Open(path.Join("blobs", alg.String()))
		if err != nil {
			return err
		}
		entries, err := dir.ReadDir(-1)
		dir.Close()
		if err != nil {
			return err
		}
		for _, e := range entries {
			if err := ctx.Err(); err != nil {
				return err
			}
			d := digest.NewDigestFromEncoded(alg, e.Name())
			if !e.Type().IsRegular() || d.Validate() != nil {
				continue
			}
			fi, err := e.Info()
			if errors.Is(err, os.ErrNotExist) {
				continue // deleted meanwhile
			}
			if err != nil {
				return err
			}
			if !fi.Mode().IsRegular() {
				continue
			}
			info, err := s.blobInfo(d, fi)
			if err != nil {
				return err
			}
			if !filter.Match(content.AdaptInfo(info)) {
				continue
			}
			if err := fn(info); err != nil {
				return err
			}
		}
	}
	return nil
}

// updateLabels changes a blob's labels as containerd's local store does:
// fieldpaths "labels" (all) or "labels.<key>"; none means all. The update
// time is kept in the blob's access time.
func (s *Store) updateLabels(info content.Info, fieldpaths ...string) (content.Info, error) {
	if _, err := s.blobStat(info.Digest); err != nil {
		return content.Info{}, err
	}
	all := len(fieldpaths) == 0
	var labels map[string]string
	for _, p := range fieldpaths {
		switch {
		case p == "labels":
			all = true
		case strings.HasPrefix(p, "labels."):
			if labels == nil {
				labels = map[string]string{}
			}
			key := strings.TrimPrefix(p, "labels.")
			labels[key] = info.Labels[key]
		default:
			return content.Info{}, fmt.Errorf("cannot update %q field on content info %q: %w", p, info.Digest, errdefs.ErrInvalidArgument)
		}
	}
	var err error
	if all {
		labels = info.Labels
		err = s.labels.Set(info.Digest, labels)
	} else {
		labels, err = s.labels.Update(info.Digest, labels)
	}
	if err != nil {
		return content.Info{}, err
	}
	fi, err := s.blobStat(info.Digest)
	if err != nil {
		return content.Info{}, err
	}
	now := time.Now()
	// os.Root's Chtimes changes a symlink itself, never its target.
	if err := s.root.Chtimes(blobPath(info.Digest), now, fi.ModTime()); err != nil {
		s.log.Warn("update: could not record the update time", "digest", info.Digest, "err", err)
	}
	out := content.Info{Digest: info.Digest, Size: fi.Size(), CreatedAt: fi.ModTime(), UpdatedAt: now, Labels: labels}
	return out, nil
}

// publish moves a blob this node committed into its ingest folder
// (<ingest>/blobs/<alg>/<hex>) into the shared blobs. The caller holds the
// blob's pull lock, req, whose lost channel is lost. A blob already there
// stays, and the copy goes: committed reports that the shared blob exists
// either way. A hold known lost before the move leaves the copy in this
// node's ingest folder, which the next writer of the digest here clears
// (dropLeftover).
func (s *Store) publish(d digest.Digest, req client.Request, lost <-chan struct{}) (committed bool, err error) {
	src := path.Join(s.ingestRel, blobPath(d))
	if _, err := lstatRegular(s.root, src); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return s.exists(d), nil
		}
		return false, err
	}
	if s.exists(d) {
		s.root.Remove(src)
		return true, nil
	}
	if err := s.held(req, lost, stepPublish); err != nil {
		return false, err
	}
	// A rename replaces whatever name is at the target (a planted symlink
	// included) without following it.
	if err := s.root.Rename(src, blobPath(d)); err != nil {
		return false, fmt.Errorf("content %v: moving the blob into the shared folder: %w", d, err)
	}
	return true, nil
}

// dropLeftover removes a copy of d left in this node's ingest folder by a
// commit whose move into the shared folder did not happen (a crash); the
// caller holds the pull lock and writes the blob anew.
func (s *Store) dropLeftover(d digest.Digest) {
	if err := s.root.Remove(path.Join(s.ingestRel, blobPath(d))); err != nil && !errors.Is(err, fs.ErrNotExist) {
		s.log.Warn("could not remove a leftover commit", "digest", d, "err", err)
	}
}
