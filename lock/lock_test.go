package lock

import (
	"context"
	"errors"
	"hash/fnv"
	"maps"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newMemory(t testing.TB, mod func(*Config)) *Memory {
	t.Helper()
	cfg := DefaultConfig()
	if mod != nil {
		mod(&cfg)
	}
	m, err := NewMemory(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Close() })
	return m
}

func lockReq(t Type, res, node string) LockRequest {
	return LockRequest{Type: t, Resource: res, Node: node}
}

func mustLock(t testing.TB, m *Memory, req LockRequest) LockResult {
	t.Helper()
	res, err := m.TryLock(context.Background(), req)
	if err != nil {
		t.Fatalf("TryLock(%v, %s): %v", req.Key(), req.Node, err)
	}
	return res
}

func mustUnlock(t testing.TB, m *Memory, typ Type, res, node string, success bool) UnlockResult {
	t.Helper()
	r, err := m.Unlock(context.Background(), UnlockRequest{Type: typ, Resource: res, Node: node, Success: success, Error: errText(success)})
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

func status(t testing.TB, m *Memory, typ Type, res, node string) Status {
	t.Helper()
	st, err := m.Status(t.Context(), typ, res, node)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// events drains what a stream has received so far.
func events(st Stream) []Delivery { return st.Take(nil) }

func names(ds []Delivery) []string {
	var out []string
	for _, d := range ds {
		out = append(out, d.Event.Name+":"+d.Event.Node)
	}
	return out
}

func subscribe(t testing.TB, m *Memory, node string, observe *Key) *stream {
	t.Helper()
	st, _, err := m.Subscribe(t.Context(), SubscribeRequest{Node: node, Observe: observe})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(st.Close)
	return st.(*stream)
}

func TestTryLockRules(t *testing.T) {
	m := newMemory(t, nil)
	a := mustLock(t, m, lockReq(Pull, "r", "a"))
	if !a.Acquired || a.Token == 0 || a.Holder != "a" {
		t.Fatalf("free key: got %+v, want acquired with a token", a)
	}
	again := mustLock(t, m, lockReq(Pull, "r", "a"))
	if !again.Acquired || again.Token != a.Token {
		t.Fatalf("re-lock by the holder: got %+v, want the same grant %d", again, a.Token)
	}
	b := mustLock(t, m, lockReq(Pull, "r", "b"))
	c := mustLock(t, m, lockReq(Pull, "r", "c"))
	if !b.Queued || b.Position != 1 || b.Holder != "a" || !c.Queued || c.Position != 2 {
		t.Fatalf("held key: got b=%+v c=%+v, want queued at 1 and 2", b, c)
	}
	if b2 := mustLock(t, m, lockReq(Pull, "r", "b")); !b2.Queued || b2.Position != 1 {
		t.Fatalf("re-lock by a waiter: got %+v, want position 1", b2)
	}
	if st := status(t, m, Pull, "r", "c"); st.QueueLength != 2 || st.Position != 2 {
		t.Fatalf("no duplicate queue entries: status %+v", st)
	}
	// Other types of the same resource are independent.
	if u := mustLock(t, m, lockReq(Update, "r", "b")); !u.Acquired {
		t.Fatalf("update of a pulled resource: got %+v, want acquired", u)
	}
}

func TestMultiNodeDownloadOff(t *testing.T) {
	m := newMemory(t, func(c *Config) { c.AllowMultiNodeDownload = false })
	mustLock(t, m, lockReq(Pull, "r", "a"))
	_, err := m.TryLock(context.Background(), lockReq(Pull, "r", "b"))
	var he *HeldError
	if !errors.Is(err, ErrLockHeld) || !errors.As(err, &he) || he.Holder != "a" {
		t.Fatalf("got %v, want ErrLockHeld by a", err)
	}
	if st := status(t, m, Pull, "r", ""); st.QueueLength != 0 {
		t.Fatalf("refused node was queued: %+v", st)
	}
}

func TestUnlockRules(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name      string
		typ       Type
		success   bool
		wantNext  string
		wantQueue int
	}{
		{"pull success clears the queue", Pull, true, "", 0},
		{"delete success clears the queue", Delete, true, "", 0},
		{"update success hands off", Update, true, "b", 1},
		{"pull failure hands off", Pull, false, "b", 1},
		{"delete failure hands off", Delete, false, "b", 1},
		{"update failure hands off", Update, false, "b", 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := newMemory(t, nil)
			sb := subscribe(t, m, "b", nil)
			sc := subscribe(t, m, "c", nil)
			obs := subscribe(t, m, "", &Key{tc.typ, "r"})
			a := mustLock(t, m, LockRequest{Type: tc.typ, Resource: "r", Node: "a", Lease: LeaseTTL})
			mustLock(t, m, lockReq(tc.typ, "r", "b"))
			mustLock(t, m, lockReq(tc.typ, "r", "c"))
			got := mustUnlock(t, m, tc.typ, "r", "a", tc.success)
			if got.NextHolder != tc.wantNext {
				t.Fatalf("next holder %q, want %q", got.NextHolder, tc.wantNext)
			}
			st := status(t, m, tc.typ, "r", "")
			if st.QueueLength != tc.wantQueue || st.Holder != tc.wantNext || st.Held != (tc.wantNext != "") {
				t.Fatalf("status after unlock: %+v", st)
			}
			if lc := st.LastCompleted; lc == nil || lc.Node != "a" || lc.Success != tc.success || lc.Token != a.Token {
				t.Fatalf("completion record %+v", st.LastCompleted)
			}
			eb, ec, eo := events(sb), events(sc), events(obs)
			if tc.wantNext == "" {
				for _, es := range [][]Delivery{eb, ec} {
					if len(es) != 1 || es[0].Event.Name != EventOperationCompleted || !es[0].Event.Success || es[0].Event.Node != "a" {
						t.Fatalf("waiter events %v, want one operation_completed{success} of a", names(es))
					}
				}
				if want := []string{"lock_assigned:a", "operation_completed:a"}; !slices.Equal(names(eo), want) {
					t.Fatalf("observer events %v, want %v", names(eo), want)
				}
				return
			}
			if len(eb) != 1 || eb[0].Event.Name != EventLockAssigned || eb[0].Event.Token <= a.Token {
				t.Fatalf("new holder's events %v, want lock_assigned with a newer token", names(eb))
			}
			if len(ec) != 0 {
				t.Fatalf("second waiter got %v, want nothing (one waiter is woken, not the herd)", names(ec))
			}
			want := []string{"lock_assigned:a", "lock_assigned:b", "operation_completed:a"}
			if !slices.Equal(names(eo), want) {
				t.Fatalf("observer events %v, want %v (lock_assigned before operation_completed)", names(eo), want)
			}
			if done := eo[2].Event; done.NextHolder != "b" || done.Success != tc.success {
				t.Fatalf("operation_completed %+v", done)
			}
			_ = ctx
		})
	}
}

