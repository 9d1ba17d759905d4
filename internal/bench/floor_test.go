package bench

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest"
	"github.com/dlock/dlock/internal/rawhttp"
)

// A frame as a dlock waiter receives it (captured from dlock bench).
const capturedFrame = "id: 1042\nevent: operation_completed\ndata: {\"event\":\"operation_completed\",\"type\":\"pull\",\"resource_id\":\"bench-fanout-1f0e2d3c-1\",\"node_id\":\"holder-1f0e2d3c\",\"token\":7,\"success\":true}\n\n"

func TestReadFrame(t *testing.T) {
	for _, tc := range []struct {
		name, stream string
		want         []string
	}{
		{"one event", capturedFrame, []string{capturedFrame}},
		{"pings and blank lines before it are not its bytes", ": ping\n\n\n: ping\n\n" + capturedFrame, []string{capturedFrame}},
		{"CRLF lines kept as sent", "id: 1\r\nevent: a\r\ndata: x\r\n\r\nevent: b\ndata: y\n\n", []string{"id: 1\r\nevent: a\r\ndata: x\r\n\r\n", "event: b\ndata: y\n\n"}},
		{"a comment inside an event is its bytes", "event: a\n: note\ndata: x\n\n", []string{"event: a\n: note\ndata: x\n\n"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := bufio.NewReaderSize(strings.NewReader(tc.stream), 4096)
			for _, want := range tc.want {
				got, err := readFrame(r, nil)
				if err != nil || string(got) != want {
					t.Fatalf("readFrame = %q, %v; want %q", got, err, want)
				}
			}
			if got, err := readFrame(r, nil); err == nil {
				t.Fatalf("read past the end: %q", got)
			}
		})
	}
}

// pipedFloor runs ServeFloor, the floor writer's process, in a goroutine,
// and drives it as ExecFloor drives the process.
func pipedFloor(t *testing.T) FloorWriter {
	return func(frame []byte) (string, func() (int, error), func(), error) {
		inR, inW := io.Pipe()
		outR, outW := io.Pipe()
		done := make(chan error, 1)
		go func() {
			err := ServeFloor(inR, outW)
			outW.Close()
			done <- err
		}()
		return driveFloor(frame, inW, outR, func() {
			if err := <-done; err != nil {
				t.Errorf("ServeFloor: %v", err)
			}
		})
	}
}

// Floor: every reader, every round, reads the frame exactly.
func TestFloor(t *testing.T) {
	const n, rounds = 40, 3
	for name, w := range map[string]FloorWriter{"in process": InProcessFloor, "ServeFloor": pipedFloor(t)} {
		r, err := Floor(context.Background(), []byte(capturedFrame), n, rounds, w)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if r.Scenario != "fanout-floor" || r.Ops != n*rounds || r.Rounds != rounds || r.Concurrency != n {
			t.Fatalf("%s: floor result %+v, want %d reads over %d rounds", name, r, n*rounds, rounds)
		}
		if r.RoundMedian <= 0 || r.Max < r.RoundMedian || r.P50 <= 0 || r.Max < r.P99 || r.Rate <= 0 {
			t.Fatalf("%s: implausible floor statistics %+v", name, r)
		}
	}
	// Two events in the frame: the first round's readers read the
	// first, the second round's read what is left, the second event.
	// A reader that reads another event than the frame's is an error.
	other := strings.Replace(capturedFrame, `"success":true`, `"success":false`, 1)
	if _, err := Floor(context.Background(), []byte(capturedFrame+other), 5, 2, pipedFloor(t)); err == nil || !strings.Contains(err.Error(), "another event") {
		t.Fatalf("floor whose readers read another event: %v", err)
	}
	if _, err := Floor(context.Background(), []byte("not an event\n\n"), 5, 1, InProcessFloor); err == nil {
		t.Fatal("floor of a frame that is no event ran")
	}
	// The writers must have written to every reader.
	short := func(frame []byte) (string, func() (int, error), func(), error) {
		addr, round, stop, err := InProcessFloor(frame)
		return addr, func() (int, error) { n, err := round(); return n - 1, err }, stop, err
	}
	if _, err := Floor(context.Background(), []byte(capturedFrame), 5, 1, short); err == nil || !strings.Contains(err.Error(), "4 connections, not 5") {
		t.Fatalf("floor whose writers wrote to 4 of 5 readers: %v", err)
	}
}

// Fanout keeps the event a waiter received, byte for byte, and Floor
// runs on it.
func TestFanoutFrame(t *testing.T) {
	srv := dlocktest.Start(t, dlocktest.Options{})
	r, err := Fanout(context.Background(), srv.URL(), Options{Duration: 100 * time.Millisecond, Waiters: 20})
	if err != nil {
		t.Fatal(err)
	}
	var ev rawhttp.Event
	br := bufio.NewReader(bytes.NewReader(r.Frame))
	if err := rawhttp.ReadEvent(br, &ev); err != nil || ev.Name != "operation_completed" || ev.ID == "" || !bytes.HasSuffix(r.Frame, []byte("\n\n")) {
		t.Fatalf("captured frame %q: %+v %v", r.Frame, ev, err)
	}
	if br.Buffered() != 0 {
		t.Fatalf("the captured frame holds more than one event: %q", r.Frame)
	}
	if !bytes.Contains(ev.Data, fmt.Appendf(nil, `"resource_id":"bench-fanout-`)) || !bytes.HasPrefix(r.Frame, []byte("id: ")) {
		t.Fatalf("captured frame %q is not the fan-out's", r.Frame)
	}
	if r.Rounds < 1 || r.Ops != int64(r.Rounds*20) || r.RoundMedian <= 0 {
		t.Fatalf("fanout result %+v", r)
	}
	f, err := Floor(context.Background(), r.Frame, 20, max(r.Rounds, 5), InProcessFloor)
	if err != nil || f.Ops != int64(20*max(r.Rounds, 5)) {
		t.Fatalf("floor on the captured frame: %+v %v", f, err)
	}
}

// Fanout counts the server's CPU from each round's unlock to its last
// waiter told.
func TestFanoutCPU(t *testing.T) {
	srv := dlocktest.Start(t, dlocktest.Options{})
	calls := 0
	opts := Options{Duration: 100 * time.Millisecond, Waiters: 10, ServerCPU: func() (time.Duration, error) {
		calls++
		return time.Duration(calls) * time.Second, nil
	}}
	r, err := Fanout(context.Background(), srv.URL(), opts)
	if err != nil || calls != 2*r.Rounds || r.ServerCPUPerOp != float64(r.Rounds)*1e6/float64(r.Ops) {
		t.Fatalf("fanout: one second of CPU a round: %+v %v (%d calls)", r, err, calls)
	}
}
