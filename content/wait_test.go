package content

import (
	"context"
	"errors"
	"testing"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/errdefs"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dlock/dlock/lock"
)

type statusAnswer struct {
	st  content.Status
	err error
}

func statusOf(w content.Writer) <-chan statusAnswer {
	out := make(chan statusAnswer, 1)
	go func() {
		st, err := w.Status()
		out <- statusAnswer{st, err}
	}()
	return out
}

// TestWaitWriterToldDone: a node in line for a blob gets a writer at once;
// its Status answers when the holder has committed, with the write
// complete, and its Commit registers the node's reference without a byte
// written. Through Proxied, the first Status (containerd's negotiation,
// inside its metadata transaction) answers at once.
func TestWaitWriterToldDone(t *testing.T) {
	for _, proxied := range []bool{false, true} {
		t.Run(map[bool]string{false: "direct", true: "proxied"}[proxied], func(t *testing.T) {
			e := newStoreEnv(t, nil)
			a, b := e.store("a"), e.store("b")
			ctx := t.Context()
			wa, err := writerFor(ctx, a, blobDigest)
			if err != nil {
				t.Fatal(err)
			}
			var bs content.Store = b
			if proxied {
				bs = b.Proxied()
			}
			wb, err := bs.Writer(ctx, content.WithRef("default/2/layer-"+blobDigest.String()), content.WithDescriptor(ocispec.Descriptor{Size: int64(len(blob))}))
			if err != nil {
				t.Fatalf("b's writer while a pulls: %v", err)
			}
			if proxied {
				if st, err := wb.Status(); err != nil || st.Offset != 0 || st.Total != int64(len(blob)) {
					t.Fatalf("the negotiation's Status: %+v %v, want an empty write of %d at once", st, err, len(blob))
				}
			}
			answer := statusOf(wb)
			e.srv.WaitQueued(t, lock.Key{Type: lock.Pull, Resource: blobDigest.String()}, 1)
			wa.Write(blob)
			if err := wa.Commit(ctx, int64(len(blob)), blobDigest); err != nil {
				t.Fatal(err)
			}
			got := <-answer
			if got.err != nil || got.st.Offset != int64(len(blob)) || got.st.Total != int64(len(blob)) {
				t.Fatalf("b's Status after a's commit: %+v %v, want the write complete", got.st, got.err)
			}
			if err := wb.Commit(ctx, int64(len(blob)), blobDigest); err != nil {
				t.Fatalf("b's commit of the blob a committed: %v", err)
			}
			if refs := e.refs(blobDigest); len(refs) != 2 {
				t.Fatalf("references after b's commit: %v, want a and b", refs)
			}
			if err := wb.Commit(ctx, 3, blobDigest); !errdefs.IsFailedPrecondition(err) {
				t.Fatalf("a commit of the wrong size: %v", err)
			}
			if _, err := wb.Write([]byte("x")); !errdefs.IsFailedPrecondition(err) {
				t.Fatalf("a write into a blob another node committed: %v", err)
			}
			if sts, _ := b.ListStatuses(ctx); len(sts) != 0 {
				t.Fatalf("b has ingests: %+v", sts)
			}
		})
	}
}

// TestWaitWriterLeaves: a waiting writer closed, or whose caller gives up
// (and closes it), or whose store closes, leaves the line.
func TestWaitWriterLeaves(t *testing.T) {
	e := newStoreEnv(t, nil)
	a, b := e.store("a"), e.store("b")
	k := lock.Key{Type: lock.Pull, Resource: blobDigest.String()}
	if _, err := writerFor(t.Context(), a, blobDigest); err != nil {
		t.Fatal(err)
	}
	queue := func() int {
		st, err := e.srv.Backend.Status(t.Context(), lock.Pull, blobDigest.String(), "")
		if err != nil {
			t.Fatal(err)
		}
		return st.QueueLength
	}

	wb, err := writerFor(t.Context(), b, blobDigest)
	if err != nil {
		t.Fatal(err)
	}
	wb.Close()
	if n := queue(); n != 0 {
		t.Fatalf("%d in line after the waiting writer closed", n)
	}
	if _, err := wb.Status(); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("Status of a closed writer: %v", err)
	}

	ctx, giveUp := context.WithCancel(t.Context())
	wb, err = writerFor(ctx, b, blobDigest)
	if err != nil {
		t.Fatal(err)
	}
	answer := statusOf(wb)
	e.srv.WaitQueued(t, k, 1)
	giveUp()
	if got := <-answer; !errors.Is(got.err, context.Canceled) || !errdefs.IsUnavailable(got.err) {
		t.Fatalf("Status when containerd gives up: %v", got.err)
	}
	wb.Close() // as containerd does with a writer whose call failed
	if n := queue(); n != 0 {
		t.Fatalf("%d in line after containerd gave up and closed the writer", n)
	}
	b.mu.Lock()
	left := len(b.lines)
	b.mu.Unlock()
	if left != 0 {
		t.Fatalf("b keeps %d lines it left", left)
	}

	wb, err = writerFor(t.Context(), b, blobDigest)
	if err != nil {
		t.Fatal(err)
	}
	answer = statusOf(wb)
	e.srv.WaitQueued(t, k, 1)
	b.Close()
	if got := <-answer; !errors.Is(got.err, errWaitEnded) {
		t.Fatalf("Status when the store closes: %v", got.err)
	}
}