func TestUnlockErrors(t *testing.T) {
	ctx := context.Background()
	m := newMemory(t, nil)
	a := mustLock(t, m, lockReq(Pull, "r", "a"))
	mustLock(t, m, lockReq(Pull, "r", "b"))
	if _, err := m.Unlock(ctx, UnlockRequest{Type: Pull, Resource: "r", Node: "b", Success: true}); !errors.Is(err, ErrNotHolder) {
		t.Fatalf("unlock by a waiter: %v, want ErrNotHolder", err)
	}
	if _, err := m.Unlock(ctx, UnlockRequest{Type: Pull, Resource: "nothing", Node: "a", Success: true}); !errors.Is(err, ErrNotHolder) {
		t.Fatalf("unlock of a free key: %v, want ErrNotHolder", err)
	}
	if _, err := m.Unlock(ctx, UnlockRequest{Type: Pull, Resource: "r", Node: "a", Success: true, Token: a.Token - 1}); !errors.Is(err, ErrStaleToken) {
		t.Fatalf("unlock with an old token: %v, want ErrStaleToken", err)
	}
	if st := status(t, m, Pull, "r", ""); st.Holder != "a" || st.QueueLength != 1 {
		t.Fatalf("a refused unlock changed state: %+v", st)
	}
	// The holder check comes before the token check.
	if _, err := m.Unlock(ctx, UnlockRequest{Type: Pull, Resource: "r", Node: "b", Token: 1}); !errors.Is(err, ErrNotHolder) {
		t.Fatalf("unlock by a non-holder with a bad token: %v, want ErrNotHolder", err)
	}
	if _, err := m.Unlock(ctx, UnlockRequest{Type: Pull, Resource: "r", Node: "a", Success: false, Error: "x", Token: a.Token}); err != nil {
		t.Fatal(err)
	}
}

