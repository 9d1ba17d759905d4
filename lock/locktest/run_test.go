package locktest

import (
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/dlock/dlock/lock"
)

// plainBackend hides every method of a Memory that lock.Backend does not
// have: a backend without an operators' view.
type plainBackend struct{ lock.Backend }

// TestRunWithoutFakeTime runs the suite as a backend with timers in another
// process and no lock.Inspector sees it: the fake-time subtests are skipped
// before they make a backend, the inspector ones once they see it is none,
// and the rest pass.
func TestRunWithoutFakeTime(t *testing.T) {
	var mu sync.Mutex
	var made []string
	Run(t, func(t *testing.T, cfg lock.Config) lock.Backend {
		mu.Lock()
		made = append(made, t.Name())
		mu.Unlock()
		m, err := lock.NewMemory(t.Context(), cfg)
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
