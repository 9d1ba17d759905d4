package netfault

import (
	"errors"
	"fmt"
	"io"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if os.Getenv("NETFAULT_HELPER") == "echo" {
		// The child that TestFreeze stops: it echoes its input.
		_, _ = io.Copy(os.Stdout, os.Stdin)
		os.Exit(0)
	}
	// The rules a killed run of any package left (make test runs this).
	if err := CleanupStale(); err != nil {
		fmt.Fprintf(os.Stderr, "netfault: removing stale rules: %v\n", err)
	}
	goleak.VerifyTestMain(m)
}

// quiet is how long a test watches a connection to see that nothing comes:
// a read deadline, not a sleep. What it watches for (a byte, a FIN, a
// reset) would come in microseconds on loopback.
const quiet = 250 * time.Millisecond

// deadlineReader is a connection or a pipe.
type deadlineReader interface {
	io.Reader
	SetReadDeadline(time.Time) error
}

// expectQuiet checks that conn reads nothing, no byte, no EOF and no
// reset, for quiet.
func expectQuiet(t *testing.T, conn deadlineReader, what string) {
	t.Helper()
	if err := conn.SetReadDeadline(time.Now().Add(quiet)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	n, err := conn.Read(buf)
	if n > 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("%s: read %q, %v; want nothing until the deadline", what, buf[:n], err)
	}
	if err := conn.SetReadDeadline(time.Time{}); err != nil {
		t.Fatal(err)
	}
}
