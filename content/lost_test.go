package content

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/memory"
)

// blackHole is a TCP proxy to a server that, once cut, passes no byte either
// way and closes nothing, for the connections it has and those it accepts
// later: a network path that went silent, as the node behind it sees it.
// Heal lets bytes (and closes) pass again.
type blackHole struct {
	ln     net.Listener
	target string
	done   chan struct{}
	wg     sync.WaitGroup

	mu     sync.Mutex
	healed chan struct{}         // while cut: closed by Heal; nil while bytes pass
	conns  map[net.Conn]struct{} // both ends of every forwarded connection
	closed bool
}

func newBlackHole(t *testing.T, target string) *blackHole {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b := &blackHole{ln: ln, target: target, done: make(chan struct{}), conns: map[net.Conn]struct{}{}}
	b.wg.Go(b.accept)
	t.Cleanup(b.close)
	return b
}

func (b *blackHole) URL() string { return "http://" + b.ln.Addr().String() }

// Cut stops every byte, and every close, between the proxy's clients and
// the server.
func (b *blackHole) Cut() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.healed == nil {
		b.healed = make(chan struct{})
	}
}

// Heal lets them pass again.
func (b *blackHole) Heal() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.healed != nil {
		close(b.healed)
		b.healed = nil
	}
}

// pass waits while the path is cut; false once the proxy closes.
func (b *blackHole) pass() bool {
	for {
		b.mu.Lock()
		healed := b.healed
		b.mu.Unlock()
		if healed == nil {
			select {
			case <-b.done:
				return false
			default:
				return true
			}
		}
		select {
		case <-healed:
		case <-b.done:
			return false
		}
	}
}

func (b *blackHole) track(c net.Conn) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		c.Close()
		return false
	}
	b.conns[c] = struct{}{}
	return true
}

func (b *blackHole) accept() {
	for {
		c, err := b.ln.Accept()
		if err != nil {
			return
		}
		if b.track(c) {
			b.wg.Go(func() { b.forward(c) })
		}
	}
}

// forward connects c to the server once the path passes, and pumps both
// ways.
func (b *blackHole) forward(c net.Conn) {
	if !b.pass() {
		c.Close()
		return
	}
	up, err := net.Dial("tcp", b.target)
	if err != nil {
		c.Close()
		return
	}
	if !b.track(up) {
		c.Close()
		return
	}
	b.wg.Go(func() { b.pump(up, c) })
	b.pump(c, up)
}

// pump copies src to dst while the path passes: nothing is read or written
// while it is cut, and an end of src reaches dst only once it passes again.
func (b *blackHole) pump(src, dst net.Conn) {
	defer func() {
		src.Close()
		dst.Close()
	}()
	buf := make([]byte, 32<<10)
	for b.pass() {
		n, err := src.Read(buf)
		if !b.pass() {
			return
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (b *blackHole) close() {
	close(b.done)
	b.ln.Close()
	b.mu.Lock()
	b.closed = true
	for c := range b.conns {
		c.Close()
	}
	b.mu.Unlock()
	b.wg.Wait()
}

// storeVia opens node's store with a client of the server at url, which
// checks its holds every 20 ms.
func (e *storeEnv) storeVia(node, url string) *Store {
	c := &client.Client{Server: url, Node: node, MaxRetries: -1, RequestTimeout: 500 * time.Millisecond, RenewInterval: 20 * time.Millisecond}
	s, err := New(e.t.Context(), Config{Root: e.root, Client: c})
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { s.Close(); c.Close() })
	return s
}

// pull gets data on node s as containerd's pull does: Info when the blob
// is there (which references it), else a writer and a commit. Answers that
// say "try again" (the blob is being deleted, another node pulls it) are
// retried until Patience runs out.
func pull(t *testing.T, s *Store, data []byte) {
	t.Helper()
	ctx := t.Context()
	d := digest.FromBytes(data)
	kit.Await(t, fmt.Sprintf("node %s to pull %s", s.c.Node, d), func() error {
		_, err := s.Info(ctx, d)
		if !errdefs.IsNotFound(err) {
			return err
		}
		w, err := writerFor(ctx, s, d)
		if err != nil {
			return err
		}
		defer w.Close()
		if _, err := w.Write(data); err != nil {
			return err
		}
		if err := w.Commit(ctx, int64(len(data)), d); err != nil && !errdefs.IsAlreadyExists(err) {
			return err
		}
		return nil
	})
}

// checkIntact fails the test unless the shared blob d is there with its
// digest's bytes and the trash is empty.
func checkIntact(t *testing.T, root string, d digest.Digest) {
	t.Helper()
	checkBlob(t, root, d)
	if entries, _ := os.ReadDir(filepath.Join(root, "trash")); len(entries) != 0 {
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		t.Fatalf("trash left behind beside the blob: %v", names)
	}
}

// checkBlob fails the test unless the shared blob d is there with its
// digest's bytes.
func checkBlob(t *testing.T, root string, d digest.Digest) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, "blobs", d.Algorithm().String(), d.Encoded()))
	if err != nil {
		t.Fatalf("the blob is lost: %v", err)
	}
	if got := digest.FromBytes(data); got != d {
		t.Fatalf("the blob's bytes have digest %s, want %s", got, d)
	}
}

