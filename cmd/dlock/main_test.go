package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"

	"go.uber.org/goleak"
)

var (
	binOnce sync.Once
	binPath string
	binErr  error
	binDir  string
)

func TestMain(m *testing.M) {
	// dlock run starts its helpers from /proc/self/exe: run in this
	// process (inProcess), that is the test binary, which must then be
	// the helper rather than run every test again in each helper, and
	// those tests' helpers, without end.
	if code, ok := internalMain(os.Args[1:]); ok {
		os.Exit(code)
	}
	code := m.Run()
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// dlockBinary builds the command once for every test that runs it.
func dlockBinary(t testing.TB) string {
	binOnce.Do(func() {
		binDir, binErr = os.MkdirTemp("", "dlock-bin")
		if binErr != nil {
			return
		}
		binPath = filepath.Join(binDir, "dlock")
		out, err := exec.Command("go", "build", "-o", binPath, ".").CombinedOutput()
		if err != nil {
			binErr = err
			t.Logf("%s", out)
		}
	})
	if binErr != nil {
		t.Fatalf("building dlock: %v", binErr)
	}
	return binPath
}
