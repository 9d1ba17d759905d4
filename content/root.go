package content

import (
	"crypto/rand"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/opencontainers/go-digest"
)

// Every file operation in the shared root goes through one os.Root, so no
// name, however planted (a symlink for labels/, trash/ or a blob), resolves
// outside the root (docs/SECURITY.md). Within it, a blob or a label file is
// used only when it is a regular file itself, never through a symlink:
// another node, or anyone who can write the shared directory, could plant
// one pointing at a file it wants served as a blob.

// ErrUnsafeRoot is a shared root, or one of its folders, that is a symlink
// (or not a directory): the store refuses to start on it.
var ErrUnsafeRoot = errors.New("content: unsafe shared root")

// errNotRegular is a name in the root that is not a regular file (a
// symlink, a directory): it is not a blob.
var errNotRegular = errors.New("not a regular file")

// algorithms are the digest algorithms whose folders are made at start, so
// that no commit has to create one.
var algorithms = []digest.Algorithm{digest.SHA256, digest.SHA384, digest.SHA512}

// checkRootPath refuses a root whose own name is a symlink. Symlinks above
// it are the administrator's business (a mount point reached through one).
func checkRootPath(root string) error {
	fi, err := os.Lstat(root)
	if err != nil {
		return fmt.Errorf("content: root: %w", err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("%w: %s is a %s, not a directory", ErrUnsafeRoot, root, kind(fi))
	}
	return nil
}

// mkdirs makes the folder rel of root and each folder above it, and checks
// that each is a directory itself, not a symlink to one.
func mkdirs(root *os.Root, rel string) error {
	cur := ""
	for part := range strings.SplitSeq(filepath.ToSlash(rel), "/") {
		if part == "" || part == "." {
			continue
		}
		cur = path.Join(cur, part)
		if err := root.Mkdir(cur, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("content: %w", err)
		}
		fi, err := root.Lstat(cur)
		if err != nil {
			return fmt.Errorf("content: %w", err)
		}
		if !fi.IsDir() {
			return fmt.Errorf("%w: %s is a %s, not a directory", ErrUnsafeRoot, filepath.Join(root.Name(), cur), kind(fi))
		}
	}
	return nil
}

func kind(fi fs.FileInfo) string {
	switch {
	case fi.Mode()&fs.ModeSymlink != 0:
		return "symlink"
	case fi.IsDir():
		return "directory"
	case fi.Mode().IsRegular():
		return "file"
	default:
		return "special file"
	}
}

// lstatRegular describes name if it is a regular file itself; a symlink,
// a folder or anything else there is errNotRegular.
func lstatRegular(root *os.Root, name string) (fs.FileInfo, error) {
	fi, err := root.Lstat(name)
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s: %w (a %s)", name, errNotRegular, kind(fi))
	}
	return fi, nil
}

// openRegular opens name for reading if it is a regular file, not a
// symlink. os.Root would follow a symlink that stays inside the root, so
// the opened file is checked to be the one that was looked at.
func openRegular(root *os.Root, name string) (*os.File, fs.FileInfo, error) {
	before, err := lstatRegular(root, name)
	if err != nil {
		return nil, nil, err
	}
	f, err := root.Open(name)
	if err != nil {
		return nil, nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	if !fi.Mode().IsRegular() || !os.SameFile(before, fi) {
		f.Close()
		return nil, nil, fmt.Errorf("%s: %w (replaced while opened)", name, errNotRegular)
	}
	return f, fi, nil
}

// writeFileAtomic replaces name by a file holding data: written under a
// temporary name in the same folder, then renamed over name.
func writeFileAtomic(root *os.Root, name string, data []byte) error {
	tmp := path.Join(path.Dir(name), ".tmp-"+rand.Text())
	f, err := root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = root.Rename(tmp, name)
	}
	if err != nil {
		root.Remove(tmp)
	}
	return err
}

// probeWritable checks that the root can be written, so that a read-only
// mount fails at start rather than at the first pull.
func probeWritable(root *os.Root) error {
	name := ".probe-" + rand.Text()
	f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("content: root %s is not writable: %w", root.Name(), err)
	}
	f.Close()
	return root.Remove(name)
}
