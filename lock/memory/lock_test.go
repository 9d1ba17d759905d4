package memory

import (
	"context"
	"hash/fnv"
	"sync"
	"testing"

	"github.com/dlock/dlock/lock"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newMemory(t testing.TB, mod func(*Config)) *Backend {
	t.Helper()
	cfg := DefaultConfig()
	if mod != nil {
		mod(&cfg)
	}
	m, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Close() })
	return m
}

func lockReq(t lock.Type, res, node string) lock.LockRequest {
	return lock.LockRequest{Type: t, Resource: res, Node: node}
}

func mustLock(t testing.TB, m *Backend, req lock.LockRequest) lock.LockResult {
	t.Helper()
	res, err := m.TryLock(context.Background(), req)
	if err != nil {
		t.Fatalf("TryLock(%v, %s): %v", req.Key(), req.Node, err)
	}
	return res
}

func mustUnlock(t testing.TB, m *Backend, typ lock.Type, res, node string, success bool) lock.UnlockResult {
	t.Helper()
	r, err := m.Unlock(context.Background(), lock.UnlockRequest{Type: typ, Resource: res, Node: node, Success: success, Error: errText(success)})
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

func status(t testing.TB, m *Backend, typ lock.Type, res, node string) lock.Status {
	t.Helper()
	st, err := m.Status(t.Context(), typ, res, node)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// events drains what a stream has received so far.
func events(st lock.Stream) []lock.Delivery { return st.Take(nil) }

func names(ds []lock.Delivery) []string {
	var out []string
	for _, d := range ds {
		out = append(out, d.Event.Name+":"+d.Event.Node)
	}
	return out
}

func subscribe(t testing.TB, m *Backend, node string, observe *lock.Key) *stream {
	t.Helper()
	st, _, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: node, Observe: observe})
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

func refManager(t testing.TB, store *memRefStore, updNoRef bool) *Backend {
	return newMemory(t, func(c *Config) { c.RefStore = store; c.UpdateRequiresNoRef = updNoRef })
}

func TestRefCountPromotionRefused(t *testing.T) {
	ctx := context.Background()
	store := &memRefStore{}
	m := refManager(t, store, false)
	sw := subscribe(t, m, "w", nil)
	mustLock(t, m, lockReq(lock.Delete, "r", "d"))
	mustLock(t, m, lockReq(lock.Delete, "r", "w")) // queued behind d
	mustLock(t, m, lockReq(lock.Delete, "r", "z"))
	// Force a reference while the delete is held, as a restart with a
	// stored reference would: the promotion check must catch it.
	s := m.shardFor("r")
	s.mu.Lock()
	s.refs["r"] = &refState{nodes: map[string]struct{}{"n": {}}}
	s.mu.Unlock()
	r := mustUnlock(t, m, lock.Delete, "r", "d", false)
	if r.NextHolder != "" {
		t.Fatalf("a referenced delete was handed to %q", r.NextHolder)
	}
	ev := events(sw)
	if len(ev) != 1 || ev[0].Event.Name != lock.EventOperationCompleted || ev[0].Event.Node != "w" || ev[0].Event.Error != "in_use" || ev[0].Event.Success {
		t.Fatalf("refused waiter told %v %+v", names(ev), ev)
	}
	if st := status(t, m, lock.Delete, "r", ""); st.Held || st.QueueLength != 0 || st.LastCompleted.Node != "d" {
		t.Fatalf("after refusals: %+v", st)
	}
	_ = ctx
}
