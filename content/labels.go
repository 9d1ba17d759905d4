package content

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path"

	"github.com/opencontainers/go-digest"
)

// maxLabels bounds a blob's label file: containerd keeps labels to 4 KiB
// per blob, so anything this large was not written by a store.
const maxLabels = 1 << 20

// labelStore keeps blob labels in the shared root, one JSON file per blob
// (labels/<alg>/<hex>), replaced atomically. Writers are serialized across
// nodes by the blob's update lock.
type labelStore struct{ root *os.Root }

func labelPath(d digest.Digest) string {
	return path.Join("labels", d.Algorithm().String(), d.Encoded())
}

func (l *labelStore) Get(d digest.Digest) (map[string]string, error) {
	f, _, err := openRegular(l.root, labelPath(d))
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, errNotRegular) {
		// No labels; a symlink planted there is not read, and Set
		// replaces it.
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("labels of %v: %w", d, err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxLabels+1))
	if err != nil {
		return nil, fmt.Errorf("labels of %v: %w", d, err)
	}
	if len(data) > maxLabels {
		return nil, fmt.Errorf("labels of %v: over %d bytes", d, maxLabels)
	}
	var labels map[string]string
	if err := json.Unmarshal(data, &labels); err != nil {
		return nil, fmt.Errorf("labels of %v: %w", d, err)
	}
	return labels, nil
}

func (l *labelStore) Set(d digest.Digest, labels map[string]string) error {
	p := labelPath(d)
	if len(labels) == 0 {
		return l.remove(d)
	}
	data, err := json.Marshal(labels)
	if err != nil {
		return err
	}
	if err := mkdirs(l.root, path.Dir(p)); err != nil {
		return err
	}
	return writeFileAtomic(l.root, p, data)
}

// remove drops a blob's labels. Remove unlinks the name itself, so a
// symlink planted there goes, not what it points to.
func (l *labelStore) remove(d digest.Digest) error {
	if err := l.root.Remove(labelPath(d)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// move moves a blob's labels, if any, to name (into the trash, beside
// the blob); a symlink planted there is moved as a name, never followed.
func (l *labelStore) move(d digest.Digest, name string) error {
	if err := l.root.Rename(labelPath(d), name); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// restore puts back labels that move took to name, unless the blob has
// labels again; name goes either way.
func (l *labelStore) restore(d digest.Digest, name string) error {
	var err error
	if _, serr := l.root.Lstat(labelPath(d)); errors.Is(serr, fs.ErrNotExist) {
		if err = l.root.Rename(name, labelPath(d)); err == nil || errors.Is(err, fs.ErrNotExist) {
			return nil
		}
	}
	l.root.Remove(name)
	return err
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