func TestUnlockReplay(t *testing.T) {
	ctx := context.Background()
	m := newMemory(t, nil)
	a := mustLock(t, m, lockReq(Pull, "r", "a"))
	mustLock(t, m, lockReq(Pull, "r", "b"))
	first, err := m.Unlock(ctx, UnlockRequest{Type: Pull, Resource: "r", Node: "a", Error: "boom", Token: a.Token})
	if err != nil || first.NextHolder != "b" {
		t.Fatalf("first unlock: %+v %v", first, err)
	}
	again, err := m.Unlock(ctx, UnlockRequest{Type: Pull, Resource: "r", Node: "a", Error: "boom", Token: a.Token})
	if err != nil || !again.Replayed || again.NextHolder != "b" {
		t.Fatalf("repeated unlock: %+v %v, want replayed with next holder b", again, err)
	}
	if st := status(t, m, Pull, "r", ""); st.Holder != "b" {
		t.Fatalf("a replay changed state: %+v", st)
	}
	if _, err := m.Unlock(ctx, UnlockRequest{Type: Pull, Resource: "r", Node: "a", Success: true}); !errors.Is(err, ErrNotHolder) {
		t.Fatalf("repeat with another outcome: %v, want ErrNotHolder", err)
	}
	if _, err := m.Unlock(ctx, UnlockRequest{Type: Pull, Resource: "r", Node: "a", Token: a.Token + 5}); !errors.Is(err, ErrNotHolder) {
		t.Fatalf("repeat with another token: %v, want ErrNotHolder", err)
	}
	// Cancel by the holder is not an unlock: a late unlock is not replayed.
	mustLock(t, m, lockReq(Pull, "s", "a"))
	if res, _ := m.Cancel(ctx, Pull, "s", "a"); !res.Released {
		t.Fatalf("cancel by holder: %+v", res)
	}
	if _, err := m.Unlock(ctx, UnlockRequest{Type: Pull, Resource: "s", Node: "a", Error: "cancelled"}); !errors.Is(err, ErrNotHolder) {
		t.Fatalf("unlock after the server released the hold: %v, want ErrNotHolder", err)
	}
}

func TestCancel(t *testing.T) {
	ctx := context.Background()
	m := newMemory(t, nil)
	mustLock(t, m, lockReq(Pull, "r", "a"))
	mustLock(t, m, lockReq(Pull, "r", "b"))
	mustLock(t, m, lockReq(Pull, "r", "c"))
	if res, err := m.Cancel(ctx, Pull, "r", "b"); err != nil || !res.Dequeued || res.Released {
		t.Fatalf("cancel waiter: %+v %v", res, err)
	}
	if st := status(t, m, Pull, "r", "c"); st.Position != 1 {
		t.Fatalf("after cancel c is at %d, want 1", st.Position)
	}
	res, err := m.Cancel(ctx, Pull, "r", "a")
	if err != nil || !res.Released {
		t.Fatalf("cancel holder: %+v %v", res, err)
	}
	st := status(t, m, Pull, "r", "")
	if st.Holder != "c" || st.LastCompleted.Error != "cancelled" || st.LastCompleted.Success {
		t.Fatalf("cancel by holder must hand off as a failure: %+v %+v", st, st.LastCompleted)
	}
	if res, _ := m.Cancel(ctx, Pull, "r", "zz"); res.Dequeued || res.Released {
		t.Fatalf("cancel by a stranger: %+v", res)
	}
}

func TestSkipRecent(t *testing.T) {
	m := newMemory(t, nil)
	skipReq := func(t Type, node string) LockRequest {
		return LockRequest{Type: t, Resource: "r", Node: node, SkipRecent: true}
	}
	mustLock(t, m, lockReq(Pull, "r", "a"))
	mustUnlock(t, m, Pull, "r", "a", true)
	if res := mustLock(t, m, skipReq(Pull, "b")); !res.Skip || res.Acquired {
		t.Fatalf("pull after a recent success with skip_recent: %+v, want skip", res)
	}
	if res := mustLock(t, m, lockReq(Pull, "r", "b")); !res.Acquired {
		t.Fatalf("without skip_recent: %+v, want acquired", res)
	}
	mustUnlock(t, m, Pull, "r", "b", false)
	if res := mustLock(t, m, skipReq(Pull, "c")); !res.Acquired {
		t.Fatalf("after a failure: %+v, want acquired", res)
	}
	mustUnlock(t, m, Pull, "r", "c", true)
	// A successful delete erases the pull record, and the other way round.
	mustLock(t, m, lockReq(Delete, "r", "d"))
	mustUnlock(t, m, Delete, "r", "d", true)
	if res := mustLock(t, m, skipReq(Pull, "e")); !res.Acquired {
		t.Fatalf("pull after a delete: %+v, want acquired", res)
	}
	mustUnlock(t, m, Pull, "r", "e", true)
	if res := mustLock(t, m, skipReq(Delete, "f")); !res.Acquired {
		t.Fatalf("delete after a pull: %+v, want acquired", res)
	}
	mustUnlock(t, m, Delete, "r", "f", false)
	// Updates are never skipped.
	mustLock(t, m, lockReq(Update, "r", "u"))
	mustUnlock(t, m, Update, "r", "u", true)
	if res := mustLock(t, m, skipReq(Update, "v")); !res.Acquired {
		t.Fatalf("update with skip_recent: %+v, want acquired", res)
	}
}

