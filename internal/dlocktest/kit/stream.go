package kit

import (
	"bufio"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/dlock/dlock/internal/rawhttp"
)

// Stream is an event stream a test reads: a node's /subscribe or the
// operator's /ui/events. Its events are parsed by rawhttp.ReadEvent, the
// parser the load generator uses.
type Stream struct {
	Resp *http.Response
	// R is the stream's reader, for a test that reads lines (a ping) or
	// the end of the stream itself.
	R  *bufio.Reader
	ev rawhttp.Event
}

// Frame is one event of a Stream.
type Frame struct {
	ID, Event, Data, Retry string
}

// OpenStream GETs url with http.DefaultClient, with a Last-Event-ID header
// unless lastID is "", and fails the test unless the answer is an event
// stream. The stream is closed when the test ends.
func OpenStream(t testing.TB, url, lastID string) *Stream {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	if lastID != "" {
		req.Header.Set("Last-Event-ID", lastID)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("GET %s: %d %s, want an event stream", url, resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	// The largest event is under 16 KiB (docs/API.md); a longer line is
	// an error, not a slow read.
	return &Stream{Resp: resp, R: bufio.NewReaderSize(resp.Body, 64<<10)}
}

// Next returns the next event, skipping pings; a stream that ends, or a
// line that is not part of an event, fails the test. Call it from the
// test's goroutine.
func (s *Stream) Next(t testing.TB) Frame {
	t.Helper()
	if err := rawhttp.ReadEvent(s.R, &s.ev); err != nil {
		t.Fatalf("reading the event stream: %v", err)
	}
	return Frame{ID: s.ev.ID, Event: s.ev.Name, Data: string(s.ev.Data), Retry: s.ev.Retry}
}

// Line returns the stream's next line as sent, "\n" included.
func (s *Stream) Line(t testing.TB) string {
	t.Helper()
	line, err := s.R.ReadString('\n')
	if err != nil {
		t.Fatalf("reading the event stream: %v", err)
	}
	return line
}

// Close ends the stream, as a client that goes away does.
func (s *Stream) Close() { s.Resp.Body.Close() }

// JSON decodes the event's data, which must name the event it is in.
func (f Frame) JSON(t testing.TB) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal([]byte(f.Data), &m); err != nil {
		t.Fatalf("event %s: data %q: %v", f.Event, f.Data, err)
	}
	if m["event"] != f.Event {
		t.Fatalf("data %q names event %v in a frame of %s", f.Data, m["event"], f.Event)
	}
	return m
}

// String shows the frame in a failure message.
func (f Frame) String() string {
	var b strings.Builder
	for _, kv := range [][2]string{{"id", f.ID}, {"retry", f.Retry}, {"event", f.Event}, {"data", f.Data}} {
		if kv[1] != "" {
			b.WriteString(kv[0] + ": " + kv[1] + "; ")
		}
	}
	return strings.TrimSuffix(b.String(), "; ")
}
