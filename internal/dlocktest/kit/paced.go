package kit

import (
	"context"
	"net/http"
	"time"

	"golang.org/x/time/rate"
)

// PaceChunk is the unit of PacedWriter: a body goes out in chunks of this
// size, each waiting for the limiter.
const PaceChunk = 32 << 10

// NewUplink is a limiter of bytesPerSecond for PacedWriters to share: the
// uplink of a registry that the pull benchmarks throttle for every node
// together.
func NewUplink(bytesPerSecond float64) *rate.Limiter {
	return rate.NewLimiter(rate.Limit(bytesPerSecond), PaceChunk)
}

// PacedWriter writes a response through Uplink, and notes its status, the
// bytes of its body and when the last of them went out. Read them once
// the handler has returned.
type PacedWriter struct {
	http.ResponseWriter
	Uplink *rate.Limiter
	Status int
	N      int64
	Last   time.Time // zero when no byte of the body was written
}

func (w *PacedWriter) WriteHeader(code int) {
	if w.Status == 0 {
		w.Status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *PacedWriter) Write(p []byte) (int, error) {
	if w.Status == 0 {
		w.Status = http.StatusOK
	}
	written := 0
	for len(p) > 0 {
		chunk := min(len(p), PaceChunk)
		if err := w.Uplink.WaitN(context.Background(), chunk); err != nil {
			return written, err
		}
		n, err := w.ResponseWriter.Write(p[:chunk])
		written += n
		w.N += int64(n)
		if n > 0 {
			w.Last = time.Now()
		}
		if err != nil {
			return written, err
		}
		p = p[chunk:]
	}
	return written, nil
}
