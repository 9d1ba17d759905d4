package refcount_test

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/refcount"
	"github.com/dlock/dlock/refcount/refcounttest"
)

// helperEnv makes the test binary a worker process of TestAcrossProcesses.
const helperEnv = "DLOCK_REFCOUNT_HELPER"

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		os.Exit(helper())
	}
	os.Exit(m.Run())
}

func open(kind, path string) (refcount.Storage, error) {
	switch kind {
	case "file":
		return refcount.OpenFile(path, refcount.Options{})
	case "bolt":
		return refcount.OpenBolt(path, refcount.Options{})
	}
	return nil, fmt.Errorf("unknown storage %q", kind)
}

// helper adds N references to one resource, each for a node of its own.
func helper() int {
	kind, path, id := os.Getenv(helperEnv), os.Getenv("HELPER_PATH"), os.Getenv("HELPER_ID")
	n, _ := strconv.Atoi(os.Getenv("HELPER_N"))
	s, err := open(kind, path)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	m := refcount.NewCounter(s)
	for i := range n {
		if err := m.UpdateRefCount(lock.Pull, "sha256:shared", fmt.Sprintf("p%s-%d", id, i), true); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	return 0
}

func TestMemory(t *testing.T) {
	refcounttest.Run(t, func(*testing.T) refcount.Storage { return refcount.NewMemory() })
}

func TestFile(t *testing.T) {
	refcounttest.Run(t, func(t *testing.T) refcount.Storage {
		s, err := refcount.OpenFile(filepath.Join(t.TempDir(), "refs.json"), refcount.Options{})
		if err != nil {
			t.Fatal(err)
		}
		return s
	})
}

func TestBolt(t *testing.T) {
	refcounttest.Run(t, func(t *testing.T) refcount.Storage {
		s, err := refcount.OpenBolt(filepath.Join(t.TempDir(), "refs.db"), refcount.Options{})
		if err != nil {
			t.Fatal(err)
		}
		return s
	})
}

// TestAcrossProcesses: several OS processes update one resource at once;
// no update is lost.
func TestAcrossProcesses(t *testing.T) {
	const procs, each = 4, 25
	for _, kind := range []string{"file", "bolt"} {
		t.Run(kind, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "refs")
			if _, err := open(kind, path); err != nil {
				t.Fatal(err)
			}
			cmds := make([]*exec.Cmd, procs)
			for i := range cmds {
				cmd := exec.Command(os.Args[0], "-test.run=^$")
				cmd.Env = append(os.Environ(), helperEnv+"="+kind, "HELPER_PATH="+path, "HELPER_ID="+strconv.Itoa(i), "HELPER_N="+strconv.Itoa(each))
				cmd.Stderr = os.Stderr
				if err := cmd.Start(); err != nil {
					t.Fatal(err)
				}
				cmds[i] = cmd
			}
			for _, cmd := range cmds {
				if err := cmd.Wait(); err != nil {
					t.Fatalf("helper: %v", err)
				}
			}
			s, _ := open(kind, path)
			r, err := s.Get("sha256:shared")
			if err != nil {
				t.Fatal(err)
			}
			if r.Count() != procs*each {
				t.Fatalf("%d processes × %d adds left %d references", procs, each, r.Count())
			}
		})
	}
}

func TestCorruptFileIsNotReset(t *testing.T) {
	path := filepath.Join(t.TempDir(), "refs.json")
	if err := os.WriteFile(path, []byte(`{"refs":{"a":{"nodes":["n1"]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := refcount.OpenFile(path, refcount.Options{}); !errors.Is(err, refcount.ErrCorrupt) {
		t.Fatalf("OpenFile of a corrupt file: %v, want ErrCorrupt", err)
	}
	data, _ := os.ReadFile(path)
	if string(data) != `{"refs":{"a":{"nodes":["n1"]}` {
		t.Fatalf("the corrupt file was rewritten: %q", data)
	}
	bpath := filepath.Join(t.TempDir(), "refs.db")
	os.WriteFile(bpath, []byte("this is no bbolt database, but it is long enough to have a meta page or two......"), 0o600)
	if _, err := refcount.OpenBolt(bpath, refcount.Options{}); !errors.Is(err, refcount.ErrCorrupt) {
		t.Fatalf("OpenBolt of a corrupt file: %v, want ErrCorrupt", err)
	}
}

func TestFileSurvivesReopen(t *testing.T) {
	path := filepath.Join(t.TempDir(), "refs.json")
	s, _ := refcount.OpenFile(path, refcount.Options{})
	refcount.NewCounter(s).Add("a", "n1")
	s2, err := refcount.OpenFile(path, refcount.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if r, _ := s2.Get("a"); !r.Has("n1") {
		t.Fatalf("after reopening: %v", r.Nodes)
	}
}

func BenchmarkUpdateRefCount(b *testing.B) {
	for _, kind := range []string{"memory", "file", "bolt"} {
		b.Run(kind, func(b *testing.B) {
			var s refcount.Storage = refcount.NewMemory()
			if kind != "memory" {
				var err error
				if s, err = open(kind, filepath.Join(b.TempDir(), "refs")); err != nil {
					b.Fatal(err)
				}
			}
			m := refcount.NewCounter(s)
			for i := 0; b.Loop(); i++ {
				if err := m.UpdateRefCount(lock.Pull, fmt.Sprint("sha256:", i%100), fmt.Sprint("n", i%10), true); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