func TestTokensIncrease(t *testing.T) {
	m := newMemory(t, nil)
	var last uint64
	for i := range 50 {
		node := string(rune('a' + i%3))
		r := mustLock(t, m, lockReq(Pull, "r", node))
		if r.Token <= last {
			t.Fatalf("token %d after %d", r.Token, last)
		}
		last = r.Token
		mustUnlock(t, m, Pull, "r", node, i%2 == 0)
	}
	// A new manager (a restart) still never goes back.
	m2 := newMemory(t, nil)
	if r := mustLock(t, m2, lockReq(Pull, "r", "a")); r.Token <= last {
		t.Fatalf("token after restart %d, before %d", r.Token, last)
	}
}

func TestCompletionRecords(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemory(t, func(c *Config) { c.Shards = 1; c.CompletedMax = 3; c.CompletedRetention = time.Minute })
		for _, r := range []string{"r1", "r2", "r3", "r4"} {
			mustLock(t, m, lockReq(Pull, r, "a"))
			mustUnlock(t, m, Pull, r, "a", true)
		}
		if st := status(t, m, Pull, "r1", ""); st.LastCompleted != nil {
			t.Fatalf("oldest record kept beyond completed_max: %+v", st.LastCompleted)
		}
		if st := status(t, m, Pull, "r4", ""); st.LastCompleted == nil {
			t.Fatal("newest record dropped")
		}
		// r2 is now the oldest; r3 completes again, then r5: r2 goes, r3 stays.
		time.Sleep(time.Second)
		mustLock(t, m, lockReq(Pull, "r3", "b"))
		mustUnlock(t, m, Pull, "r3", "b", true)
		mustLock(t, m, lockReq(Pull, "r5", "a"))
		mustUnlock(t, m, Pull, "r5", "a", true)
		if st := status(t, m, Pull, "r2", ""); st.LastCompleted != nil {
			t.Fatalf("oldest record r2 kept: %+v", st.LastCompleted)
		}
		if st := status(t, m, Pull, "r3", ""); st.LastCompleted == nil || st.LastCompleted.Node != "b" {
			t.Fatalf("a key completed again lost its new record: %+v", st.LastCompleted)
		}
		if n := m.Stats().Keys; n != 3 {
			t.Fatalf("%d keys kept, want 3 (r3, r4, r5)", n)
		}
		time.Sleep(time.Minute)
		if st := status(t, m, Pull, "r4", ""); st.LastCompleted != nil {
			t.Fatalf("record kept beyond completed_retention: %+v", st.LastCompleted)
		}
	})
}

func TestValidation(t *testing.T) {
	m := newMemory(t, nil)
	long := string(make([]byte, MaxResourceLen+1))
	bad := []LockRequest{
		{Type: 0, Resource: "r", Node: "a"},
		{Type: Pull, Resource: "", Node: "a"},
		{Type: Pull, Resource: "r", Node: ""},
		{Type: Pull, Resource: "r\n", Node: "a"},
		{Type: Pull, Resource: "r", Node: "a\x00"},
		{Type: Pull, Resource: long, Node: "a"},
		{Type: Pull, Resource: "\xff", Node: "a"},
	}
	for _, req := range bad {
		if _, err := m.TryLock(context.Background(), req); !errors.Is(err, ErrInvalid) {
			t.Errorf("TryLock(%+v) = %v, want ErrInvalid", req, err)
		}
	}
	if st := m.Stats(); st.Keys != 0 {
		t.Fatalf("rejected requests left state: %+v", st)
	}
}

func TestShardIndex(t *testing.T) {
	for _, r := range []string{"", "a", "sha256:0123456789abcdef", "ünïcode"} {
		h := fnv.New32a()
		h.Write([]byte(r))
		for _, n := range []int{1, 7, 32} {
			if got, want := ShardIndex(r, n), int(h.Sum32()%uint32(n)); got != want {
				t.Errorf("ShardIndex(%q, %d) = %d, want FNV-1a-32 mod n = %d", r, n, got, want)
			}
		}
	}
}

// --- leases, in fake time ---

