package locktest

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/dlock/dlock/lock"
)

// The lock manager's rules (docs/DESIGN.md, "Lock manager"): TryLock,
// Unlock, Cancel, skip_recent, completion records and fencing tokens.

var rulesTests = []test{
	{name: "TryLock", run: testTryLockRules},
	{name: "MultiNodeDownloadOff", run: testMultiNodeDownloadOff},
	{name: "Unlock", run: testUnlockRules},
	{name: "UnlockErrors", run: testUnlockErrors},
	{name: "UnlockReplay", run: testUnlockReplay},
	{name: "Cancel", run: testCancel},
	{name: "SkipRecent", run: testSkipRecent},
	{name: "SkipRecentRetention", fakeTime: true, run: testSkipRecentRetention},
	{name: "Tokens", run: testTokensIncrease},
	{name: "CompletionRecords", fakeTime: true, run: testCompletionRecords},
	{name: "Validation", run: testValidation},
	{name: "Info", run: testInfo},
	{name: "Close", run: testClose},
}

func testTryLockRules(t *testing.T, s *suite) {
	m := s.open(t, nil)
	obs := subscribe(t, m, "", &lock.Key{Type: lock.Pull, Resource: "r"})
	a := mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	if !a.Acquired || a.Queued || a.Skip || a.Token == 0 || a.Holder != "a" {
		t.Fatalf("free key: got %+v, want acquired with a token", a)
	}
	again := mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	if !again.Acquired || again.Token != a.Token {
		t.Fatalf("re-lock by the holder: got %+v, want the same grant %d", again, a.Token)
	}
	b := mustLock(t, m, lockReq(lock.Pull, "r", "b"))
	c := mustLock(t, m, lockReq(lock.Pull, "r", "c"))
	if !b.Queued || b.Acquired || b.Position != 1 || b.Holder != "a" || !c.Queued || c.Position != 2 {
		t.Fatalf("held key: got b=%+v c=%+v, want queued at 1 and 2", b, c)
	}
	if b2 := mustLock(t, m, lockReq(lock.Pull, "r", "b")); !b2.Queued || b2.Position != 1 {
		t.Fatalf("re-lock by a waiter: got %+v, want position 1", b2)
	}
	if st := status(t, m, lock.Pull, "r", "c"); st.QueueLength != 2 || st.Position != 2 {
		t.Fatalf("no duplicate queue entries: status %+v", st)
	}
	if st := status(t, m, lock.Pull, "r", "a"); !st.Held || st.Holder != "a" || st.Token != a.Token || st.AcquiredAt.IsZero() || st.Position != 0 {
		t.Fatalf("status of the held key: %+v", st)
	}
	// A re-lock by the holder is no new grant: one lock_assigned in all.
	if got := names(expect(t, obs, 1)); !slices.Equal(got, []string{"lock_assigned:a"}) {
		t.Fatalf("observer saw %v, want one lock_assigned (a re-lock sends no event)", got)
	}
	// Other types of the same resource are independent.
	if u := mustLock(t, m, lockReq(lock.Update, "r", "b")); !u.Acquired {
		t.Fatalf("update of a pulled resource: got %+v, want acquired", u)
	}
	if st := status(t, m, lock.Delete, "r", ""); st.Held || st.Holder != "" || st.Token != 0 || st.QueueLength != 0 || st.LastCompleted != nil {
		t.Fatalf("a key never asked for: %+v, want free with no token", st)
	}
}

func testMultiNodeDownloadOff(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.AllowMultiNodeDownload = false })
	mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	_, err := m.TryLock(context.Background(), lockReq(lock.Pull, "r", "b"))
	var he *lock.HeldError
	if !errors.Is(err, lock.ErrLockHeld) || !errors.As(err, &he) || he.Holder != "a" {
		t.Fatalf("got %v, want ErrLockHeld by a", err)
	}
	if st := status(t, m, lock.Pull, "r", ""); st.QueueLength != 0 {
		t.Fatalf("refused node was queued: %+v", st)
	}
}

