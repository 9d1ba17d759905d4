package bench

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/dlock/dlock/api"
)

func TestPingWindow(t *testing.T) {
	for _, c := range []struct{ ping, min, want time.Duration }{
		{250 * time.Millisecond, 10 * time.Second, 10 * time.Second},
		{time.Second, 10 * time.Second, 10 * time.Second},
		{3 * time.Second, 10 * time.Second, 12 * time.Second},
		{15 * time.Second, 10 * time.Second, 30 * time.Second},
		{400 * time.Millisecond, time.Second, 1200 * time.Millisecond},
	} {
		if got := PingWindow(c.ping, c.min); got != c.want {
			t.Errorf("PingWindow(%v, %v) = %v, want %v", c.ping, c.min, got, c.want)
		}
	}
}

func TestParsePingIntervals(t *testing.T) {
	got, err := ParsePingIntervals("250ms, 1s,,15s")
	if err != nil || len(got) != 3 || got[0] != 250*time.Millisecond || got[2] != 15*time.Second {
		t.Fatalf("%v %v", got, err)
	}
	for _, bad := range []string{"", ",", "1x", "9ms", "61s"} {
		if _, err := ParsePingIntervals(bad); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}

// fakePinger serves /metrics and session streams that announce announce
// and carry, every every (never if 0), the frame ping.
func fakePinger(t *testing.T, announce, every time.Duration, ping string) string {
	mux := http.NewServeMux()
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "process_cpu_seconds_total 1.5")
	})
	mux.HandleFunc("/subscribe", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(api.PingHeader, fmt.Sprint(announce.Milliseconds()))
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "event: subscribed\ndata: {}\n\n")
		w.(http.Flusher).Flush()
		var tick <-chan time.Time
		if every > 0 {
			tk := time.NewTicker(every)
			defer tk.Stop()
			tick = tk.C
		}
		for {
			select {
			case <-tick:
				fmt.Fprint(w, ping)
				w.(http.Flusher).Flush()
			case <-r.Context().Done():
				return
			}
		}
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.URL
}

// The measurement fails rather than report a window without the pings:
// none came, something else came, or the server pings at another interval
// than the one asked for. Where they come, they are counted.
func TestPingsMeasureSomething(t *testing.T) {
	const ping = 100 * time.Millisecond
	run := func(base string) ([]PingResult, error) {
		return Pings(context.Background(), PingOptions{Intervals: []time.Duration{ping}, Sessions: 4, Window: 400 * time.Millisecond, Settle: 50 * time.Millisecond,
			Start: func(context.Context, time.Duration) (string, func(), error) { return base, func() {}, nil }})
	}
	for _, c := range []struct {
		name, base, want string
	}{
		{"no pings", fakePinger(t, ping, 0, ""), "got no ping"},
		{"not pings", fakePinger(t, ping, ping, "data: x\n\n"), "other than pings"},
		{"another interval", fakePinger(t, time.Second, ping, PingFrame), "announces"},
		{"too few", fakePinger(t, ping, 3*ping, PingFrame), "under half"},
	} {
		if _, err := run(c.base); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error with %q", c.name, err, c.want)
		}
	}
	rs, err := run(fakePinger(t, ping, ping, PingFrame))
	if err != nil || len(rs) != 1 {
		t.Fatalf("%+v %v", rs, err)
	}
	r := rs[0]
	if r.Streams != 4 || r.Pings < 8 || r.FewestPings < 2 || r.PingBytes != float64(len(PingFrame)) || r.Expected != 40 || r.Rate < 20 || r.ServerCPU != 0 {
		t.Errorf("%+v", r)
	}
}
