package rawhttp

import (
	"bufio"
	"errors"
	"io"
	"strings"
	"testing"
)

func TestReadEvent(t *testing.T) {
	r := bufio.NewReader(strings.NewReader(": ping\n\n" +
		"retry: 1000\nevent: subscribed\ndata: {\"a\":1}\n\n" +
		"id: 7\r\nevent: lock_assigned\r\ndata:one\r\ndata: two\r\n\r\n" +
		"event: x\nbogus: y\n\n"))
	var ev Event
	want := []Event{
		{Name: "subscribed", Data: []byte(`{"a":1}`), Retry: "1000"},
		{ID: "7", Name: "lock_assigned", Data: []byte("one\ntwo")},
	}
	for i, w := range want {
		if err := ReadEvent(r, &ev); err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
		if ev.ID != w.ID || ev.Name != w.Name || string(ev.Data) != string(w.Data) || ev.Retry != w.Retry {
			t.Fatalf("event %d: %+v, want %+v", i, ev, w)
		}
	}
	if err := ReadEvent(r, &ev); err == nil || !strings.Contains(err.Error(), "bogus") {
		t.Fatalf("a stray field: %v, want an error naming the line", err)
	}
	if err := ReadEvent(bufio.NewReader(strings.NewReader("event: cut")), &ev); !errors.Is(err, io.EOF) {
		t.Fatalf("a stream that ends mid-event: %v, want EOF", err)
	}
	long := bufio.NewReaderSize(strings.NewReader("data: "+strings.Repeat("x", 100)+"\n\n"), 16)
	if err := ReadEvent(long, &ev); err == nil || !strings.Contains(err.Error(), "over 16 bytes") {
		t.Fatalf("a line over the buffer: %v", err)
	}
}

func TestStreamLine(t *testing.T) {
	s := &Stream{r: bufio.NewReaderSize(strings.NewReader(": ping\n\nevent: x\r\n"+strings.Repeat("y", 40)+"\n"), 16)}
	for _, want := range []string{": ping\n", "\n", "event: x\r\n"} {
		if line, err := s.Line(); err != nil || string(line) != want {
			t.Fatalf("line %q %v, want %q", line, err, want)
		}
	}
	if _, err := s.Line(); err == nil || !strings.Contains(err.Error(), "over 16 bytes") {
		t.Fatalf("a line over the buffer: %v", err)
	}
}