// TestDeleteCutOff: node a's garbage collector deletes a blob, and a is cut
// off from the lock service (a black hole: its connections pass nothing
// and close nothing) between two steps of the delete: after its grant,
// before the move into the trash; or after the move, before the unlock.
// The server takes the delete lock back, and node b pulls the blob: it
// finds it and references it, or downloads it anew. Then a goes on:
// either it has learnt that its hold is lost (the path healed and its
// client's check saw it) or it is still cut off and knows nothing. Either
// way b's blob is there and intact at the end, no trash is left, and a's
// delete returned ErrLockLost or was undone.
//
// A server notices a silent peer only when TCP gives up on the connection,
// which takes minutes (and through this proxy, whose kernel acknowledges
// what the server sends, never): the test ends the server's side of a's
// session stream in its stead (kit.Hooks.KillStreams), and the session
// grace, 100 ms here, does the rest. a's side of the stream stays in the
// black hole.
func TestDeleteCutOff(t *testing.T) {
	for _, step := range []string{stepTrash, stepUnlink} {
		for _, learns := range []bool{true, false} {
			name := fmt.Sprintf("before %s, %s", step, map[bool]string{true: "learns of the loss", false: "still cut off"}[learns])
			t.Run(name, func(t *testing.T) { deleteCutOff(t, step, learns) })
		}
	}
}

func deleteCutOff(t *testing.T, step string, learns bool) {
	e := newStoreEnv(t, func(c *memory.Config) { c.SessionGrace = 100 * time.Millisecond })
	hole := newBlackHole(t, e.srv.Addr)
	a, b := e.storeVia("a", hole.URL()), e.store("b")
	data := []byte("a layer deleted by a cut-off node: " + step)
	d := commitBlob(t, a, data)

	at := make(chan (<-chan struct{}), 1)
	resume := make(chan struct{})
	goOn := sync.OnceFunc(func() { close(resume) })
	defer goOn()
	var mu sync.Mutex
	var reached []string // the steps a's delete came to
	a.testHook = func(s string, lost <-chan struct{}) {
		mu.Lock()
		reached = append(reached, s)
		mu.Unlock()
		if s == step {
			at <- lost
			<-resume
		}
	}
	deleted := make(chan error, 1)
	go func() { deleted <- a.Delete(t.Context(), d) }()
	var lost <-chan struct{}
	select {
	case lost = <-at:
	case <-time.After(kit.Patience):
		t.Fatalf("a's delete never reached the step before %s", step)
	}

	hole.Cut()
	if n := e.srv.KillStreams("a"); n == 0 {
		t.Fatal("a has no session stream to end")
	}
	kit.WaitFor(t, "the server to take a's delete lock back", func() bool { return e.holder(lock.Delete, d) == "" })
	pull(t, b, data)
	checkBlob(t, e.root, d)

	if learns {
		hole.Heal()
		select {
		case <-lost:
		case <-time.After(kit.Patience):
			t.Fatal("a's client never learnt that its delete lock is lost")
		}
	}
	goOn()
	var err error
	select {
	case err = <-deleted:
	case <-time.After(kit.Patience):
		t.Fatal("a's delete never returned")
	}
	switch {
	case learns && !(errors.Is(err, client.ErrLockLost) && strings.Contains(err.Error(), step+" skipped")):
		t.Fatalf("a's delete after its client learnt of the loss: %v, want ErrLockLost for %s skipped", err, step)
	case err != nil && !errors.Is(err, client.ErrLockLost):
		t.Fatalf("a's delete: %v, want nil (undone) or ErrLockLost", err)
	}
	mu.Lock()
	steps := reached
	mu.Unlock()
	if learns && steps[len(steps)-1] != step {
		t.Fatalf("a's delete went on to %q after %q was skipped", steps[len(steps)-1], step)
	}
	checkIntact(t, e.root, d)
	if refs := e.refs(d); !slices.Contains(refs, "b") {
		t.Fatalf("references after a's delete: %v, want b's", refs)
	}
	ra, err := b.ReaderAt(t.Context(), ocispec.Descriptor{Digest: d, Size: int64(len(data))})
	if err != nil {
		t.Fatalf("b reads its blob: %v", err)
	}
	ra.Close()
	if h := e.holder(lock.Delete, d); h != "" {
		t.Fatalf("delete lock held by %q at the end", h)
	}
}

