// Package datadir is a dlock server's data directory: held by one server at
// a time, it keeps the fencing-token ceiling (docs/DESIGN.md, "Fencing
// tokens") and, with refcount=server, the reference database.
package datadir

import (
	"errors"
	"fmt"
	"hash/crc32"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

var (
	// ErrInUse is a data directory held by another running server.
	ErrInUse = errors.New("data directory in use by another dlock server")
	// ErrCorrupt is a token-ceiling file that cannot be read back. It stops
	// start-up: starting from the clock instead could issue old tokens.
	ErrCorrupt = errors.New("token ceiling file is corrupt")
)

const (
	lockName    = "dlock.lock"
	ceilingName = "token-ceiling"
	magic       = "dlock-token-ceiling/1"
)

// Dir is an open data directory. Its lock is held until Close.
type Dir struct {
	path string
	lock *os.File
}

// Open creates the directory if needed and locks it (flock on dlock.lock,
// released by the kernel if the process dies), so that two servers never
// share one directory: the second gets ErrInUse.
func Open(path string) (*Dir, error) {
	if err := os.MkdirAll(path, 0o750); err != nil {
		return nil, fmt.Errorf("data dir: %w", err)
	}
	name := filepath.Join(path, lockName)
	f, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("data dir: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		holder, _ := os.ReadFile(name)
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w: %s (held by pid %s); give each server its own --data-dir",
				ErrInUse, path, strings.TrimSpace(string(holder)))
		}
		return nil, fmt.Errorf("data dir: locking %s: %w", name, err)
	}
	// The holder's pid, for the message above; the lock is what counts.
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return &Dir{path: path, lock: f}, nil
}

// Path is the directory's path.
func (d *Dir) Path() string { return d.path }

// Close releases the directory.
func (d *Dir) Close() error { return d.lock.Close() }

// TokenCeiling is the directory's token-ceiling file, a memory.CeilingStore.
func (d *Dir) TokenCeiling() *CeilingFile {
	return &CeilingFile{dir: d.path}
}

// CeilingFile keeps the token ceiling in one small file, replaced
// atomically. Only the holder of the directory may use it.
type CeilingFile struct {
	dir string
}

// LoadCeiling returns the stored ceiling, 0 when no file exists yet, and an
// ErrCorrupt error for a file it cannot read back.
func (c *CeilingFile) LoadCeiling() (uint64, error) {
	name := filepath.Join(c.dir, ceilingName)
	b, err := os.ReadFile(name)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("data dir: %w", err)
	}
	v, err := decode(string(b))
	if err != nil {
		return 0, fmt.Errorf("%w: %s: %v (restore it, or remove it only if no token issued by the last server matters any more)",
			ErrCorrupt, name, err)
	}
	return v, nil
}

// StoreCeiling writes v to a temporary file, syncs it, renames it over the
// ceiling file and syncs the directory, so that after a crash the file holds
// either the old ceiling or v, durably.
func (c *CeilingFile) StoreCeiling(v uint64) error {
	if err := c.store(v); err != nil {
		return fmt.Errorf("data dir: %w", err)
	}
	return nil
}

func (c *CeilingFile) store(v uint64) error {
	tmp, err := os.CreateTemp(c.dir, ceilingName+".*.tmp")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // fails once renamed, as it should
	_, err = tmp.WriteString(encode(v))
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), filepath.Join(c.dir, ceilingName)); err != nil {
		return err
	}
	dir, err := os.Open(c.dir)
	if err != nil {
		return err
	}
	err = dir.Sync()
	if cerr := dir.Close(); err == nil {
		err = cerr
	}
	return err
}

// The file is one line: magic, the ceiling, and a CRC-32 of both, so that a
// damaged file is refused rather than read as a smaller ceiling.
func encode(v uint64) string {
	body := magic + " " + strconv.FormatUint(v, 10)
	return fmt.Sprintf("%s %08x\n", body, crc32.ChecksumIEEE([]byte(body)))
}

func decode(s string) (uint64, error) {
	line, ok := strings.CutSuffix(s, "\n")
	if !ok {
		return 0, errors.New("no end of line")
	}
	i := strings.LastIndexByte(line, ' ')
	if i < 0 {
		return 0, errors.New("no checksum")
	}
	body, sum := line[:i], line[i+1:]
	want, err := strconv.ParseUint(sum, 16, 32)
	if err != nil || len(sum) != 8 {
		return 0, fmt.Errorf("bad checksum %q", sum)
	}
	if crc32.ChecksumIEEE([]byte(body)) != uint32(want) {
		return 0, errors.New("checksum mismatch")
	}
	num, ok := strings.CutPrefix(body, magic+" ")
	if !ok {
		return 0, fmt.Errorf("not a %s file", magic)
	}
	v, err := strconv.ParseUint(num, 10, 64)
	if err != nil {
		return 0, err
	}
	return v, nil
}
