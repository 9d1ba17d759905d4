package lock

import (
	"context"
	"hash/fnv"
	"maps"
	"slices"
	"sync"
	"testing"

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
