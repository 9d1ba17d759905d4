package content

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"

	"github.com/opencontainers/go-digest"
)

// labelStore keeps blob labels in the shared root, one JSON file per blob,
// replaced atomically. Writers are serialized across nodes by the blob's
// update lock.
type labelStore struct{ dir string }

func (l *labelStore) path(d digest.Digest) string {
	return filepath.Join(l.dir, d.Algorithm().String(), d.Encoded())
}

func (l *labelStore) Get(d digest.Digest) (map[string]string, error) {
	data, err := os.ReadFile(l.path(d))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var labels map[string]string
	if err := json.Unmarshal(data, &labels); err != nil {
		return nil, fmt.Errorf("labels of %v: %w", d, err)
	}
	return labels, nil
}

func (l *labelStore) Set(d digest.Digest, labels map[string]string) error {
	p := l.path(d)
	if len(labels) == 0 {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
		return nil
	}
	data, err := json.Marshal(labels)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(p), ".labels-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), p)
}

func (l *labelStore) Update(d digest.Digest, update map[string]string) (map[string]string, error) {
	labels, err := l.Get(d)
	if err != nil {
		return nil, err
	}
	labels = maps.Clone(labels)
	if labels == nil {
		labels = map[string]string{}
	}
	for k, v := range update {
		if v == "" {
			delete(labels, k)
		} else {
			labels[k] = v
		}
	}
	return labels, l.Set(d, labels)
}
