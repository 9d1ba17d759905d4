package content

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/memory"
)

// answerOf waits for a Status answer, or fails the test after kit.Patience.
func answerOf(t *testing.T, who string, ch <-chan statusAnswer) statusAnswer {
	t.Helper()
	select {
	case got := <-ch:
		return got
	case <-time.After(kit.Patience):
		t.Fatalf("%s's Status never answered", who)
		return statusAnswer{}
	}
}

// pending fails the test if ch has an answer already.
func pending(t *testing.T, who string, ch <-chan statusAnswer) {
	t.Helper()
	select {
	case got := <-ch:
		t.Fatalf("%s's Status answered while the blob is not there and the lock not its: %+v %v", who, got.st, got.err)
	default:
	}
}

// TestBusyWaiterLeavesItsNodesHold: a writer of node a waits for another
// writer of a that downloads the blob under a's grant (the server has one
// grant per node). When containerd gives up on the waiting one (its
// context ends, or it closes the writer), the downloading one keeps the
// lock: a's /cancel would end the grant the whole node shares, pass the
// lock to node b, and have b download what a downloads.
func TestBusyWaiterLeavesItsNodesHold(t *testing.T) {
	for _, how := range []string{"closed", "context ended"} {
		t.Run(how, func(t *testing.T) {
			e := newStoreEnv(t, nil)
			a, b := e.store("a"), e.store("b")
			k := lock.Key{Type: lock.Pull, Resource: blobDigest.String()}
			first, err := writerFor(t.Context(), a, blobDigest)
			if err != nil {
				t.Fatal(err)
			}
			defer first.Close()
			ctx, giveUp := context.WithCancel(t.Context())
			defer giveUp()
			second, err := writerFor(ctx, a, blobDigest)
			if err != nil {
				t.Fatal(err)
			}
			if _, ok := second.(*waitWriter); !ok {
				t.Fatalf("second writer of a: %T, want one that waits", second)
			}
			wb, err := writerFor(t.Context(), b, blobDigest)
			if err != nil {
				t.Fatal(err)
			}
			answer := statusOf(wb) // wb is closed once it answered: never beside its Status
			e.srv.WaitQueued(t, k, 1)

			if how == "closed" {
				second.Close()
			} else {
				giveUp()
				if _, err := second.Status(); !errors.Is(err, context.Canceled) {
					t.Fatalf("Status of a writer whose caller gave up: %v", err)
				}
				second.Close()
			}
			if h := e.holder(lock.Pull, blobDigest); h != "a" {
				t.Fatalf("holder %q after a's waiting writer left, want a: its other writer still downloads", h)
			}
			st, err := e.srv.Backend.Status(t.Context(), lock.Pull, blobDigest.String(), "b")
			if err != nil || st.Position != 1 {
				t.Fatalf("b's place in line after a's waiting writer left: %+v %v", st, err)
			}
			pending(t, "b", answer)
			first.Write(blob)
			if err := first.Commit(t.Context(), int64(len(blob)), blobDigest); err != nil {
				t.Fatalf("a's commit: %v", err)
			}
			if got := answerOf(t, "b", answer); got.err != nil || got.st.Offset != int64(len(blob)) {
				t.Fatalf("b after a's commit: %+v %v, want the write complete", got.st, got.err)
			}
			if err := wb.Commit(t.Context(), int64(len(blob)), blobDigest); err != nil {
				t.Fatal(err)
			}
			wb.Close()
			checkIntact(t, e.root, blobDigest)
		})
	}
}

