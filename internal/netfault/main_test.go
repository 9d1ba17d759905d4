package netfault

import (
	"errors"
	"io"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
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