func testUnlockRules(t *testing.T, s *suite) {
	tests := []struct {
		name      string
		typ       lock.Type
		success   bool
		wantNext  string
		wantQueue int
	}{
		{"pull success clears the queue", lock.Pull, true, "", 0},
		{"delete success clears the queue", lock.Delete, true, "", 0},
		{"update success hands off", lock.Update, true, "b", 1},
		{"pull failure hands off", lock.Pull, false, "b", 1},
		{"delete failure hands off", lock.Delete, false, "b", 1},
		{"update failure hands off", lock.Update, false, "b", 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := s.open(t, nil)
			sb := subscribe(t, m, "b", nil)
			sc := subscribe(t, m, "c", nil)
			obs := subscribe(t, m, "", &lock.Key{Type: tc.typ, Resource: "r"})
			a := mustLock(t, m, lock.LockRequest{Type: tc.typ, Resource: "r", Node: "a", Lease: lock.LeaseTTL})
			mustLock(t, m, lockReq(tc.typ, "r", "b"))
			mustLock(t, m, lockReq(tc.typ, "r", "c"))
			got := mustUnlock(t, m, tc.typ, "r", "a", tc.success)
			if got.NextHolder != tc.wantNext || got.Replayed {
				t.Fatalf("unlock %+v, want next holder %q", got, tc.wantNext)
			}
			st := status(t, m, tc.typ, "r", "")
			if st.QueueLength != tc.wantQueue || st.Holder != tc.wantNext || st.Held != (tc.wantNext != "") {
				t.Fatalf("status after unlock: %+v", st)
			}
			if lc := st.LastCompleted; lc == nil || lc.Node != "a" || lc.Success != tc.success || lc.Token != a.Token || lc.Error != errText(tc.success) || lc.CompletedAt.IsZero() {
				t.Fatalf("completion record %+v", st.LastCompleted)
			}
			if tc.wantNext == "" {
				if st.Token != a.Token {
					t.Fatalf("free key's token %d, want the last issued %d", st.Token, a.Token)
				}
				for _, es := range [][]lock.Delivery{expect(t, sb, 1), expect(t, sc, 1)} {
					if len(es) != 1 || es[0].Event.Name != lock.EventOperationCompleted || !es[0].Event.Success || es[0].Event.Node != "a" {
						t.Fatalf("waiter events %v, want one operation_completed{success} of a", names(es))
					}
				}
				if want := []string{"lock_assigned:a", "operation_completed:a"}; !slices.Equal(names(expect(t, obs, 2)), want) {
					t.Fatalf("observer events, want %v", want)
				}
				return
			}
			eb := expect(t, sb, 1)
			if len(eb) != 1 || eb[0].Event.Name != lock.EventLockAssigned || eb[0].Event.Token <= a.Token || eb[0].Event.Key != (lock.Key{Type: tc.typ, Resource: "r"}) {
				t.Fatalf("new holder's events %v, want lock_assigned with a newer token", names(eb))
			}
			if st.Token != eb[0].Event.Token {
				t.Fatalf("status token %d, the grant's event says %d", st.Token, eb[0].Event.Token)
			}
			eo := expect(t, obs, 3)
			want := []string{"lock_assigned:a", "lock_assigned:b", "operation_completed:a"}
			if !slices.Equal(names(eo), want) {
				t.Fatalf("observer events %v, want %v (lock_assigned before operation_completed)", names(eo), want)
			}
			if done := eo[2].Event; done.NextHolder != "b" || done.Success != tc.success {
				t.Fatalf("operation_completed %+v", done)
			}
			if ec := events(sc); len(ec) != 0 {
				t.Fatalf("second waiter got %v, want nothing (one waiter is woken, not the herd)", names(ec))
			}
		})
	}
}