// TestToldDoneThenDeleted: b waits and is told the blob is there (the
// server counts b's reference from then on); before containerd commits
// b's writer, b's garbage collector, which does not know the blob yet,
// deletes it (releasing b's reference), and a, the last node referencing
// it, deletes it too. b's commit must not record a blob that is gone.
func TestToldDoneThenDeleted(t *testing.T) {
	e := newStoreEnv(t, nil)
	a, b := e.store("a"), e.store("b")
	ctx := t.Context()
	wa, err := writerFor(ctx, a, blobDigest)
	if err != nil {
		t.Fatal(err)
	}
	wb, err := writerFor(ctx, b, blobDigest)
	if err != nil {
		t.Fatal(err)
	}
	answer := statusOf(wb)
	e.srv.WaitQueued(t, lock.Key{Type: lock.Pull, Resource: blobDigest.String()}, 1)
	wa.Write(blob)
	if err := wa.Commit(ctx, int64(len(blob)), blobDigest); err != nil {
		t.Fatal(err)
	}
	if got := answerOf(t, "b", answer); got.err != nil || got.st.Offset != int64(len(blob)) {
		t.Fatalf("b after a's commit: %+v %v", got.st, got.err)
	}
	for _, s := range []*Store{b, a} {
		if err := s.Delete(ctx, blobDigest); err != nil {
			t.Fatal(err)
		}
	}
	if blobExists(e.root, blobDigest) {
		t.Fatal("a's delete left the blob no node referenced")
	}
	if err := wb.Commit(ctx, int64(len(blob)), blobDigest); err == nil {
		t.Fatalf("b's commit of a blob deleted since it was told: nil, references %v", e.refs(blobDigest))
	}
	wb.Close()
	if refs := e.refs(blobDigest); len(refs) != 0 {
		t.Fatalf("references to a blob that is gone: %v", refs)
	}
	// Info and ReaderAt find it gone too, and reference nothing.
	if _, err := b.Info(ctx, blobDigest); !errdefs.IsNotFound(err) {
		t.Fatalf("b's Info of the deleted blob: %v", err)
	}
	if refs := e.refs(blobDigest); len(refs) != 0 {
		t.Fatalf("references to a blob that is gone, after Info: %v", refs)
	}
}

// TestHolderCutOffTwoWaiters: a downloads, b and c wait in Status; a's
// connections go silent and its session ends on the server. Exactly one of
// b and c takes the lock over and downloads; the other is told done once
// the blob is there, never before.
func TestHolderCutOffTwoWaiters(t *testing.T) {
	// A short grace ends a's session soon after its stream; not shorter:
	// the grace is every session's, and the lease b or c is granted by it
	// must outlast a loaded machine's pauses.
	e := newStoreEnv(t, func(c *memory.Config) { c.SessionGrace = time.Second })
	hole := newBlackHole(t, e.srv.Addr)
	a := e.storeVia("a", hole.URL())
	b, c := e.store("b"), e.store("c")
	k := lock.Key{Type: lock.Pull, Resource: blobDigest.String()}
	ctx := t.Context()
	wa, err := writerFor(ctx, a, blobDigest)
	if err != nil {
		t.Fatal(err)
	}
	wa.Write(blob[:4])
	waiters := map[string]content.Writer{}
	answers := map[string]<-chan statusAnswer{}
	for i, s := range []*Store{b, c} {
		w, err := writerFor(ctx, s, blobDigest)
		if err != nil {
			t.Fatal(err)
		}
		name := s.c.Node
		waiters[name], answers[name] = w, statusOf(w)
		e.srv.WaitQueued(t, k, i+1)
	}
	hole.Cut()
	if n := e.srv.KillStreams("a"); n == 0 {
		t.Fatal("a has no session stream to end")
	}
	var first, other string
	select {
	case got := <-answers["b"]:
		first, other = "b", "c"
		answers["b"] = done(got)
	case got := <-answers["c"]:
		first, other = "c", "b"
		answers["c"] = done(got)
	case <-time.After(kit.Patience):
		t.Fatal("neither waiter took over from the cut-off holder")
	}
	got := <-answers[first]
	if got.err != nil || got.st.Offset != 0 {
		t.Fatalf("%s, first to answer: %+v %v, want the lock handed over with an empty write", first, got.st, got.err)
	}
	if blobExists(e.root, blobDigest) {
		t.Fatal("the blob is there before anyone committed it")
	}
	if h := e.holder(lock.Pull, blobDigest); h != first {
		t.Fatalf("holder %q, want %s", h, first)
	}
	pending(t, other, answers[other])
	waiters[first].Write(blob)
	if err := waiters[first].Commit(ctx, int64(len(blob)), blobDigest); err != nil {
		t.Fatalf("%s's commit: %v", first, err)
	}
	got = answerOf(t, other, answers[other])
	if got.err != nil || got.st.Offset != int64(len(blob)) {
		t.Fatalf("%s after %s's commit: %+v %v, want the write complete", other, first, got.st, got.err)
	}
	if err := waiters[other].Commit(ctx, int64(len(blob)), blobDigest); err != nil {
		t.Fatal(err)
	}
	waiters[first].Close()
	waiters[other].Close()
	checkIntact(t, e.root, blobDigest)
	if refs := e.refs(blobDigest); len(refs) != 2 {
		t.Fatalf("references: %v, want b and c", refs)
	}
	// a, still cut off, commits what it had: the blob stays intact.
	hole.Heal()
	wa.Write(blob[4:])
	if err := wa.Commit(ctx, int64(len(blob)), blobDigest); err != nil && !errors.Is(err, errdefs.ErrUnavailable) {
		t.Logf("a's late commit: %v", err)
	}
	wa.Close()
	checkIntact(t, e.root, blobDigest)
}

