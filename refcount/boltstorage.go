package refcount

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	bolt "go.etcd.io/bbolt"
	berrors "go.etcd.io/bbolt/errors"
)

var nodesBucket = []byte("nodes")

// Bolt is a Storage in one bbolt database file, shared safely by the
// processes of one machine. bbolt holds an flock on the file while it is
// open, so every operation opens it, runs one transaction and closes it:
// read-only (shared lock) for Get, read-write (exclusive) for the rest.
type Bolt struct {
	path string
	// Timeout is how long an operation waits for another process's lock.
	Timeout time.Duration
}

var _ Storage = (*Bolt)(nil)

// OpenBolt returns a bbolt Storage at path, creating the database. It
// refuses a path on a network filesystem unless opts.AllowNetworkFS.
func OpenBolt(path string, opts Options) (*Bolt, error) {
	if err := prepareDir(path, opts); err != nil {
		return nil, err
	}
	b := &Bolt{path: path, Timeout: 30 * time.Second}
	err := b.update(func(tx *bolt.Tx) error {
		_, err := tx.CreateBucketIfNotExists(nodesBucket)
		return err
	})
	if err != nil {
		return nil, err
	}
	return b, nil
}

func (b *Bolt) open(readOnly bool) (*bolt.DB, error) {
	db, err := bolt.Open(b.path, 0o600, &bolt.Options{Timeout: b.Timeout, ReadOnly: readOnly})
	if err != nil {
		switch {
		case errors.Is(err, berrors.ErrTimeout):
			return nil, fmt.Errorf("refcount: %s stayed locked by another process for %v: %w", b.path, b.Timeout, err)
		case errors.Is(err, berrors.ErrInvalid), errors.Is(err, berrors.ErrVersionMismatch), errors.Is(err, berrors.ErrChecksum):
			return nil, fmt.Errorf("%w: %s: %v", ErrCorrupt, b.path, err)
		}
		return nil, fmt.Errorf("refcount: %w", err)
	}
	return db, nil
}

func (b *Bolt) update(fn func(*bolt.Tx) error) error {
	db, err := b.open(false)
	if err != nil {
		return err
	}
	if err := db.Update(fn); err != nil {
		db.Close()
		return err
	}
	return db.Close()
}

func (b *Bolt) Get(resource string) (Ref, error) {
	db, err := b.open(true)
	if err != nil {
		return Ref{}, err
	}
	defer db.Close()
	var ref Ref
	err = db.View(func(tx *bolt.Tx) error {
		var err error
		ref, err = getRef(tx, resource)
		return err
	})
	return ref, err
}

func getRef(tx *bolt.Tx, resource string) (Ref, error) {
	bk := tx.Bucket(nodesBucket)
	if bk == nil {
		return Ref{}, fmt.Errorf("%w: no %q bucket", ErrCorrupt, nodesBucket)
	}
	var ref Ref
	if v := bk.Get([]byte(resource)); v != nil {
		if err := json.Unmarshal(v, &ref); err != nil {
			return Ref{}, fmt.Errorf("%w: references of %q: %v", ErrCorrupt, resource, err)
		}
	}
	return ref, nil
}

func putRef(tx *bolt.Tx, resource string, ref Ref) error {
	bk := tx.Bucket(nodesBucket)
	if ref.Count() == 0 {
		return bk.Delete([]byte(resource))
	}
	v, err := json.Marshal(normalized(ref))
	if err != nil {
		return err
	}
	return bk.Put([]byte(resource), v)
}

func (b *Bolt) Set(resource string, ref Ref) error {
	return b.update(func(tx *bolt.Tx) error { return putRef(tx, resource, ref) })
}

func (b *Bolt) Delete(resource string) error {
	return b.update(func(tx *bolt.Tx) error { return tx.Bucket(nodesBucket).Delete([]byte(resource)) })
}

func (b *Bolt) Update(resource string, fn func(*Ref) error) error {
	return b.update(func(tx *bolt.Tx) error {
		ref, err := getRef(tx, resource)
		if err != nil {
			return err
		}
		if err := fn(&ref); err != nil {
			return err
		}
		return putRef(tx, resource, ref)
	})
}
