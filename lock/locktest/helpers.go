package locktest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/dlock/dlock/lock"
)

func lockReq(typ lock.Type, res, node string) lock.LockRequest {
	return lock.LockRequest{Type: typ, Resource: res, Node: node}
}

func mustLock(t testing.TB, b lock.Backend, req lock.LockRequest) lock.LockResult {
	t.Helper()
	res, err := b.TryLock(context.Background(), req)
	if err != nil {
		t.Fatalf("TryLock(%v, %s): %v", req.Key(), req.Node, err)
	}
	return res
}

func mustUnlock(t testing.TB, b lock.Backend, typ lock.Type, res, node string, success bool) lock.UnlockResult {
	t.Helper()
	r, err := b.Unlock(context.Background(), lock.UnlockRequest{Type: typ, Resource: res, Node: node, Success: success, Error: errText(success)})
	if err != nil {
		t.Fatalf("Unlock(%v:%s, %s): %v", typ, res, node, err)
	}
	return r
}

func errText(success bool) string {
	if success {
		return ""
	}
	return "failed"
}

func status(t testing.TB, b lock.Backend, typ lock.Type, res, node string) lock.Status {
	t.Helper()
	st, err := b.Status(t.Context(), typ, res, node)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// subscribe opens a stream, closed when the test ends.
func subscribe(t testing.TB, b lock.Backend, node string, observe *lock.Key) lock.Stream {
	t.Helper()
	st, _ := subscribeReq(t, b, lock.SubscribeRequest{Node: node, Observe: observe})
	return st
}

// subscribeReq opens a stream, closed when the test ends, and returns its
// subscription too.
func subscribeReq(t testing.TB, b lock.Backend, req lock.SubscribeRequest) (lock.Stream, lock.Subscription) {
	t.Helper()
	st, sub, err := b.Subscribe(t.Context(), req)
	if err != nil {
		t.Fatalf("Subscribe(%+v): %v", req, err)
	}
	t.Cleanup(st.Close)
	return st, sub
}

// events takes what a stream has received so far, without waiting.
func events(st lock.Stream) []lock.Delivery { return st.Take(nil) }

// expect waits until st has received at least n items, at most EventWait,
// and returns every item it took: more than n when more had arrived, so
// that an exact comparison still sees an extra one.
func expect[T any](t testing.TB, st lock.Feed[T], n int) []T {
	t.Helper()
	got := st.Take(nil)
	if len(got) >= n {
		return got
	}
	timeout := time.NewTimer(EventWait)
	defer timeout.Stop()
	for len(got) < n {
		select {
		case <-st.Ready():
			got = st.Take(got)
		case <-st.Done():
			got = st.Take(got)
			if len(got) < n {
				t.Fatalf("stream ended (slow=%v) after %d of the %d events expected: %s", st.Slow(), len(got), n, describe(got))
			}
		case <-timeout.C:
			t.Fatalf("%d of the %d events expected after %v: %s", len(got), n, EventWait, describe(got))
		}
	}
	return got
}

// describe names the events of a stream or an operator feed.
func describe(items any) string {
	switch v := items.(type) {
	case []lock.Delivery:
		return fmt.Sprint(names(v))
	case []lock.OpEvent:
		return fmt.Sprint(opNames(v))
	}
	return fmt.Sprint(items)
}

func names(ds []lock.Delivery) []string {
	var out []string
	for _, d := range ds {
		out = append(out, d.Event.Name+":"+d.Event.Node)
	}
	return out
}

func ids(ds []lock.Delivery) []uint64 {
	out := make([]uint64, len(ds))
	for i, d := range ds {
		out[i] = d.ID
	}
	return out
}

// increasing reports whether every id is above the one before it.
func increasing(ids []uint64) bool {
	for i := 1; i < len(ids); i++ {
		if ids[i] <= ids[i-1] {
			return false
		}
	}
	return true
}

func refNodes(t testing.TB, b lock.Backend, res string) []string {
	t.Helper()
	rc, err := b.RefCount(t.Context(), res)
	if err != nil {
		t.Fatal(err)
	}
	return rc.Nodes
}