func testUnlockErrors(t *testing.T, s *suite) {
	ctx := context.Background()
	m := s.open(t, nil)
	a := mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	mustLock(t, m, lockReq(lock.Pull, "r", "b"))
	if _, err := m.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: "r", Node: "b", Success: true}); !errors.Is(err, lock.ErrNotHolder) {
		t.Fatalf("unlock by a waiter: %v, want ErrNotHolder", err)
	}
	if _, err := m.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: "nothing", Node: "a", Success: true}); !errors.Is(err, lock.ErrNotHolder) {
		t.Fatalf("unlock of a free key: %v, want ErrNotHolder", err)
	}
	if _, err := m.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: "r", Node: "a", Success: true, Token: a.Token - 1}); !errors.Is(err, lock.ErrStaleToken) {
		t.Fatalf("unlock with an old token: %v, want ErrStaleToken", err)
	}
	if st := status(t, m, lock.Pull, "r", ""); st.Holder != "a" || st.QueueLength != 1 {
		t.Fatalf("a refused unlock changed state: %+v", st)
	}
	// The holder check comes before the token check.
	if _, err := m.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: "r", Node: "b", Token: 1}); !errors.Is(err, lock.ErrNotHolder) {
		t.Fatalf("unlock by a non-holder with a bad token: %v, want ErrNotHolder", err)
	}
	if _, err := m.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: "r", Node: "a", Success: false, Error: "x", Token: a.Token}); err != nil {
		t.Fatal(err)
	}
}

func testUnlockReplay(t *testing.T, s *suite) {
	ctx := context.Background()
	m := s.open(t, nil)
	a := mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	mustLock(t, m, lockReq(lock.Pull, "r", "b"))
	first, err := m.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: "r", Node: "a", Error: "boom", Token: a.Token})
	if err != nil || first.NextHolder != "b" || first.Replayed {
		t.Fatalf("first unlock: %+v %v", first, err)
	}
	again, err := m.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: "r", Node: "a", Error: "boom", Token: a.Token})
	if err != nil || !again.Replayed || again.NextHolder != "b" {
		t.Fatalf("repeated unlock: %+v %v, want replayed with next holder b", again, err)
	}
	if st := status(t, m, lock.Pull, "r", ""); st.Holder != "b" {
		t.Fatalf("a replay changed state: %+v", st)
	}
	// Without a token the repeat is recognised too.
	if r, err := m.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: "r", Node: "a", Error: "boom"}); err != nil || !r.Replayed {
		t.Fatalf("repeat without a token: %+v %v, want replayed", r, err)
	}
	if _, err := m.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: "r", Node: "a", Success: true}); !errors.Is(err, lock.ErrNotHolder) {
		t.Fatalf("repeat with another outcome: %v, want ErrNotHolder", err)
	}
	if _, err := m.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: "r", Node: "a", Token: a.Token + 5}); !errors.Is(err, lock.ErrNotHolder) {
		t.Fatalf("repeat with another token: %v, want ErrNotHolder", err)
	}
	// Cancel by the holder is not an unlock: a late unlock is not replayed.
	mustLock(t, m, lockReq(lock.Pull, "s", "a"))
	if res, _ := m.Cancel(ctx, lock.Pull, "s", "a"); !res.Released {
		t.Fatalf("cancel by holder: %+v", res)
	}
	if _, err := m.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: "s", Node: "a", Error: "cancelled"}); !errors.Is(err, lock.ErrNotHolder) {
		t.Fatalf("unlock after the server released the hold: %v, want ErrNotHolder", err)
	}
}

func testCancel(t *testing.T, s *suite) {
	ctx := context.Background()
	m := s.open(t, nil)
	mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	mustLock(t, m, lockReq(lock.Pull, "r", "b"))
	mustLock(t, m, lockReq(lock.Pull, "r", "c"))
	if res, err := m.Cancel(ctx, lock.Pull, "r", "b"); err != nil || !res.Dequeued || res.Released {
		t.Fatalf("cancel waiter: %+v %v", res, err)
	}
	if st := status(t, m, lock.Pull, "r", "c"); st.Position != 1 {
		t.Fatalf("after cancel c is at %d, want 1", st.Position)
	}
	res, err := m.Cancel(ctx, lock.Pull, "r", "a")
	if err != nil || !res.Released || res.Dequeued {
		t.Fatalf("cancel holder: %+v %v", res, err)
	}
	st := status(t, m, lock.Pull, "r", "")
	if st.Holder != "c" || st.LastCompleted == nil || st.LastCompleted.Error != "cancelled" || st.LastCompleted.Success || st.LastCompleted.Node != "a" {
		t.Fatalf("cancel by holder must hand off as a failure: %+v %+v", st, st.LastCompleted)
	}
	if res, err := m.Cancel(ctx, lock.Pull, "r", "zz"); err != nil || res.Dequeued || res.Released {
		t.Fatalf("cancel by a stranger: %+v %v", res, err)
	}
	if res, err := m.Cancel(ctx, lock.Pull, "never", "zz"); err != nil || res.Dequeued || res.Released {
		t.Fatalf("cancel of a key without state: %+v %v", res, err)
	}
}

