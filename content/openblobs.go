package content

import (
	"io"
	"os"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"
)

// openBlobs shares the open file of a blob among its readers, and keeps it
// open for a moment after the last one closes: containerd unpacks a layer
// through the proxy plugin with one Read call per 32 KiB, each of which
// opens the blob anew (docs/CONTAINERD.md, "Unpacking through the
// plugin"), and an open through the root's checks costs more than the
// read. This node's Delete drops the blob's file first; another node
// deletes a blob only once no node references it, this one included, which
// takes this node's Delete.
type openBlobs struct {
	linger time.Duration

	mu     sync.Mutex
	files  map[digest.Digest]*blobFile
	closed bool
}

type blobFile struct {
	d       digest.Digest
	f       *os.File
	size    int64
	users   int
	dropped bool        // no longer shared: closed with its last reader
	timer   *time.Timer // closes it once unused for linger
}

// get returns a reader of the open file of d, opening it with open when
// none is.
func (o *openBlobs) get(d digest.Digest, open func() (*os.File, int64, error)) (*blobReader, error) {
	o.mu.Lock()
	if bf := o.files[d]; bf != nil {
		bf.users++
		if bf.timer != nil {
			bf.timer.Stop()
			bf.timer = nil
		}
		o.mu.Unlock()
		return &blobReader{o: o, bf: bf}, nil
	}
	o.mu.Unlock()
	f, size, err := open()
	if err != nil {
		return nil, err
	}
	bf := &blobFile{d: d, f: f, size: size, users: 1}
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed || o.files[d] != nil {
		bf.dropped = true // opened twice at once, or closing: this one is not shared
	} else {
		o.files[d] = bf
	}
	return &blobReader{o: o, bf: bf}, nil
}

func (o *openBlobs) put(bf *blobFile) {
	o.mu.Lock()
	defer o.mu.Unlock()
	bf.users--
	if bf.users > 0 {
		return
	}
	if bf.dropped {
		bf.f.Close()
		return
	}
	bf.timer = time.AfterFunc(o.linger, func() {
		o.mu.Lock()
		defer o.mu.Unlock()
		if bf.users == 0 && !bf.dropped && o.files[bf.d] == bf {
			delete(o.files, bf.d)
			bf.dropped = true
			bf.f.Close()
		}
	})
}

// drop stops sharing d's file: it closes now if unused, else with its last
// reader.
func (o *openBlobs) drop(d digest.Digest) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if bf := o.files[d]; bf != nil {
		o.dropLocked(bf)
	}
}

func (o *openBlobs) dropLocked(bf *blobFile) {
	delete(o.files, bf.d)
	bf.dropped = true
	if bf.timer != nil {
		bf.timer.Stop()
		bf.timer = nil
	}
	if bf.users == 0 {
		bf.f.Close()
	}
}

// close drops every file; the readers still open keep theirs until they
// close.
func (o *openBlobs) close() {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.closed = true
	for _, bf := range o.files {
		o.dropLocked(bf)
	}
}

// blobReader reads a shared blob through its open file.
type blobReader struct {
	o    *openBlobs
	bf   *blobFile
	once sync.Once
}

func (r *blobReader) ReadAt(p []byte, off int64) (int, error) { return r.bf.f.ReadAt(p, off) }
func (r *blobReader) Size() int64                             { return r.bf.size }
func (r *blobReader) Close() error {
	r.once.Do(func() { r.o.put(r.bf) })
	return nil
}

// Reader reads the blob from its start; containerd's content.NewReader
// uses it when present.
func (r *blobReader) Reader() io.Reader { return io.NewSectionReader(r.bf.f, 0, r.bf.size) }