func TestTTLExpiry(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemory(t, func(c *Config) { c.LockTTL = 10 * time.Second })
		obs := subscribe(t, m, "", &Key{Pull, "r"})
		mustLock(t, m, lockReq(Pull, "r", "a"))
		mustLock(t, m, lockReq(Pull, "r", "b"))
		time.Sleep(6 * time.Second)
		mustLock(t, m, lockReq(Pull, "r", "b")) // b renews its queue entry
		time.Sleep(5 * time.Second)             // a's hold is 11 s old
		synctest.Wait()
		st := status(t, m, Pull, "r", "")
		if st.Holder != "b" || st.LastCompleted == nil || st.LastCompleted.Error != "lock expired" {
			t.Fatalf("after the ttl: %+v %+v, want b holding and a expired", st, st.LastCompleted)
		}
		if got := names(events(obs)); !slices.Equal(got, []string{"lock_assigned:a", "lock_assigned:b", "operation_completed:a"}) {
			t.Fatalf("observer saw %v", got)
		}
		// /status with its node id renews b's hold.
		for range 3 {
			time.Sleep(8 * time.Second)
			status(t, m, Pull, "r", "b")
			mustLock(t, m, lockReq(Pull, "r", "b")) // also confirms the hand-off
		}
		if st := status(t, m, Pull, "r", ""); st.Holder != "b" {
			t.Fatalf("renewed hold expired: %+v", st)
		}
		// An expired queue entry is removed.
		mustLock(t, m, lockReq(Pull, "r", "c"))
		time.Sleep(9 * time.Second)
		mustLock(t, m, lockReq(Pull, "r", "b"))
		time.Sleep(2 * time.Second)
		synctest.Wait()
		if st := status(t, m, Pull, "r", "c"); st.QueueLength != 0 || st.Holder != "b" {
			t.Fatalf("expired queue entry kept: %+v", st)
		}
		if m.Stats().Expiries != 2 {
			t.Fatalf("expiries %d, want 2", m.Stats().Expiries)
		}
	})
}

func TestClaimTimeoutAndMaxHold(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemory(t, func(c *Config) { c.ClaimTimeout = 2 * time.Second; c.MaxHold = 20 * time.Second })
		mustLock(t, m, lockReq(Pull, "r", "a"))
		mustLock(t, m, lockReq(Pull, "r", "b"))
		mustLock(t, m, lockReq(Pull, "r", "c"))
		mustUnlock(t, m, Pull, "r", "a", false)
		time.Sleep(3 * time.Second) // b never confirms
		synctest.Wait()
		st := status(t, m, Pull, "r", "")
		if st.Holder != "c" || st.LastCompleted.Node != "b" || st.LastCompleted.Error != "not claimed" {
			t.Fatalf("unclaimed hand-off: %+v %+v", st, st.LastCompleted)
		}
		mustLock(t, m, lockReq(Pull, "r", "c")) // c confirms
		for range 3 {
			time.Sleep(5 * time.Second)
			mustLock(t, m, lockReq(Pull, "r", "c"))
		}
		time.Sleep(5 * time.Second)
		synctest.Wait()
		st = status(t, m, Pull, "r", "")
		if st.Held || st.LastCompleted.Node != "c" || st.LastCompleted.Error != "max hold exceeded" {
			t.Fatalf("max hold: %+v %+v", st, st.LastCompleted)
		}
	})
}

func TestSessionLoss(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemory(t, func(c *Config) { c.SessionGrace = 5 * time.Second })
		sa, _, _ := m.Subscribe(t.Context(), SubscribeRequest{Node: "a"})
		sb, _, _ := m.Subscribe(t.Context(), SubscribeRequest{Node: "b"})
		defer sb.Close()
		mustLock(t, m, lockReq(Pull, "r", "a")) // session lease: a has a stream
		mustLock(t, m, lockReq(Pull, "r", "b"))
		mustLock(t, m, lockReq(Pull, "q", "b"))
		mustLock(t, m, lockReq(Pull, "q", "a")) // a waits on q
		sa.Close()
		time.Sleep(4 * time.Second)
		synctest.Wait()
		if st := status(t, m, Pull, "r", ""); st.Holder != "a" {
			t.Fatalf("hold released within the grace: %+v", st)
		}
		// A reconnect within the grace keeps everything.
		sa2, _, _ := m.Subscribe(t.Context(), SubscribeRequest{Node: "a"})
		time.Sleep(10 * time.Second)
		synctest.Wait()
		if st := status(t, m, Pull, "r", ""); st.Holder != "a" {
			t.Fatalf("hold lost despite the reconnect: %+v", st)
		}
		sa2.Close()
		time.Sleep(6 * time.Second)
		synctest.Wait()
		st := status(t, m, Pull, "r", "")
		if st.Holder != "b" || st.LastCompleted.Error != "session lost" {
			t.Fatalf("after the grace: %+v %+v, want b holding", st, st.LastCompleted)
		}
		if st := status(t, m, Pull, "q", ""); st.QueueLength != 0 {
			t.Fatalf("lost session's queue entry kept: %+v", st)
		}
		if got := names(events(sb)); !slices.Equal(got, []string{"lock_assigned:b", "lock_assigned:b"}) {
			t.Fatalf("b saw %v", got)
		}
		if s := m.Stats(); s.SessionsLost != 1 || s.Sessions != 1 {
			t.Fatalf("stats %+v", s)
		}
	})
}

