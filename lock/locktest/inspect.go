package locktest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/dlock/dlock/lock"
)

// The operators' view (lock.Inspector, docs/API.md "GET /ui"), for a
// backend that offers it.

var inspectorTests = []test{
	{name: "Keys", run: testInspectKeys},
	{name: "QueueCapped", run: testInspectQueueCapped},
	{name: "QueueAfterCancels", run: testInspectQueueAfterCancels},
	{name: "RecentCompletions", run: testRecentCompletions},
	{name: "Sessions", run: testInspectSessions},
	{name: "OpFeed", run: testOpFeed},
}

// openInspector opens a backend that must be a lock.Inspector; the test is
// skipped, saying so, when it is not.
func (s *suite) openInspector(t *testing.T, mod func(*Config)) (lock.Backend, lock.Inspector) {
	t.Helper()
	m := s.open(t, mod)
	in, ok := m.(lock.Inspector)
	if !ok {
		t.Skipf("NOT TESTED: %s: the backend (%T) does not implement lock.Inspector, so the server serves no /ui for it", t.Name(), m)
	}
	return m, in
}

func inspect(t testing.TB, in lock.Inspector, q lock.KeyQuery) lock.KeyPage {
	t.Helper()
	p, err := in.InspectKeys(t.Context(), q)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func keyNames(p lock.KeyPage) []string {
	var out []string
	for _, k := range p.Keys {
		out = append(out, k.Key.String())
	}
	slices.Sort(out)
	return out
}

func waiterNames(v lock.KeyView) string {
	var out []string
	for _, w := range v.Queue {
		out = append(out, w.Node)
	}
	return strings.Join(out, " ")
}

func testInspectKeys(t *testing.T, s *suite) {
	m, in := s.openInspector(t, nil)
	mustLock(t, m, lockReq(lock.Pull, "sha256:aa", "h"))
	for _, n := range []string{"w1", "w2", "w3"} {
		mustLock(t, m, lockReq(lock.Pull, "sha256:aa", n))
	}
	mustLock(t, m, lockReq(lock.Update, "sha256:aa", "u"))
	mustLock(t, m, lockReq(lock.Pull, "sha256:bb", "x"))
	mustLock(t, m, lockReq(lock.Pull, "done", "d"))
	mustUnlock(t, m, lock.Pull, "done", "d", true) // free: only a record, not listed

	all := inspect(t, in, lock.KeyQuery{})
	if got := keyNames(all); !slices.Equal(got, []string{"pull:sha256:aa", "pull:sha256:bb", "update:sha256:aa"}) || all.Next != "" {
		t.Fatalf("keys %v next %q", got, all.Next)
	}
	mustUnlock(t, m, lock.Pull, "sha256:aa", "h", false) // hand-off to w1
	p := inspect(t, in, lock.KeyQuery{Resource: "aa", Node: "w3"})
	if len(p.Keys) != 1 {
		t.Fatalf("filtered keys %v", keyNames(p))
	}
	v := p.Keys[0]
	if v.Holder != "w1" || v.Token == 0 || !v.Unclaimed || v.Lease != lock.LeaseTTL || v.AcquiredAt.IsZero() ||
		waiterNames(v) != "w2 w3" || v.QueueLength != 2 || v.LastCompleted == nil || v.LastCompleted.Node != "h" || v.LastCompleted.Success {
		t.Fatalf("view %+v", v)
	}
	for _, c := range []struct {
		q    lock.KeyQuery
		want []string
	}{
		{lock.KeyQuery{Node: "h"}, []string{"pull:sha256:aa"}}, // its last completion
		{lock.KeyQuery{Node: "u"}, []string{"update:sha256:aa"}},
		{lock.KeyQuery{Node: "d"}, nil},
		{lock.KeyQuery{Resource: "bb"}, []string{"pull:sha256:bb"}},
		{lock.KeyQuery{Resource: "sha256:"}, []string{"pull:sha256:aa", "pull:sha256:bb", "update:sha256:aa"}},
		{lock.KeyQuery{Resource: "zz"}, nil},
	} {
		if got := keyNames(inspect(t, in, c.q)); !slices.Equal(got, c.want) {
			t.Errorf("%+v: %v, want %v", c.q, got, c.want)
		}
	}
	if _, err := in.InspectKeys(t.Context(), lock.KeyQuery{Cursor: "bogus!"}); !errors.Is(err, lock.ErrInvalid) {
		t.Fatalf("bad cursor: %v", err)
	}
}

func testInspectQueueCapped(t *testing.T, s *suite) {
	m, in := s.openInspector(t, nil)
	mustLock(t, m, lockReq(lock.Pull, "r", "h"))
	for i := range lock.QueueShown + 10 {
		mustLock(t, m, lockReq(lock.Pull, "r", fmt.Sprint("w", i)))
	}
	v := inspect(t, in, lock.KeyQuery{}).Keys[0]
	if len(v.Queue) != lock.QueueShown || v.QueueLength != lock.QueueShown+10 || v.Queue[0].Node != "w0" || v.Queue[lock.QueueShown-1].Node != fmt.Sprint("w", lock.QueueShown-1) {
		t.Fatalf("queue %d of %d, first %v", len(v.Queue), v.QueueLength, v.Queue[0])
	}
}

// testInspectQueueAfterCancels: waiters that leave from the middle and the
// head do not show, and the rest keep their order. (The memory engine keeps holes in
// its queue's slice; a view that read them as waiters panicked.)
func testInspectQueueAfterCancels(t *testing.T, s *suite) {
	m, in := s.openInspector(t, nil)
	mustLock(t, m, lockReq(lock.Pull, "r", "h"))
	for i := range 5 {
		mustLock(t, m, lockReq(lock.Pull, "r", fmt.Sprint("w", i)))
	}
	for _, n := range []string{"w2", "w0"} {
		if _, err := m.Cancel(t.Context(), lock.Pull, "r", n); err != nil {
			t.Fatal(err)
		}
	}
	v := inspect(t, in, lock.KeyQuery{}).Keys[0]
	if got := waiterNames(v); got != "w1 w3 w4" || v.QueueLength != 3 {
		t.Fatalf("queue %q (%d), want w1 w3 w4 (3)", got, v.QueueLength)
	}
}

func testRecentCompletions(t *testing.T, s *suite) {
	m, in := s.openInspector(t, nil)
	for i := range 5 {
		res := fmt.Sprint("r", i)
		mustLock(t, m, lockReq(lock.Pull, res, fmt.Sprint("n", i%2)))
		mustUnlock(t, m, lock.Pull, res, fmt.Sprint("n", i%2), i != 3)
	}
	got, err := in.RecentCompletions(t.Context(), lock.KeyQuery{Limit: 3})
	if err != nil {
		t.Fatal(err)
	}
	var order []string
	for _, c := range got {
		order = append(order, fmt.Sprintf("%s:%s:%v", c.Key.Resource, c.Node, c.Success))
	}
	if want := "r4:n0:true r3:n1:false r2:n0:true"; strings.Join(order, " ") != want {
		t.Fatalf("completions %v, want %s", order, want)
	}
	got, _ = in.RecentCompletions(t.Context(), lock.KeyQuery{Node: "n1"})
	if len(got) != 2 || got[0].Key.Resource != "r3" || got[1].Key.Resource != "r1" {
		t.Fatalf("node filter: %+v", got)
	}
	got, _ = in.RecentCompletions(t.Context(), lock.KeyQuery{Resource: "2"})
	if len(got) != 1 || got[0].Key.Resource != "r2" {
		t.Fatalf("resource filter: %+v", got)
	}
}

func testInspectSessions(t *testing.T, s *suite) {
	m, in := s.openInspector(t, noGrace)
	var streams []lock.Stream
	for i := range 7 {
		streams = append(streams, subscribe(t, m, fmt.Sprint("node-", i), nil))
	}
	subscribe(t, m, "node-0", nil)
	mustLock(t, m, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "node-0", Lease: lock.LeaseSession})
	mustLock(t, m, lock.LockRequest{Type: lock.Pull, Resource: "r", Node: "node-1", Lease: lock.LeaseSession})
	streams[6].Close()
	var seen []lock.SessionView
	cursor := ""
	for {
		p, err := in.InspectSessions(t.Context(), lock.SessionQuery{Cursor: cursor, Limit: 3})
		if err != nil {
			t.Fatal(err)
		}
		if len(p.Sessions) > 3 || p.Total != 7 {
			t.Fatalf("page %+v", p)
		}
		seen = append(seen, p.Sessions...)
		if cursor = p.Next; cursor == "" {
			break
		}
	}
	if len(seen) != 7 || seen[0] != (lock.SessionView{Node: "node-0", Streams: 2, Keys: 1}) ||
		seen[1] != (lock.SessionView{Node: "node-1", Streams: 1, Keys: 1}) || seen[6] != (lock.SessionView{Node: "node-6", InGrace: true}) {
		t.Fatalf("sessions %+v", seen)
	}
	p, _ := in.InspectSessions(t.Context(), lock.SessionQuery{Node: "-5"})
	if len(p.Sessions) != 1 || p.Sessions[0].Node != "node-5" || p.Next != "" {
		t.Fatalf("filtered %+v", p)
	}
}