func skipReq(typ lock.Type, node string) lock.LockRequest {
	return lock.LockRequest{Type: typ, Resource: "r", Node: node, SkipRecent: true}
}

func testSkipRecent(t *testing.T, s *suite) {
	m := s.open(t, nil)
	mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	mustUnlock(t, m, lock.Pull, "r", "a", true)
	if res := mustLock(t, m, skipReq(lock.Pull, "b")); !res.Skip || res.Acquired || res.Queued || res.Token != 0 {
		t.Fatalf("pull after a recent success with skip_recent: %+v, want skip", res)
	}
	if st := status(t, m, lock.Pull, "r", ""); st.Held {
		t.Fatalf("a skip granted the key: %+v", st)
	}
	if res := mustLock(t, m, lockReq(lock.Pull, "r", "b")); !res.Acquired {
		t.Fatalf("without skip_recent: %+v, want acquired", res)
	}
	// skip_recent applies to a free key only: a held one queues.
	if res := mustLock(t, m, skipReq(lock.Pull, "q")); !res.Queued || res.Skip {
		t.Fatalf("skip_recent on a held key: %+v, want queued", res)
	}
	if _, err := m.Cancel(context.Background(), lock.Pull, "r", "q"); err != nil {
		t.Fatal(err)
	}
	mustUnlock(t, m, lock.Pull, "r", "b", false)
	if res := mustLock(t, m, skipReq(lock.Pull, "c")); !res.Acquired {
		t.Fatalf("after a failure: %+v, want acquired", res)
	}
	mustUnlock(t, m, lock.Pull, "r", "c", true)
	// A successful delete erases the pull record, and the other way round.
	mustLock(t, m, lockReq(lock.Delete, "r", "d"))
	mustUnlock(t, m, lock.Delete, "r", "d", true)
	if res := mustLock(t, m, skipReq(lock.Pull, "e")); !res.Acquired {
		t.Fatalf("pull after a delete: %+v, want acquired", res)
	}
	mustUnlock(t, m, lock.Pull, "r", "e", true)
	if res := mustLock(t, m, skipReq(lock.Delete, "f")); !res.Acquired {
		t.Fatalf("delete after a pull: %+v, want acquired", res)
	}
	mustUnlock(t, m, lock.Delete, "r", "f", false)
	// Updates are never skipped.
	mustLock(t, m, lockReq(lock.Update, "r", "u"))
	mustUnlock(t, m, lock.Update, "r", "u", true)
	if res := mustLock(t, m, skipReq(lock.Update, "v")); !res.Acquired {
		t.Fatalf("update with skip_recent: %+v, want acquired", res)
	}
}

// testSkipRecentRetention: a success is skipped only while its record is
// retained.
func testSkipRecentRetention(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.CompletedRetention = time.Minute })
	mustLock(t, m, lockReq(lock.Delete, "r", "a"))
	mustUnlock(t, m, lock.Delete, "r", "a", true)
	time.Sleep(59 * time.Second)
	if res := mustLock(t, m, skipReq(lock.Delete, "b")); !res.Skip {
		t.Fatalf("within the retention: %+v, want skip", res)
	}
	time.Sleep(2 * time.Second)
	if res := mustLock(t, m, skipReq(lock.Delete, "b")); !res.Acquired {
		t.Fatalf("after the retention: %+v, want acquired", res)
	}
}

