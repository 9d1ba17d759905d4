package locktest

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/memory"
)

// plainBackend hides every method of a memory.Backend that lock.Backend does not
// have: a backend without an operators' view.
type plainBackend struct{ lock.Backend }

// TestRunWithoutFakeTime runs the suite as a backend with timers in another
// process and no lock.Inspector sees it: the fake-time subtests are skipped
// before they make a backend, the inspector ones once they see it is none,
// and the rest pass.
func TestRunWithoutFakeTime(t *testing.T) {
	var mu sync.Mutex
	var made []string
	var refStores perTest
	Run(t, func(t *testing.T, cfg Config) lock.Backend {
		mu.Lock()
		made = append(made, t.Name())
		mu.Unlock()
		mc := memory.DefaultConfig()
		mc.Rules = cfg.Rules
		if cfg.ExactLimits {
			mc.Shards = 1
		}
		if cfg.RefCounting {
			mc.RefStore = refStores.get(t)
		}
		m, err := memory.New(t.Context(), mc)
		if err != nil {
			t.Fatal(err)
		}
		return plainBackend{m}
	}, WithoutFakeTime("its timers run in a test of this package"))
	if t.Failed() {
		return
	}
	for _, g := range groups {
		for _, tc := range g.tests {
			name := t.Name() + "/" + g.name + "/" + tc.name
			asked := slices.ContainsFunc(made, func(n string) bool { return n == name || strings.HasPrefix(n, name+"/") })
			if tc.fakeTime && asked {
				t.Errorf("%s needs fake time but made a backend", name)
			}
			if !tc.fakeTime && !asked {
				t.Errorf("%s made no backend", name)
			}
		}
	}
}

// memRefStore is an in-memory memory.RefStore, the memory engine's
// durable references across a restart in this test.
type memRefStore struct {
	mu   sync.Mutex
	recs map[string]memory.RefRecord
	max  uint64
}

func (s *memRefStore) Load(context.Context) (map[string]memory.RefRecord, uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string]memory.RefRecord{}
	for k, r := range s.recs {
		if len(r.Nodes) > 0 {
			out[k] = r
		}
	}
	return out, s.max, nil
}

func (s *memRefStore) Save(_ context.Context, res string, rec memory.RefRecord) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.recs == nil {
		s.recs = map[string]memory.RefRecord{}
	}
	if old, ok := s.recs[res]; ok && old.Version >= rec.Version {
		return nil
	}
	s.recs[res] = rec
	s.max = max(s.max, rec.Version)
	return nil
}

// perTest keeps one reference store per test, so that a restart (a second
// backend for the same t) finds the references of the first.
type perTest struct {
	mu sync.Mutex
	m  map[*testing.T]*memRefStore
}

func (p *perTest) get(t *testing.T) *memRefStore {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.m == nil {
		p.m = map[*testing.T]*memRefStore{}
	}
	if p.m[t] == nil {
		p.m[t] = &memRefStore{}
	}
	return p.m[t]
}