func TestSessionLeaseWithoutStream(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemory(t, func(c *Config) { c.SessionGrace = 5 * time.Second })
		mustLock(t, m, LockRequest{Type: Pull, Resource: "r", Node: "a", Lease: LeaseSession})
		time.Sleep(6 * time.Second)
		synctest.Wait()
		if st := status(t, m, Pull, "r", ""); st.Held {
			t.Fatalf("a session that never streamed kept its hold: %+v", st)
		}
		// Without a session, the default lease is ttl: it outlives the grace.
		mustLock(t, m, lockReq(Pull, "r", "b"))
		time.Sleep(30 * time.Second)
		synctest.Wait()
		if st := status(t, m, Pull, "r", ""); st.Holder != "b" {
			t.Fatalf("ttl hold lost: %+v", st)
		}
	})
}

func TestReplay(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemory(t, nil)
		st, sub, _ := m.Subscribe(t.Context(), SubscribeRequest{Node: "b"})
		mustLock(t, m, lockReq(Pull, "r", "a"))
		mustLock(t, m, lockReq(Pull, "r", "b"))
		mustLock(t, m, lockReq(Pull, "s", "a"))
		mustLock(t, m, lockReq(Pull, "s", "b"))
		st.Close()
		mustUnlock(t, m, Pull, "r", "a", false) // b gets r while disconnected
		mustUnlock(t, m, Pull, "s", "a", true)  // s done while disconnected
		st2, sub2, err := m.Subscribe(t.Context(), SubscribeRequest{Node: "b", LastID: sub.ID, HasLast: true})
		if err != nil {
			t.Fatal(err)
		}
		defer st2.Close()
		if sub2.ID != sub.ID {
			t.Fatalf("subscribed id %d, want the last id %d", sub2.ID, sub.ID)
		}
		got := names(sub2.Replay)
		if want := []string{"lock_assigned:b", "operation_completed:a"}; !slices.Equal(got, want) {
			t.Fatalf("replayed %v, want %v", got, want)
		}
		if len(events(st2)) != 0 {
			t.Fatal("replayed events delivered twice")
		}
		// Replay from the middle.
		st2.Close()
		st3, sub3, _ := m.Subscribe(t.Context(), SubscribeRequest{Node: "b", LastID: sub2.Replay[0].ID, HasLast: true})
		defer st3.Close()
		if len(sub3.Replay) != 1 || sub3.Replay[0].Event.Name != EventOperationCompleted {
			t.Fatalf("replay after the first: %v", names(sub3.Replay))
		}
	})
}

func TestSlowStreamClosed(t *testing.T) {
	m := newMemory(t, func(c *Config) { c.StreamBuffer = 2 })
	st := subscribe(t, m, "", &Key{Pull, "r"})
	for i := range 3 {
		mustLock(t, m, lockReq(Pull, "r", "a"))
		mustUnlock(t, m, Pull, "r", "a", i%2 == 0)
	}
	select {
	case <-st.Done():
	default:
		t.Fatal("a stream that stopped reading was not closed")
	}
	if !st.Slow() || m.Stats().SlowStreams != 1 {
		t.Fatalf("slow=%v stats=%+v", st.Slow(), m.Stats())
	}
	// Others are unaffected.
	mustLock(t, m, lockReq(Pull, "r", "a"))
}

// --- server-side reference counting ---

type memRefStore struct {
	mu   sync.Mutex
	recs map[string]RefRecord
	max  uint64
}

func (s *memRefStore) Load(context.Context) (map[string]RefRecord, uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string]RefRecord{}
	for k, r := range s.recs {
		if len(r.Nodes) > 0 {
			out[k] = r
		}
	}
	return out, s.max, nil
}

func (s *memRefStore) Save(_ context.Context, res string, rec RefRecord) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.recs == nil {
		s.recs = map[string]RefRecord{}
	}
	if old, ok := s.recs[res]; ok && old.Version >= rec.Version {
		return nil
	}
	s.recs[res] = rec
	s.max = max(s.max, rec.Version)
	return nil
}

func refManager(t testing.TB, store *memRefStore, updNoRef bool) *Memory {
	return newMemory(t, func(c *Config) { c.RefStore = store; c.UpdateRequiresNoRef = updNoRef })
}

func refNodes(t testing.TB, m *Memory, res string) []string {
	t.Helper()
	rc, err := m.RefCount(t.Context(), res)
	if err != nil {
		t.Fatal(err)
	}
	return rc.Nodes
}