func opNames(evs []lock.OpEvent) []string {
	var out []string
	for _, ev := range evs {
		switch {
		case ev.Event != nil:
			out = append(out, ev.Event.Name+":"+ev.Event.Node)
		case ev.Session.Ended:
			out = append(out, "session_ended:"+ev.Session.Node)
		default:
			out = append(out, fmt.Sprintf("session:%s:%d", ev.Session.Node, ev.Session.Streams))
		}
	}
	return out
}

// testOpFeed: the operator feed reports every transition of a key in
// order, queue joins and leaves included, and session changes.
func testOpFeed(t *testing.T, s *suite) {
	m, in := s.openInspector(t, noGrace)
	ops, err := in.WatchOps(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ops.Close)
	mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	mustLock(t, m, lockReq(lock.Pull, "r", "b"))
	mustLock(t, m, lockReq(lock.Pull, "r", "c"))
	if _, err := m.Cancel(context.Background(), lock.Pull, "r", "c"); err != nil {
		t.Fatal(err)
	}
	mustUnlock(t, m, lock.Pull, "r", "a", false)
	mustLock(t, m, lockReq(lock.Pull, "r", "d"))
	mustUnlock(t, m, lock.Pull, "r", "b", true)
	st := subscribe(t, m, "n", nil)
	st.Close()
	want := "lock_assigned:a queue_joined:b queue_joined:c queue_left:c lock_assigned:b operation_completed:a " +
		"queue_joined:d operation_completed:b session:n:1 session:n:0"
	if got := strings.Join(opNames(expect(t, ops, len(strings.Fields(want)))), " "); got != want {
		t.Fatalf("feed\n got %s\nwant %s", got, want)
	}
}
