package locktest

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/dlock/dlock/lock"
)

// Types besides pull, update and delete (docs/DESIGN.md, "Other types"):
// the seeds' content layer locks its blobs as image-layer. Such a type has
// pull's rules — a success tells the waiters to skip, a failure hands the key
// on in FIFO order with a new token — and no reference rules.

var typeTests = []test{
	{name: "PullRules", run: testOtherTypePullRules},
	{name: "MultiNodeDownloadOff", run: testOtherTypeMultiNodeDownloadOff},
	{name: "SkipRecent", run: testOtherTypeSkipRecent},
	{name: "NoReferenceRules", run: testOtherTypeNoRefs},
	{name: "Replay", run: testOtherTypeReplay},
	{name: "InspectOrder", run: testOtherTypeInspectOrder},
}

// otherType is a type name no built-in one, parsed as a server parses a
// request's.
func otherType(t testing.TB, name string) lock.Type {
	t.Helper()
	typ, err := lock.ParseType(name)
	if err != nil {
		t.Fatalf("ParseType(%q): %v", name, err)
	}
	if typ.Builtin() || typ.String() != name {
		t.Fatalf("ParseType(%q) = %v", name, typ)
	}
	return typ
}

// testOtherTypePullRules walks a key of another type through pull's rules:
// grant, FIFO queue, a failure handed to the head with a new token, a
// success that tells every waiter; for the seeds' image-layer and for a
// name of the longest length.
func testOtherTypePullRules(t *testing.T, s *suite) {
	for _, name := range []string{"image-layer", strings.Repeat("z9", lock.MaxTypeLen/2)} {
		t.Run(name, func(t *testing.T) {
			typ := otherType(t, name)
			m := s.open(t, nil)
			k := lock.Key{Type: typ, Resource: "sha256:aa"}
			obs := subscribe(t, m, "", &k)
			sb := subscribe(t, m, "b", nil)
			sc := subscribe(t, m, "c", nil)
			a := mustLock(t, m, lockReq(typ, k.Resource, "a"))
			if !a.Acquired || a.Token == 0 || a.Holder != "a" {
				t.Fatalf("free key: %+v, want acquired", a)
			}
			b := mustLock(t, m, lockReq(typ, k.Resource, "b"))
			c := mustLock(t, m, lockReq(typ, k.Resource, "c"))
			if !b.Queued || b.Position != 1 || b.Holder != "a" || !c.Queued || c.Position != 2 {
				t.Fatalf("waiters: b=%+v c=%+v, want queued at 1 and 2", b, c)
			}
			// The other keys of the resource are not this one.
			for _, other := range []lock.Type{lock.Pull, lock.Update, lock.Delete} {
				if r := mustLock(t, m, lockReq(other, k.Resource, "z")); !r.Acquired {
					t.Fatalf("%v of the resource: %+v, want acquired", other, r)
				}
			}
			if got := mustUnlock(t, m, typ, k.Resource, "a", false); got.NextHolder != "b" {
				t.Fatalf("failure: next holder %q, want b", got.NextHolder)
			}
			st := status(t, m, typ, k.Resource, "c")
			if st.Key != k || st.Holder != "b" || st.Token <= a.Token || st.QueueLength != 1 || st.Position != 1 {
				t.Fatalf("after the failure: %+v, want b holding with a newer token than %d, c next", st, a.Token)
			}
			if lc := st.LastCompleted; lc == nil || lc.Node != "a" || lc.Success || lc.Token != a.Token {
				t.Fatalf("completion record %+v", st.LastCompleted)
			}
			bGot := expect(t, sb, 1)
			if bGot[0].Event.Name != lock.EventLockAssigned || bGot[0].Event.Key != k || bGot[0].Event.Token != st.Token {
				t.Fatalf("b was told %v (%+v), want lock_assigned of %v", names(bGot), bGot[0].Event.Key, k)
			}
			again := mustLock(t, m, lockReq(typ, k.Resource, "b")) // confirms the hand-off
			if !again.Acquired || again.Token != st.Token {
				t.Fatalf("b confirms: %+v, want token %d", again, st.Token)
			}
			if got := mustUnlock(t, m, typ, k.Resource, "b", true); got.NextHolder != "" {
				t.Fatalf("success: next holder %q, want none", got.NextHolder)
			}
			st = status(t, m, typ, k.Resource, "c")
			if st.Held || st.QueueLength != 0 || st.Position != 0 || st.LastCompleted == nil || !st.LastCompleted.Success {
				t.Fatalf("after the success: %+v, want free, no waiters, a success recorded", st)
			}
			cGot := expect(t, sc, 1)
			if ev := cGot[0].Event; ev.Name != lock.EventOperationCompleted || ev.Key != k || !ev.Success || ev.Node != "b" {
				t.Fatalf("c was told %v, want operation_completed{success} of b", names(cGot))
			}
			want := []string{"lock_assigned:a", "lock_assigned:b", "operation_completed:a", "operation_completed:b"}
			got := expect(t, obs, len(want))
			if !slices.Equal(names(got), want) {
				t.Fatalf("observer saw %v, want %v", names(got), want)
			}
			for _, d := range got {
				if d.Event.Key != k {
					t.Fatalf("observer event of %v, want %v", d.Event.Key, k)
				}
			}
			if r := mustLock(t, m, lockReq(typ, k.Resource, "d")); !r.Acquired || r.Token <= st.Token {
				t.Fatalf("after the success: %+v, want a grant with a token above %d", r, st.Token)
			}
		})
	}
}