func TestRefCountRules(t *testing.T) {
	ctx := context.Background()
	store := &memRefStore{}
	m := refManager(t, store, false)
	mustLock(t, m, lockReq(Pull, "r", "a"))
	mustLock(t, m, lockReq(Pull, "r", "b"))
	mustLock(t, m, lockReq(Pull, "r", "c"))
	if _, err := m.TryLock(ctx, lockReq(Delete, "r", "d")); !errors.Is(err, ErrInUse) {
		t.Fatalf("delete while a pull is held: %v, want ErrInUse", err)
	}
	mustUnlock(t, m, Pull, "r", "a", true)
	if got := refNodes(t, m, "r"); !slices.Equal(got, []string{"a", "b", "c"}) {
		t.Fatalf("pull success references %v, want the holder and every skipped waiter", got)
	}
	if _, err := m.TryLock(ctx, lockReq(Delete, "r", "d")); !errors.Is(err, ErrInUse) {
		t.Fatalf("delete of a referenced resource: %v, want ErrInUse", err)
	}
	// Update is free without update_requires_no_ref, and changes nothing.
	mustLock(t, m, lockReq(Update, "r", "u"))
	mustUnlock(t, m, Update, "r", "u", true)
	for _, n := range []string{"a", "b", "c"} {
		if _, err := m.RefRelease(ctx, "r", n); err != nil {
			t.Fatal(err)
		}
	}
	if got := refNodes(t, m, "r"); len(got) != 0 {
		t.Fatalf("after releases: %v", got)
	}
	mustLock(t, m, lockReq(Delete, "r", "d"))
	for _, typ := range []Type{Pull, Update} {
		if _, err := m.TryLock(ctx, lockReq(typ, "r", "x")); !errors.Is(err, ErrDeleting) {
			t.Fatalf("%v while deleting: %v, want ErrDeleting", typ, err)
		}
	}
	if _, err := m.RefAdd(ctx, "r", "x"); !errors.Is(err, ErrDeleting) {
		t.Fatalf("refcount add while deleting: %v, want ErrDeleting", err)
	}
	mustUnlock(t, m, Delete, "r", "d", true)
	if rc, err := m.RefAdd(ctx, "r", "x"); err != nil || !slices.Equal(rc.Nodes, []string{"x"}) {
		t.Fatalf("add after delete: %+v %v", rc, err)
	}
	if rc, _ := m.RefAdd(ctx, "r", "x"); rc.Count() != 1 {
		t.Fatalf("a repeated add counted twice: %+v", rc)
	}
	// A failed pull changes nothing; a successful delete clears.
	mustLock(t, m, lockReq(Pull, "r", "y"))
	mustUnlock(t, m, Pull, "r", "y", false)
	if got := refNodes(t, m, "r"); !slices.Equal(got, []string{"x"}) {
		t.Fatalf("after a failed pull: %v", got)
	}
	mustLock(t, m, lockReq(Pull, "other", "x"))
	mustUnlock(t, m, Pull, "other", "x", true)
	if n, err := m.RefReleaseNode(ctx, "x"); err != nil || n != 2 {
		t.Fatalf("release-all: %d %v, want 2", n, err)
	}
	// Durable: a new manager over the same store forgets nothing.
	mustLock(t, m, lockReq(Pull, "kept", "k"))
	mustUnlock(t, m, Pull, "kept", "k", true)
	m2 := refManager(t, store, false)
	if got := refNodes(t, m2, "kept"); !slices.Equal(got, []string{"k"}) {
		t.Fatalf("after restart: %v", got)
	}
	if got := refNodes(t, m2, "r"); len(got) != 0 {
		t.Fatalf("released references came back: %v", got)
	}
}

func TestRefCountUpdateRequiresNoRef(t *testing.T) {
	ctx := context.Background()
	m := refManager(t, &memRefStore{}, true)
	mustLock(t, m, lockReq(Pull, "r", "a"))
	if _, err := m.TryLock(ctx, lockReq(Update, "r", "u")); !errors.Is(err, ErrInUse) {
		t.Fatalf("update while a pull is held: %v, want ErrInUse", err)
	}
	mustUnlock(t, m, Pull, "r", "a", true)
	if _, err := m.TryLock(ctx, lockReq(Update, "r", "u")); !errors.Is(err, ErrInUse) {
		t.Fatalf("update of a referenced resource: %v, want ErrInUse", err)
	}
	m.RefRelease(ctx, "r", "a")
	mustLock(t, m, lockReq(Update, "r", "u"))
	if _, err := m.TryLock(ctx, lockReq(Pull, "r", "p")); !errors.Is(err, ErrUpdating) {
		t.Fatalf("pull while updating: %v, want ErrUpdating", err)
	}
	if _, err := m.RefAdd(ctx, "r", "p"); !errors.Is(err, ErrUpdating) {
		t.Fatalf("add while updating: %v, want ErrUpdating", err)
	}
	if _, err := m.TryLock(ctx, lockReq(Delete, "r", "d")); !errors.Is(err, ErrInUse) {
		t.Fatalf("delete while updating: %v, want ErrInUse", err)
	}
}

