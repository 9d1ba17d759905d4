package etcd

import (
	"sync/atomic"

	"github.com/dlock/dlock/lock"
)

// feed is a Stream of this server: a node's session stream, an observer of
// one key, or both. Its queue is the feed core every backend shares.
type feed struct {
	lock.FeedQueue[lock.Delivery]
	b       *Backend
	node    string
	lease   int64 // the etcd lease of node's session when the stream opened
	observe *lock.Key

	released atomic.Bool // the session's count of streams no longer has it
}

func newFeed(b *Backend, node string, observe *lock.Key) *feed {
	f := &feed{b: b, node: node, observe: observe}
	f.Init(b.cfg.StreamBuffer)
	return f
}

// push queues d; false when the feed did not keep up and was ended for it
// (the caller drops it from the watcher).
func (f *feed) push(d lock.Delivery) bool {
	if f.Offer(d) {
		return true
	}
	if f.MarkSlow() {
		f.b.slowStreams.Add(1)
	}
	f.End()
	return false
}

// Close ends the feed. Closing a node's last session stream on this server
// stops keeping its session alive: unless another stream keeps it, here or
// on another server, the session ends after its grace.
func (f *feed) Close() {
	w := f.b.w
	w.mu.Lock()
	w.dropLocked(f)
	w.mu.Unlock()
	f.End()
	f.b.s.release(f)
}

// dropLocked takes f out of the watcher's tables; w.mu held.
func (w *watcher) dropLocked(f *feed) {
	if f.observe != nil {
		if l := w.observers[*f.observe]; removeFeed(&l, f) {
			w.nWatchers--
			if len(l) == 0 {
				delete(w.observers, *f.observe)
			} else {
				w.observers[*f.observe] = l
			}
		}
	}
	if f.node != "" {
		if l := w.streams[f.node]; removeFeed(&l, f) {
			if len(l) == 0 {
				delete(w.streams, f.node)
			} else {
				w.streams[f.node] = l
			}
			w.b.ops.streamsChanged(f.node, len(l))
		}
	}
}

// removeFeed removes f from *l without changing the slice others may be
// iterating.
func removeFeed(l *[]*feed, f *feed) bool {
	for i, g := range *l {
		if g == f {
			n := make([]*feed, 0, len(*l)-1)
			n = append(n, (*l)[:i]...)
			*l = append(n, (*l)[i+1:]...)
			return true
		}
	}
	return false
}

// closeAll ends every stream of this server (Close).
func (w *watcher) closeAll() {
	w.mu.Lock()
	var all []*feed
	for _, l := range w.streams {
		all = append(all, l...)
	}
	for _, l := range w.observers {
		all = append(all, l...)
	}
	w.streams, w.observers, w.nWatchers = map[string][]*feed{}, map[lock.Key][]*feed{}, 0
	w.mu.Unlock()
	for _, f := range all {
		f.End()
	}
}