// TestTwoWritersOfOneNode: two pulls of one node want one blob. The
// server tells both "acquired" (one grant per node); the first writes,
// the second waits for it, and takes over when it fails. The lock is
// never released while a writer of the node still writes under it.
func TestTwoWritersOfOneNode(t *testing.T) {
	e := newStoreEnv(t, nil)
	a := e.store("a")
	ctx := t.Context()
	first, err := writerFor(ctx, a, blobDigest)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := first.(*writer); !ok {
		t.Fatalf("first writer: %T, want one that downloads", first)
	}
	second, err := writerFor(ctx, a, blobDigest)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := second.(*waitWriter); !ok {
		t.Fatalf("second writer of the same blob: %T, want one that waits", second)
	}
	if h := e.holder(lock.Pull, blobDigest); h != "a" {
		t.Fatalf("the second writer let the lock go: holder %q", h)
	}
	answer := statusOf(second)
	first.Write(blob[:3])
	first.Close() // failed: the second takes over
	got := <-answer
	if got.err != nil || got.st.Offset >= int64(len(blob)) {
		t.Fatalf("second writer after the first failed: %+v %v, want a write to finish", got.st, got.err)
	}
	if h := e.holder(lock.Pull, blobDigest); h != "a" {
		t.Fatalf("holder %q while the second writer writes, want a", h)
	}
	third, err := writerFor(ctx, a, blobDigest)
	if err != nil {
		t.Fatal(err)
	}
	answer = statusOf(third)
	second.Write(blob[got.st.Offset:]) // containerd resumes the ingest of its ref
	if err := second.Commit(ctx, int64(len(blob)), blobDigest); err != nil {
		t.Fatal(err)
	}
	if got := <-answer; got.err != nil || got.st.Offset != int64(len(blob)) {
		t.Fatalf("third writer after the second committed: %+v %v, want the write complete", got.st, got.err)
	}
	if err := third.Commit(ctx, 0, blobDigest); err != nil {
		t.Fatal(err)
	}
	if h := e.holder(lock.Pull, blobDigest); h != "" {
		t.Fatalf("lock held by %q after the commit", h)
	}
}

// TestOneWriterGivesUpTheOtherWaits: two writers of one node wait in line
// for a blob another node pulls (two pulls sharing a layer); containerd
// gives up on one. The node keeps its place for the other, which is told
// when the blob is done; the node leaves the line only with its last
// writer there.
func TestOneWriterGivesUpTheOtherWaits(t *testing.T) {
	e := newStoreEnv(t, nil)
	a, b := e.store("a"), e.store("b")
	ctx := t.Context()
	k := lock.Key{Type: lock.Pull, Resource: blobDigest.String()}
	wa, err := writerFor(ctx, a, blobDigest)
	if err != nil {
		t.Fatal(err)
	}
	gone, giveUp := context.WithCancel(ctx)
	w1, err := writerFor(gone, b, blobDigest)
	if err != nil {
		t.Fatal(err)
	}
	w2, err := writerFor(ctx, b, blobDigest)
	if err != nil {
		t.Fatal(err)
	}
	first, second := statusOf(w1), statusOf(w2)
	e.srv.WaitQueued(t, k, 1)
	giveUp()
	if got := <-first; !errors.Is(got.err, context.Canceled) {
		t.Fatalf("the writer containerd gave up on: %v", got.err)
	}
	w1.Close()
	if st, _ := e.srv.Backend.Status(ctx, lock.Pull, blobDigest.String(), "b"); st.Position != 1 {
		t.Fatalf("b left the line with a writer still waiting: %+v", st)
	}
	wa.Write(blob)
	if err := wa.Commit(ctx, int64(len(blob)), blobDigest); err != nil {
		t.Fatal(err)
	}
	if got := <-second; got.err != nil || got.st.Offset != int64(len(blob)) {
		t.Fatalf("the writer still waiting: %+v %v, want the write complete", got.st, got.err)
	}
	if err := w2.Commit(ctx, int64(len(blob)), blobDigest); err != nil {
		t.Fatal(err)
	}
	w2.Close()
}
