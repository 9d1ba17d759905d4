package kit

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"golang.org/x/time/rate"
)

// TestPacedWriter: every byte goes through, counted, with the status; a
// limiter that refuses a chunk ends the write short.
func TestPacedWriter(t *testing.T) {
	rec := httptest.NewRecorder()
	w := &PacedWriter{ResponseWriter: rec, Uplink: rate.NewLimiter(rate.Inf, PaceChunk)}
	body := make([]byte, 3*PaceChunk+5)
	if n, err := w.Write(body); n != len(body) || err != nil {
		t.Fatalf("Write: %d %v", n, err)
	}
	if w.N != int64(len(body)) || w.Status != http.StatusOK || w.Last.IsZero() || rec.Body.Len() != len(body) {
		t.Fatalf("after the write: N %d, status %d, last %v, body %d", w.N, w.Status, w.Last, rec.Body.Len())
	}
	tight := &PacedWriter{ResponseWriter: httptest.NewRecorder(), Uplink: rate.NewLimiter(1, PaceChunk-1)}
	if n, err := tight.Write(body); n != 0 || err == nil {
		t.Fatalf("a chunk the limiter can never allow: %d %v", n, err)
	}
}