func testTokensIncrease(t *testing.T, s *suite) {
	m := s.open(t, nil)
	var last uint64
	for i := range 50 {
		node := string(rune('a' + i%3))
		r := mustLock(t, m, lockReq(lock.Pull, "r", node))
		if r.Token <= last {
			t.Fatalf("token %d after %d", r.Token, last)
		}
		last = r.Token
		mustUnlock(t, m, lock.Pull, "r", node, i%2 == 0)
	}
	// A restart still never goes back.
	m = s.restart(t, m, nil)
	if r := mustLock(t, m, lockReq(lock.Pull, "r", "a")); r.Token <= last {
		t.Fatalf("token after restart %d, before %d", r.Token, last)
	}
}

func testCompletionRecords(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.ExactLimits = true; c.CompletedMax = 3; c.CompletedRetention = time.Minute })
	for _, r := range []string{"r1", "r2", "r3", "r4"} {
		mustLock(t, m, lockReq(lock.Pull, r, "a"))
		mustUnlock(t, m, lock.Pull, r, "a", true)
	}
	if st := status(t, m, lock.Pull, "r1", ""); st.LastCompleted != nil {
		t.Fatalf("oldest record kept beyond completed_max: %+v", st.LastCompleted)
	}
	if st := status(t, m, lock.Pull, "r4", ""); st.LastCompleted == nil {
		t.Fatal("newest record dropped")
	}
	// r2 is now the oldest; r3 completes again, then r5: r2 goes, r3 stays.
	time.Sleep(time.Second)
	mustLock(t, m, lockReq(lock.Pull, "r3", "b"))
	mustUnlock(t, m, lock.Pull, "r3", "b", true)
	mustLock(t, m, lockReq(lock.Pull, "r5", "a"))
	mustUnlock(t, m, lock.Pull, "r5", "a", true)
	if st := status(t, m, lock.Pull, "r2", ""); st.LastCompleted != nil {
		t.Fatalf("oldest record r2 kept: %+v", st.LastCompleted)
	}
	if st := status(t, m, lock.Pull, "r3", ""); st.LastCompleted == nil || st.LastCompleted.Node != "b" {
		t.Fatalf("a key completed again lost its new record: %+v", st.LastCompleted)
	}
	if n := m.Stats().Keys; n != 3 {
		t.Fatalf("%d keys kept, want 3 (r3, r4, r5)", n)
	}
	time.Sleep(time.Minute)
	if st := status(t, m, lock.Pull, "r4", ""); st.LastCompleted != nil {
		t.Fatalf("record kept beyond completed_retention: %+v", st.LastCompleted)
	}
}

func testValidation(t *testing.T, s *suite) {
	m := s.open(t, nil)
	ctx := context.Background()
	long := string(make([]byte, lock.MaxResourceLen+1))
	bad := []lock.LockRequest{
		{Type: 0, Resource: "r", Node: "a"},
		{Type: lock.Pull, Resource: "", Node: "a"},
		{Type: lock.Pull, Resource: "r", Node: ""},
		{Type: lock.Pull, Resource: "r\n", Node: "a"},
		{Type: lock.Pull, Resource: "r", Node: "a\x00"},
		{Type: lock.Pull, Resource: long, Node: "a"},
		{Type: lock.Pull, Resource: "\xff", Node: "a"},
		{Type: lock.Pull, Resource: "r", Node: "a", Lease: lock.LeaseTTL + 1},
	}
	for _, req := range bad {
		if _, err := m.TryLock(ctx, req); !errors.Is(err, lock.ErrInvalid) {
			t.Errorf("TryLock(%+v) = %v, want ErrInvalid", req, err)
		}
		if _, err := m.Unlock(ctx, lock.UnlockRequest{Type: req.Type, Resource: req.Resource, Node: req.Node}); req.Lease == 0 && !errors.Is(err, lock.ErrInvalid) {
			t.Errorf("Unlock(%v, %q) = %v, want ErrInvalid", req.Key(), req.Node, err)
		}
		if _, err := m.Cancel(ctx, req.Type, req.Resource, req.Node); req.Lease == 0 && !errors.Is(err, lock.ErrInvalid) {
			t.Errorf("Cancel(%v, %q) = %v, want ErrInvalid", req.Key(), req.Node, err)
		}
	}
	if _, err := m.Status(ctx, lock.Pull, "", ""); !errors.Is(err, lock.ErrInvalid) {
		t.Errorf("Status without a resource: %v, want ErrInvalid", err)
	}
	if _, err := m.Status(ctx, lock.Pull, "r", "a\x00"); !errors.Is(err, lock.ErrInvalid) {
		t.Errorf("Status with a bad node: %v, want ErrInvalid", err)
	}
	if _, _, err := m.Subscribe(ctx, lock.SubscribeRequest{}); !errors.Is(err, lock.ErrInvalid) {
		t.Errorf("Subscribe to nothing: %v, want ErrInvalid", err)
	}
	// A Type no name has: names are given Types from the lowest up, for
	// good, and other tests of this process give some (a fixed number
	// such as 9 was named in a second run of the tests, -count=2).
	unnamed := lock.Type(lock.MaxTypes)
	for unnamed > 0 && unnamed.Valid() {
		unnamed--
	}
	if _, _, err := m.Subscribe(ctx, lock.SubscribeRequest{Observe: &lock.Key{Type: unnamed, Resource: "r"}}); !errors.Is(err, lock.ErrInvalid) {
		t.Errorf("observing a bad key: %v, want ErrInvalid", err)
	}
	if st := m.Stats(); st.Keys != 0 || st.Sessions != 0 {
		t.Fatalf("rejected requests left state: %+v", st)
	}
}