func testOtherTypeMultiNodeDownloadOff(t *testing.T, s *suite) {
	typ := otherType(t, "image-layer")
	m := s.open(t, func(c *Config) { c.AllowMultiNodeDownload = false })
	mustLock(t, m, lockReq(typ, "r", "a"))
	_, err := m.TryLock(context.Background(), lockReq(typ, "r", "b"))
	if he, ok := errors.AsType[*lock.HeldError](err); !ok || he.Holder != "a" || !errors.Is(err, lock.ErrLockHeld) {
		t.Fatalf("got %v, want ErrLockHeld by a", err)
	}
	if st := status(t, m, typ, "r", ""); st.QueueLength != 0 {
		t.Fatalf("refused node was queued: %+v", st)
	}
}

// testOtherTypeSkipRecent: skip_recent skips a recent success of another
// type as of a pull, and no success of one type erases another's record:
// pull and delete are each other's opposites, other types have none.
func testOtherTypeSkipRecent(t *testing.T, s *suite) {
	typ := otherType(t, "image-layer")
	m := s.open(t, nil)
	mustLock(t, m, lockReq(typ, "r", "a"))
	mustUnlock(t, m, typ, "r", "a", true)
	if res := mustLock(t, m, lock.LockRequest{Type: typ, Resource: "r", Node: "b", SkipRecent: true}); !res.Skip {
		t.Fatalf("after a recent success with skip_recent: %+v, want skip", res)
	}
	mustLock(t, m, lockReq(lock.Delete, "r", "d"))
	mustUnlock(t, m, lock.Delete, "r", "d", true)
	if res := mustLock(t, m, lock.LockRequest{Type: typ, Resource: "r", Node: "b", SkipRecent: true}); !res.Skip {
		t.Fatalf("after a delete's success: %+v, want skip (its record is kept)", res)
	}
	mustLock(t, m, lockReq(typ, "s", "a"))
	mustLock(t, m, lockReq(lock.Delete, "s", "d"))
	mustUnlock(t, m, lock.Delete, "s", "d", true)
	mustUnlock(t, m, typ, "s", "a", true)
	if st := status(t, m, lock.Delete, "s", ""); st.LastCompleted == nil || st.LastCompleted.Node != "d" {
		t.Fatalf("the delete's record after another type's success: %+v, want kept", st.LastCompleted)
	}
}

