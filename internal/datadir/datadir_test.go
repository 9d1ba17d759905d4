package datadir_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dlock/dlock/internal/datadir"
	"github.com/dlock/dlock/lock/memory"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var _ memory.CeilingStore = (*datadir.CeilingFile)(nil)

func TestOneServerPerDir(t *testing.T) {
	path := filepath.Join(t.TempDir(), "new", "dir")
	d, err := datadir.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	_, err = datadir.Open(path)
	if !errors.Is(err, datadir.ErrInUse) || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "pid") {
		t.Fatalf("second Open of a held dir: %v", err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	d, err = datadir.Open(path)
	if err != nil {
		t.Fatalf("Open after Close: %v", err)
	}
	d.Close()
}

func TestCeilingFile(t *testing.T) {
	dir := t.TempDir()
	d, err := datadir.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	f := d.TokenCeiling()
	if c, err := f.LoadCeiling(); c != 0 || err != nil {
		t.Fatalf("no file yet: %d %v", c, err)
	}
	for _, v := range []uint64{1, 1795426437411790, 1<<64 - 1} {
		if err := f.StoreCeiling(v); err != nil {
			t.Fatal(err)
		}
		if c, err := f.LoadCeiling(); c != v || err != nil {
			t.Fatalf("stored %d, loaded %d %v", v, c, err)
		}
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	if strings.Join(names, " ") != "dlock.lock token-ceiling" {
		t.Fatalf("files left in the data dir: %v", names)
	}
}

// TestCeilingCorrupt: whatever damage the file has, Load refuses it rather
// than read a ceiling that may be too low.
func TestCeilingCorrupt(t *testing.T) {
	dir := t.TempDir()
	d, err := datadir.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	f := d.TokenCeiling()
	if err := f.StoreCeiling(1795426437411790); err != nil {
		t.Fatal(err)
	}
	name := filepath.Join(dir, "token-ceiling")
	good, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	flipped := []byte(string(good))
	flipped[len("dlock-token-ceiling/1 ")] = '0' // 1795… → 0795…: parses, smaller
	for _, bad := range [][]byte{
		nil,
		good[:len(good)-1],
		good[:10],
		flipped,
		[]byte("1795426437411790\n"),
		[]byte(strings.Replace(string(good), "dlock-token-ceiling/1", "dlock-token-ceiling/2", 1)),
	} {
		if err := os.WriteFile(name, bad, 0o600); err != nil {
			t.Fatal(err)
		}
		if c, err := f.LoadCeiling(); !errors.Is(err, datadir.ErrCorrupt) {
			t.Errorf("Load of %q = %d, %v; want ErrCorrupt", bad, c, err)
		}
	}
}