// done puts an answer back in a channel of its own.
func done(a statusAnswer) <-chan statusAnswer {
	ch := make(chan statusAnswer, 1)
	ch <- a
	return ch
}

// TestServerRestartsUnderAWaiter: the dlock server restarts while a
// downloads and b waits in Status. b neither hangs nor is told done
// without the blob; the blob ends up there, intact, and the lock free.
func TestServerRestartsUnderAWaiter(t *testing.T) {
	e := newStoreEnv(t, nil)
	a, b := e.storeVia("a", e.srv.URL()), e.storeVia("b", e.srv.URL())
	k := lock.Key{Type: lock.Pull, Resource: blobDigest.String()}
	ctx := t.Context()
	wa, err := writerFor(ctx, a, blobDigest)
	if err != nil {
		t.Fatal(err)
	}
	defer wa.Close()
	wb, err := writerFor(ctx, b, blobDigest)
	if err != nil {
		t.Fatal(err)
	}
	answer := statusOf(wb)
	e.srv.WaitQueued(t, k, 1)
	e.srv.Restart()
	got := answerOf(t, "b", answer)
	switch {
	case got.err != nil:
		t.Fatalf("b after the restart: %v", got.err)
	case got.st.Offset == int64(len(blob)) && !blobExists(e.root, blobDigest):
		t.Fatal("b told done without the blob")
	case got.st.Offset == 0:
		// b took the lock the restart freed: it downloads.
		wb.Write(blob)
		if err := wb.Commit(ctx, int64(len(blob)), blobDigest); err != nil {
			t.Fatalf("b's commit: %v", err)
		}
	}
	wb.Close()
	// a goes on: its commit finds the blob, or fails as its hold is lost.
	wa.Write(blob)
	err = wa.Commit(ctx, int64(len(blob)), blobDigest)
	t.Logf("a's commit after the restart: %v", err)
	checkIntact(t, e.root, blobDigest)
	kit.WaitFor(t, "the pull lock to be free", func() bool { return e.holder(lock.Pull, blobDigest) == "" })
}

// TestGiveUpAtHandOver: containerd gives up on b's waiting writer at the
// moment a fails and the lock passes to b; containerd then closes the
// writer, as its fetch does. Whichever comes first, the lock ends up free,
// not held by b with nobody writing.
func TestGiveUpAtHandOver(t *testing.T) {
	e := newStoreEnv(t, nil)
	a, b := e.store("a"), e.store("b")
	for i := range 20 {
		d := digest.FromString(fmt.Sprintf("blob %d", i))
		k := lock.Key{Type: lock.Pull, Resource: d.String()}
		wa, err := writerFor(t.Context(), a, d)
		if err != nil {
			t.Fatal(err)
		}
		ctx, giveUp := context.WithCancel(t.Context())
		wb, err := writerFor(ctx, b, d)
		if err != nil {
			t.Fatal(err)
		}
		answer := statusOf(wb)
		e.srv.WaitQueued(t, k, 1)
		var wg sync.WaitGroup
		wg.Go(func() { wa.Close() })
		giveUp()
		wg.Wait()
		answerOf(t, "b", answer)
		wb.Close()
		kit.WaitFor(t, "the pull lock to be free", func() bool { return e.holder(lock.Pull, d) == "" })
	}
}