// testOtherTypeNoRefs: with reference counting on (and
// update_requires_no_ref), another type is refused neither by references
// nor by a held delete or update, refuses no delete, is never refused at
// promotion, and its success references nobody: where a pull would be
// refused, it is not.
func testOtherTypeNoRefs(t *testing.T, s *suite) {
	ctx := context.Background()
	typ := otherType(t, "image-layer")
	m := s.open(t, refConfig(true))
	mustLock(t, m, lockReq(typ, "r", "a"))
	mustLock(t, m, lockReq(typ, "r", "b"))
	if r := mustLock(t, m, lockReq(lock.Delete, "r", "d")); !r.Acquired {
		t.Fatalf("delete while an image-layer is held: %+v, want acquired", r)
	}
	if _, err := m.TryLock(ctx, lockReq(lock.Pull, "r", "p")); !errors.Is(err, lock.ErrDeleting) {
		t.Fatalf("pull while deleting: %v, want ErrDeleting", err)
	}
	if r := mustLock(t, m, lockReq(typ, "r", "c")); !r.Queued || r.Position != 2 {
		t.Fatalf("image-layer while deleting: %+v, want queued behind b", r)
	}
	mustUnlock(t, m, typ, "r", "a", true)
	if got := refNodes(t, m, "r"); len(got) != 0 {
		t.Fatalf("an image-layer success referenced %v", got)
	}
	mustUnlock(t, m, lock.Delete, "r", "d", true)

	if _, err := m.RefAdd(ctx, "s", "x"); err != nil {
		t.Fatal(err)
	}
	if r := mustLock(t, m, lockReq(typ, "s", "a")); !r.Acquired {
		t.Fatalf("image-layer of a referenced resource: %+v, want acquired", r)
	}
	mustLock(t, m, lockReq(typ, "s", "b"))
	if got := mustUnlock(t, m, typ, "s", "a", false); got.NextHolder != "b" {
		t.Fatalf("hand-off of a referenced resource's image-layer: next %q, want b (never refused at promotion)", got.NextHolder)
	}
	if got := refNodes(t, m, "s"); !slices.Equal(got, []string{"x"}) {
		t.Fatalf("references of s: %v, want x alone", got)
	}

	mustLock(t, m, lockReq(lock.Update, "u", "u"))
	if _, err := m.TryLock(ctx, lockReq(lock.Pull, "u", "p")); !errors.Is(err, lock.ErrUpdating) {
		t.Fatalf("pull while updating with update_requires_no_ref: %v, want ErrUpdating", err)
	}
	if r := mustLock(t, m, lockReq(typ, "u", "a")); !r.Acquired {
		t.Fatalf("image-layer while updating: %+v, want acquired", r)
	}
}

// testOtherTypeReplay: a session's events of another type replay with
// their type after a reconnect (the memory engine keeps its own grants in
// a compact form, with a template per type).
func testOtherTypeReplay(t *testing.T, s *suite) {
	typ := otherType(t, "image-layer")
	m := s.open(t, noGrace)
	st, sub, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: "b"})
	if err != nil {
		t.Fatal(err)
	}
	mustLock(t, m, lockReq(typ, "r", "a"))
	mustLock(t, m, lockReq(typ, "r", "b"))
	mustLock(t, m, lockReq(typ, "s", "a"))
	mustLock(t, m, lockReq(typ, "s", "b"))
	st.Close()
	mustUnlock(t, m, typ, "r", "a", false) // b gets r while disconnected
	mustUnlock(t, m, typ, "s", "a", true)  // s done while disconnected
	st2, sub2, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: "b", LastID: sub.ID, HasLast: true})
	if err != nil {
		t.Fatal(err)
	}
	defer st2.Close()
	got := sub2.Replay
	if want := []string{"lock_assigned:b", "operation_completed:a"}; !slices.Equal(names(got), want) {
		t.Fatalf("replayed %v, want %v", names(got), want)
	}
	if k := got[0].Event.Key; k != (lock.Key{Type: typ, Resource: "r"}) {
		t.Fatalf("replayed grant of %v, want image-layer:r", k)
	}
	if k := got[1].Event.Key; k != (lock.Key{Type: typ, Resource: "s"}) || !got[1].Event.Success {
		t.Fatalf("replayed completion of %v, want a success of image-layer:s", k)
	}
}

// testOtherTypeInspectOrder: the operators' view walks the keys of one
// resource in the same order in every process, built-in types first, then
// the others by name, whatever numbers the process gave them; a page at a
// time from its cursors it meets each once.
func testOtherTypeInspectOrder(t *testing.T, s *suite) {
	m, in := s.openInspector(t, nil)
	zz, aa := otherType(t, "zz-last"), otherType(t, "aa-first")
	typs := []lock.Type{zz, lock.Delete, aa, lock.Pull, lock.Update}
	for _, typ := range typs {
		mustLock(t, m, lockReq(typ, "r", "h"))
	}
	var got []string
	cursor := ""
	for range len(typs) + 1 {
		p := inspect(t, in, lock.KeyQuery{Cursor: cursor, Limit: 2})
		for _, v := range p.Keys {
			got = append(got, v.Key.String())
		}
		if cursor = p.Next; cursor == "" {
			break
		}
	}
	want := []string{"pull:r", "update:r", "delete:r", "aa-first:r", "zz-last:r"}
	if !slices.Equal(got, want) {
		t.Fatalf("pages of 2 walk %v, want %v", got, want)
	}
}
