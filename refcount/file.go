package refcount

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Options configure the file and bbolt storages.
type Options struct {
	// AllowNetworkFS opens a path on NFS, CIFS/SMB, FUSE and the like
	// anyway. flock and mmap give no protection across machines there: use
	// it only when one machine alone uses the file.
	AllowNetworkFS bool
}

// File is a Storage in one JSON file, shared safely by the processes of one
// machine: every operation holds an flock on PATH.lock, and every write
// replaces the file atomically (temporary file, fsync, rename).
type File struct {
	path string
	lock string
}

var _ Storage = (*File)(nil)

// OpenFile returns a File storage at path, creating its directory. It
// refuses a path on a network filesystem unless opts.AllowNetworkFS.
func OpenFile(path string, opts Options) (*File, error) {
	if err := prepareDir(path, opts); err != nil {
		return nil, err
	}
	f := &File{path: path, lock: path + ".lock"}
	// Fail now, not at the first update, on a file that cannot be read.
	if err := f.with(unix.LOCK_SH, func(map[string]Ref) (bool, error) { return false, nil }); err != nil {
		return nil, err
	}
	return f, nil
}

// with runs fn on the file's contents under an flock of the given kind and,
// if fn reports a change, writes them back before the lock is released.
func (f *File) with(how int, fn func(map[string]Ref) (bool, error)) error {
	lf, err := os.OpenFile(f.lock, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("refcount: %w", err)
	}
	defer lf.Close()
	for {
		err = unix.Flock(int(lf.Fd()), how)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		return fmt.Errorf("refcount: locking %s: %w", f.lock, err)
	}
	defer unix.Flock(int(lf.Fd()), unix.LOCK_UN)
	refs, err := f.read()
	if err != nil {
		return err
	}
	changed, err := fn(refs)
	if err != nil || !changed {
		return err
	}
	return f.write(refs)
}

func (f *File) read() (map[string]Ref, error) {
	data, err := os.ReadFile(f.path)
	if errors.Is(err, os.ErrNotExist) {
		return make(map[string]Ref), nil
	}
	if err != nil {
		return nil, fmt.Errorf("refcount: %w", err)
	}
	var doc struct {
		Refs map[string]Ref `json:"refs"`
	}
	if err := json.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("%w: %s: %v (move it aside only once you know which nodes use which blobs)", ErrCorrupt, f.path, err)
	}
	if doc.Refs == nil {
		doc.Refs = make(map[string]Ref)
	}
	return doc.Refs, nil
}

func (f *File) write(refs map[string]Ref) error {
	data, err := json.Marshal(struct {
		Refs map[string]Ref `json:"refs"`
	}{refs})
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(f.path), filepath.Base(f.path)+".tmp*")
	if err != nil {
		return fmt.Errorf("refcount: %w", err)
	}
	defer os.Remove(tmp.Name()) // a no-op after the rename
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return fmt.Errorf("refcount: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("refcount: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("refcount: %w", err)
	}
	if err := os.Rename(tmp.Name(), f.path); err != nil {
		return fmt.Errorf("refcount: %w", err)
	}
	return nil
}

func (f *File) Get(resource string) (Ref, error) {
	var ref Ref
	err := f.with(unix.LOCK_SH, func(refs map[string]Ref) (bool, error) {
		ref = refs[resource]
		return false, nil
	})
	return ref, err
}

func (f *File) Set(resource string, ref Ref) error {
	return f.with(unix.LOCK_EX, func(refs map[string]Ref) (bool, error) {
		if ref.Count() == 0 {
			delete(refs, resource)
		} else {
			refs[resource] = normalized(ref)
		}
		return true, nil
	})
}

func (f *File) Delete(resource string) error {
	return f.with(unix.LOCK_EX, func(refs map[string]Ref) (bool, error) {
		_, ok := refs[resource]
		delete(refs, resource)
		return ok, nil
	})
}

func (f *File) Update(resource string, fn func(*Ref) error) error {
	return f.with(unix.LOCK_EX, func(refs map[string]Ref) (bool, error) {
		r := refs[resource]
		if err := fn(&r); err != nil {
			return false, err
		}
		if r.Count() == 0 {
			delete(refs, resource)
		} else {
			refs[resource] = normalized(r)
		}
		return true, nil
	})
}

// Filesystem magic numbers (statfs(2)) on which flock and mmap do not
// protect a file across machines.
var networkFS = map[int64]string{
	0x6969:     "NFS",
	0x517b:     "SMB",
	0xff534d42: "CIFS",
	0xfe534d42: "SMB2",
	0x65735546: "FUSE",
	0x00c36400: "Ceph",
	0x5346414f: "AFS",
	0x01021997: "9P",
	0x0bd00bd0: "Lustre",
	0x47504653: "GPFS",
	0x013111a8: "IBRIX",
	0x6b414653: "kAFS",
}

// prepareDir creates path's directory and refuses a network filesystem
// unless opts allows it.
func prepareDir(path string, opts Options) error {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return fmt.Errorf("refcount: %w", err)
	}
	if opts.AllowNetworkFS {
		return nil
	}
	return checkLocalFS(dir, unix.Statfs)
}

func checkLocalFS(dir string, statfs func(string, *unix.Statfs_t) error) error {
	var st unix.Statfs_t
	if err := statfs(dir, &st); err != nil {
		return fmt.Errorf("refcount: statfs %s: %w", dir, err)
	}
	if name, ok := networkFS[int64(st.Type)]; ok {
		return fmt.Errorf("%w: %s is on %s; nodes that share a store must use the server's reference counting (dlock serve --refcount=server), or set AllowNetworkFS if one machine alone uses it", ErrNetworkFS, dir, name)
	}
	return nil
}