// TestCommitAndUpdateLockLost: a commit's move into the shared folder and
// a label change are not made once the node's client knows its hold is
// lost (here the server takes it back, as an expiry would); the call
// fails with ErrLockLost and the key is free for the next node.
func TestCommitAndUpdateLockLost(t *testing.T) {
	e := newStoreEnv(t, nil)
	a, b := e.storeVia("a", e.srv.URL()), e.store("b")
	data := []byte("committed by a node that lost its pull lock")
	d := digest.FromBytes(data)
	takeBack := func(typ lock.Type, step string) {
		a.testHook = func(s string, lost <-chan struct{}) {
			if s != step {
				return
			}
			if _, err := e.srv.Backend.Cancel(context.Background(), typ, d.String(), "a"); err != nil {
				t.Error(err)
			}
			select {
			case <-lost:
			case <-time.After(kit.Patience):
				t.Errorf("a's client never learnt that its %s lock is lost", typ)
			}
		}
	}

	takeBack(lock.Pull, stepPublish)
	w, err := writerFor(t.Context(), a, d)
	if err != nil {
		t.Fatal(err)
	}
	w.Write(data)
	if err := w.Commit(t.Context(), int64(len(data)), d); !errors.Is(err, client.ErrLockLost) || !errdefs.IsUnavailable(err) {
		t.Fatalf("commit after the pull lock was lost: %v, want ErrLockLost and ErrUnavailable", err)
	}
	w.Close()
	if blobExists(e.root, d) {
		t.Fatal("the blob entered the shared folder under a lost lock")
	}
	a.testHook = nil
	pull(t, b, data)
	checkIntact(t, e.root, d)

	takeBack(lock.Update, stepLabels)
	if _, err := a.Update(t.Context(), content.Info{Digest: d, Labels: map[string]string{"k": "v"}}, "labels.k"); !errors.Is(err, client.ErrLockLost) {
		t.Fatalf("update after the update lock was lost: %v, want ErrLockLost", err)
	}
	if _, err := os.Stat(filepath.Join(e.root, "labels", "sha256", d.Encoded())); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("labels written under a lost lock: %v", err)
	}
}

// TestTwoWritersOneNode: two writers of one blob on one node (two
// namespaces pulling one layer) share the node's pull lock: the first
// downloads, the second waits for it and then commits the blob in place
// without a byte written.
func TestTwoWritersOneNode(t *testing.T) {
	e := newStoreEnv(t, nil)
	a := e.storeVia("a", e.srv.URL())
	data := []byte("one layer, two namespaces")
	d := digest.FromBytes(data)
	var ws []content.Writer
	for _, ref := range []string{"ns1/1/layer-", "ns2/2/layer-"} {
		w, err := a.Writer(t.Context(), content.WithRef(ref+d.String()), content.WithDescriptor(ocispec.Descriptor{Size: int64(len(data))}))
		if err != nil {
			t.Fatalf("writer %s: %v", ref, err)
		}
		defer w.Close()
		ws = append(ws, w)
	}
	answer := statusOf(ws[1])
	ws[0].Write(data)
	if err := ws[0].Commit(t.Context(), int64(len(data)), d); err != nil {
		t.Fatalf("first commit: %v", err)
	}
	if got := <-answer; got.err != nil || got.st.Offset != int64(len(data)) {
		t.Fatalf("second writer: %+v %v, want the write complete", got.st, got.err)
	}
	if err := ws[1].Commit(t.Context(), int64(len(data)), d); err != nil {
		t.Fatalf("second commit: %v", err)
	}
	if sts, _ := a.ListStatuses(t.Context()); len(sts) != 0 {
		t.Fatalf("ingests left: %+v", sts)
	}
	checkIntact(t, e.root, d)
}
