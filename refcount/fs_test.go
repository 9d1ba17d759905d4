package refcount

import (
	"errors"
	"testing"

	"golang.org/x/sys/unix"
)

func TestNetworkFSRefused(t *testing.T) {
	fake := func(typ int64) func(string, *unix.Statfs_t) error {
		return func(_ string, st *unix.Statfs_t) error {
			st.Type = typ
			return nil
		}
	}
	for typ, name := range networkFS {
		if err := checkLocalFS("/x", fake(typ)); !errors.Is(err, ErrNetworkFS) {
			t.Errorf("%s: %v, want ErrNetworkFS", name, err)
		}
	}
	const ext4, tmpfs = 0xef53, 0x01021994
	for _, typ := range []int64{ext4, tmpfs} {
		if err := checkLocalFS("/x", fake(typ)); err != nil {
			t.Errorf("local filesystem %#x refused: %v", typ, err)
		}
	}
	// The real directory of the tests is local.
	if err := checkLocalFS(t.TempDir(), unix.Statfs); err != nil {
		t.Fatal(err)
	}
}