func testInfo(t *testing.T, s *suite) {
	m := s.open(t, func(c *Config) { c.LockTTL = 42 * time.Second })
	info := m.Info()
	if info.Epoch == "" || info.RefCounting || info.LockTTL != 42*time.Second {
		t.Fatalf("Info %+v, want an epoch, no reference counting and the configured ttl", info)
	}
	mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	if again := m.Info(); again != info {
		t.Fatalf("Info changed while open: %+v, then %+v", info, again)
	}
}

// testClose: Close ends every stream, and every call after it is refused
// with ErrClosed.
func testClose(t *testing.T, s *suite) {
	ctx := context.Background()
	m := s.open(t, func(c *Config) { c.RefCounting = true })
	sess := subscribe(t, m, "a", nil)
	obs := subscribe(t, m, "", &lock.Key{Type: lock.Pull, Resource: "r"})
	mustLock(t, m, lockReq(lock.Pull, "r", "a"))
	closeBackend(t, m)
	for name, st := range map[string]lock.Stream{"session stream": sess, "observer": obs} {
		select {
		case <-st.Done():
		case <-time.After(EventWait):
			t.Fatalf("%s still open %v after Close", name, EventWait)
		}
	}
	calls := map[string]func() error{
		"TryLock": func() error { _, err := m.TryLock(ctx, lockReq(lock.Pull, "r", "b")); return err },
		"Unlock": func() error {
			_, err := m.Unlock(ctx, lock.UnlockRequest{Type: lock.Pull, Resource: "r", Node: "a", Success: true})
			return err
		},
		"Cancel":         func() error { _, err := m.Cancel(ctx, lock.Pull, "r", "a"); return err },
		"Status":         func() error { _, err := m.Status(ctx, lock.Pull, "r", ""); return err },
		"Subscribe":      func() error { _, _, err := m.Subscribe(ctx, lock.SubscribeRequest{Node: "a"}); return err },
		"RefCount":       func() error { _, err := m.RefCount(ctx, "r"); return err },
		"RefAdd":         func() error { _, err := m.RefAdd(ctx, "r", "a"); return err },
		"RefRelease":     func() error { _, err := m.RefRelease(ctx, "r", "a"); return err },
		"RefReleaseNode": func() error { _, err := m.RefReleaseNode(ctx, "a"); return err },
	}
	for name, call := range calls {
		if err := call(); !errors.Is(err, lock.ErrClosed) {
			t.Errorf("%s after Close: %v, want ErrClosed", name, err)
		}
	}
	if err := m.Close(); err != nil && !errors.Is(err, lock.ErrClosed) {
		t.Errorf("a second Close: %v", err)
	}
}
