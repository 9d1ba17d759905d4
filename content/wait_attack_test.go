package content

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/lock"
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