func TestRefCountPromotionRefused(t *testing.T) {
	ctx := context.Background()
	store := &memRefStore{}
	m := refManager(t, store, false)
	sw := subscribe(t, m, "w", nil)
	mustLock(t, m, lockReq(Delete, "r", "d"))
	mustLock(t, m, lockReq(Delete, "r", "w")) // queued behind d
	mustLock(t, m, lockReq(Delete, "r", "z"))
	// Force a reference while the delete is held, as a restart with a
	// stored reference would: the promotion check must catch it.
	s := m.shardFor("r")
	s.mu.Lock()
	s.refs["r"] = &refState{nodes: map[string]struct{}{"n": {}}}
	s.mu.Unlock()
	r := mustUnlock(t, m, Delete, "r", "d", false)
	if r.NextHolder != "" {
		t.Fatalf("a referenced delete was handed to %q", r.NextHolder)
	}
	ev := events(sw)
	if len(ev) != 1 || ev[0].Event.Name != EventOperationCompleted || ev[0].Event.Node != "w" || ev[0].Event.Error != "in_use" || ev[0].Event.Success {
		t.Fatalf("refused waiter told %v %+v", names(ev), ev)
	}
	if st := status(t, m, Delete, "r", ""); st.Held || st.QueueLength != 0 || st.LastCompleted.Node != "d" {
		t.Fatalf("after refusals: %+v", st)
	}
	_ = ctx
}

func TestRefCountOff(t *testing.T) {
	m := newMemory(t, nil)
	if _, err := m.RefCount(t.Context(), "r"); !errors.Is(err, ErrRefCountOff) {
		t.Fatalf("got %v", err)
	}
	if _, err := m.RefAdd(context.Background(), "r", "a"); !errors.Is(err, ErrRefCountOff) {
		t.Fatalf("got %v", err)
	}
	mustLock(t, m, lockReq(Pull, "r", "a"))
	mustLock(t, m, lockReq(Delete, "r", "b")) // types are independent without refcount
}

func TestRefRules(t *testing.T) {
	for _, tc := range []struct {
		t       Type
		count   int
		updReq  bool
		wantErr bool
	}{
		{Pull, 5, true, false}, {Delete, 0, false, false}, {Delete, 1, false, true},
		{Update, 1, false, false}, {Update, 1, true, true}, {Update, 0, true, false},
	} {
		if err := RefPermits(tc.t, tc.count, tc.updReq); (err != nil) != tc.wantErr {
			t.Errorf("RefPermits(%v, %d, %v) = %v", tc.t, tc.count, tc.updReq, err)
		}
	}
	want := map[Type][2]RefEffect{Pull: {RefNone, RefAddNode}, Update: {RefNone, RefNone}, Delete: {RefNone, RefClear}}
	for _, typ := range slices.Sorted(maps.Keys(want)) {
		for i, success := range []bool{false, true} {
			if got := RefEffectOf(typ, success); got != want[typ][i] {
				t.Errorf("RefEffectOf(%v, %v) = %v", typ, success, got)
			}
		}
	}
}

func TestSessionLogBounded(t *testing.T) {
	m := newMemory(t, func(c *Config) { c.SessionLog = 8 })
	st := subscribe(t, m, "a", nil)
	for range 50 {
		mustLock(t, m, lockReq(Pull, "r", "a"))
		mustUnlock(t, m, Pull, "r", "a", false)
		st.Take(nil)
	}
	s := m.sess.get("a")
	s.mu.Lock()
	n := len(s.live())
	last := s.live()[n-1].ID
	s.mu.Unlock()
	if n != 8 {
		t.Fatalf("session log holds %d events, want 8", n)
	}
	// A reconnect from 8 events back replays those 8, in order.
	st.Close()
	_, sub, _ := m.Subscribe(t.Context(), SubscribeRequest{Node: "a", LastID: last - 8, HasLast: true})
	if len(sub.Replay) != 8 || sub.Replay[7].ID != last {
		t.Fatalf("replayed %d events ending at %d, want 8 ending at %d", len(sub.Replay), sub.Replay[len(sub.Replay)-1].ID, last)
	}
}