// TestSharedReadersUnderDelete: many readers of one blob on one node read
// while the node deletes it, commits it anew, and finally closes its
// store: every read returns the blob's bytes, and a read that fails says
// the blob is not there.
func TestSharedReadersUnderDelete(t *testing.T) {
	e := newStoreEnv(t, nil)
	a := e.store("a")
	data := []byte("a layer read by many while it goes and comes back")
	d := commitBlob(t, a, data)
	var wg sync.WaitGroup
	stop := make(chan struct{})
	read := func() error {
		ra, err := a.ReaderAt(t.Context(), ocispec.Descriptor{Digest: d, Size: int64(len(data))})
		if err != nil {
			if errdefs.IsNotFound(err) || errdefs.IsUnavailable(err) {
				return nil
			}
			return err
		}
		defer ra.Close()
		got, err := io.ReadAll(io.NewSectionReader(ra, 0, ra.Size()))
		if err != nil {
			return err
		}
		if string(got) != string(data) {
			return fmt.Errorf("read %q", got)
		}
		return nil
	}
	errs := make(chan error, 8)
	for range 8 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				if err := read(); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	for range 20 {
		// The readers reference the blob again as they open it: the
		// delete removes it only when none did since it released a's.
		if err := a.Delete(t.Context(), d); err != nil {
			t.Fatal(err)
		}
		if !blobExists(e.root, d) {
			commitBlob(t, a, data)
		}
	}
	close(stop)
	wg.Wait()
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}
	// The store closes under an open reader: it reads on, and closes.
	ra, err := a.ReaderAt(t.Context(), ocispec.Descriptor{Digest: d})
	if err != nil {
		t.Fatal(err)
	}
	a.Close()
	buf := make([]byte, len(data))
	if _, err := ra.ReadAt(buf, 0); err != nil || string(buf) != string(data) {
		t.Fatalf("read after the store closed: %q %v", buf, err)
	}
	ra.Close()
}

// TestHandOverToTwoWritersOfOneNode: two writers of node b wait in line
// behind a, which fails. One of b's writers downloads under b's grant, the
// other waits for it and is told done by its commit; a writer closed twice,
// or used after its close, does no harm.
func TestHandOverToTwoWritersOfOneNode(t *testing.T) {
	e := newStoreEnv(t, nil)
	a, b := e.store("a"), e.store("b")
	k := lock.Key{Type: lock.Pull, Resource: blobDigest.String()}
	ctx := t.Context()
	wa, err := writerFor(ctx, a, blobDigest)
	if err != nil {
		t.Fatal(err)
	}
	var ws []content.Writer
	var answers []<-chan statusAnswer
	for _, ref := range []string{"ns1/1/layer-", "ns2/2/layer-"} {
		w, err := b.Writer(ctx, content.WithRef(ref+blobDigest.String()), content.WithDescriptor(ocispec.Descriptor{Size: int64(len(blob))}))
		if err != nil {
			t.Fatal(err)
		}
		ws = append(ws, w)
		answers = append(answers, statusOf(w))
	}
	e.srv.WaitQueued(t, k, 1) // one place in line for the node
	wa.Close()
	wa.Close()
	var mine, other int
	select {
	case got := <-answers[0]:
		mine, other = 0, 1
		answers[0] = done(got)
	case got := <-answers[1]:
		mine, other = 1, 0
		answers[1] = done(got)
	case <-time.After(kit.Patience):
		t.Fatal("neither of b's writers took over")
	}
	if got := <-answers[mine]; got.err != nil || got.st.Offset != 0 {
		t.Fatalf("b's writer that took over: %+v %v", got.st, got.err)
	}
	pending(t, "b's other writer", answers[other])
	if err := ws[mine].Commit(ctx, int64(len(blob)), digest.FromString("not this")); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("a commit of another digest: %v", err)
	}
	if blobExists(e.root, blobDigest) {
		t.Fatal("a failed commit published the blob")
	}
	// The failed commit let b's grant go: the other writer takes over.
	got := answerOf(t, "b's other writer", answers[other])
	if got.err != nil || got.st.Offset != 0 {
		t.Fatalf("b's other writer after the failed commit: %+v %v, want the lock with an empty write", got.st, got.err)
	}
	ws[mine].Close()
	ws[mine].Close()
	if h := e.holder(lock.Pull, blobDigest); h != "b" {
		t.Fatalf("holder %q after b's first writer closed, want b: its other writer writes", h)
	}
	ws[other].Write(blob)
	if err := ws[other].Commit(ctx, int64(len(blob)), blobDigest); err != nil {
		t.Fatal(err)
	}
	ws[other].Close()
	ws[other].Close()
	if _, err := ws[other].Write(blob); err == nil {
		t.Fatal("a write after the commit and close succeeded")
	}
	checkIntact(t, e.root, blobDigest)
	if h := e.holder(lock.Pull, blobDigest); h != "" {
		t.Fatalf("holder %q after the commit", h)
	}
}
