package refcount

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/dlock/dlock/lock/memory"
	bolt "go.etcd.io/bbolt"
)

var refsBucket = []byte("refs")

// ServerStore keeps a dlock server's references (refcount=server) durable in
// one bbolt database file. bbolt locks the file: one server at a time uses it.
type ServerStore struct {
	db *bolt.DB
}

var _ memory.RefStore = (*ServerStore)(nil)

type boltRecord struct {
	Version uint64   `json:"v"`
	Nodes   []string `json:"nodes,omitempty"`
}

// OpenServerStore opens (creating if needed) the database at path.
func OpenServerStore(path string) (*ServerStore, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return nil, fmt.Errorf("refcount: %w", err)
	}
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 2 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("refcount: opening %s: %w", path, err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		_, err := tx.CreateBucketIfNotExists(refsBucket)
		return err
	})
	if err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("refcount: %s: %w", path, err)
	}
	return &ServerStore{db: db}, nil
}

// Close closes the database.
func (b *ServerStore) Close() error { return b.db.Close() }

// Load returns every resource that has references and the highest version
// stored. Empty records (kept so that a late, older save cannot resurrect a
// cleared resource) are dropped here, when no save can be in flight.
func (b *ServerStore) Load(ctx context.Context) (map[string]memory.RefRecord, uint64, error) {
	refs := make(map[string]memory.RefRecord)
	var maxVersion uint64
	err := b.db.Update(func(tx *bolt.Tx) error {
		bk := tx.Bucket(refsBucket)
		var empty [][]byte
		err := bk.ForEach(func(k, v []byte) error {
			var r boltRecord
			if err := json.Unmarshal(v, &r); err != nil {
				return fmt.Errorf("record %q is corrupt: %w", k, err)
			}
			maxVersion = max(maxVersion, r.Version)
			if len(r.Nodes) == 0 {
				empty = append(empty, append([]byte(nil), k...))
				return nil
			}
			refs[string(k)] = memory.RefRecord{Nodes: r.Nodes, Version: r.Version}
			return nil
		})
		if err != nil {
			return err
		}
		// Keep the highest version even when every record is gone.
		if err := tx.Bucket(refsBucket).SetSequence(max(bk.Sequence(), maxVersion)); err != nil {
			return err
		}
		maxVersion = bk.Sequence()
		for _, k := range empty {
			if err := bk.Delete(k); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, 0, fmt.Errorf("refcount: loading: %w", err)
	}
	return refs, maxVersion, nil
}

// Save stores rec unless the stored record is as new or newer.
func (b *ServerStore) Save(ctx context.Context, resource string, rec memory.RefRecord) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	v, err := json.Marshal(boltRecord{Version: rec.Version, Nodes: rec.Nodes})
	if err != nil {
		return err
	}
	return b.db.Update(func(tx *bolt.Tx) error {
		bk := tx.Bucket(refsBucket)
		if old := bk.Get([]byte(resource)); old != nil {
			var r boltRecord
			if err := json.Unmarshal(old, &r); err == nil && r.Version >= rec.Version {
				return nil
			}
		}
		if rec.Version > bk.Sequence() {
			if err := bk.SetSequence(rec.Version); err != nil {
				return err
			}
		}
		return bk.Put([]byte(resource), v)
	})
}
