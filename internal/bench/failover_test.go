package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest"
)

// fakeService is a lock service of several fake servers sharing one state,
// as dlock servers on one etcd do: just what the fail-over scenario calls
// (/lock, /unlock, /status, /subscribe with Last-Event-ID replay).
type fakeService struct {
	mu        sync.Mutex
	holder    map[string]string
	token     map[string]uint64
	events    map[string][]fakeEvent // by node
	changed   chan struct{}          // closed and replaced on every event
	lastIDs   []string               // the Last-Event-ID of every subscribe
	loseHolds bool                   // /status shows every key free
	starts    int
	running   map[*httptest.Server]bool
}

type fakeEvent struct {
	id   int
	data string
}

func newFakeService() *fakeService {
	return &fakeService{holder: map[string]string{}, token: map[string]uint64{}, events: map[string][]fakeEvent{},
		changed: make(chan struct{}), running: map[*httptest.Server]bool{}}
}

func (f *fakeService) nextID() int {
	n := 0
	for _, evs := range f.events {
		n += len(evs)
	}
	return n + 1
}

// start is a StartServer: one more server; its stop kills it, dropping
// every connection at once.
func (f *fakeService) start(context.Context) (string, func(), error) {
	srv := httptest.NewServer(http.HandlerFunc(f.serve))
	f.mu.Lock()
	f.starts++
	f.running[srv] = true
	f.mu.Unlock()
	return srv.URL, func() {
		srv.CloseClientConnections()
		srv.Close()
		f.mu.Lock()
		delete(f.running, srv)
		f.mu.Unlock()
	}, nil
}

func (f *fakeService) serve(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Resource string `json:"resource_id"`
		Node     string `json:"node_id"`
	}
	if r.Method == http.MethodPost {
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, err.Error(), 400)
			return
		}
	}
	f.mu.Lock()
	switch r.URL.Path {
	case "/lock":
		if h := f.holder[req.Resource]; h != "" && h != req.Node {
			f.mu.Unlock()
			fmt.Fprintf(w, `{"acquired":false,"queued":true}`)
			return
		}
		if f.holder[req.Resource] == "" {
			f.holder[req.Resource] = req.Node
			f.token[req.Resource]++
			f.events[req.Node] = append(f.events[req.Node], fakeEvent{f.nextID(),
				fmt.Sprintf(`{"event":"lock_assigned","type":"pull","resource_id":%q,"node_id":%q,"token":%d}`, req.Resource, req.Node, f.token[req.Resource])})
			close(f.changed)
			f.changed = make(chan struct{})
		}
		t := f.token[req.Resource]
		f.mu.Unlock()
		fmt.Fprintf(w, `{"acquired":true,"queued":false,"token":%d,"holder":%q}`, t, req.Node)
	case "/unlock":
		delete(f.holder, req.Resource)
		f.mu.Unlock()
		fmt.Fprint(w, `{"released":true,"next_holder":""}`)
	case "/status":
		res := r.URL.Query().Get("resource_id")
		h, t := f.holder[res], f.token[res]
		if f.loseHolds {
			h = ""
		}
		f.mu.Unlock()
		fmt.Fprintf(w, `{"holder":%q,"token":%d}`, h, t)
	case "/subscribe":
		node, last := r.URL.Query().Get("node_id"), r.Header.Get("Last-Event-ID")
		f.lastIDs = append(f.lastIDs, last)
		from, _ := strconv.Atoi(last)
		f.mu.Unlock()
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprintf(w, "id: %d\nevent: subscribed\ndata: {\"event\":\"subscribed\",\"node_id\":%q}\n\n", from, node)
		w.(http.Flusher).Flush()
		for {
			f.mu.Lock()
			var out []fakeEvent
			for _, e := range f.events[node] {
				if e.id > from {
					out = append(out, e)
				}
			}
			ch := f.changed
			f.mu.Unlock()
			for _, e := range out {
				fmt.Fprintf(w, "id: %d\nevent: lock_assigned\ndata: %s\n\n", e.id, e.data)
				from = e.id
			}
			w.(http.Flusher).Flush()
			select {
			case <-ch:
			case <-r.Context().Done():
				return
			}
		}
	default:
		f.mu.Unlock()
		http.NotFound(w, r)
	}
}

// Each round kills the server the node is on; the node's next lock and
// its resumed stream come from another, with Last-Event-ID; the hold is
// checked, a replacement started, and every server stopped at the end.
func TestFailover(t *testing.T) {
	f := newFakeService()
	var rounds []FailoverRound
	r, err := Failover(context.Background(), FailoverOptions{Servers: 3, Rounds: 4, Start: f.start, Recheck: time.Millisecond,
		Round: func(fr FailoverRound) { rounds = append(rounds, fr) }})
	if err != nil {
		t.Fatal(err)
	}
	if r.Scenario != "failover" || r.Ops != 4 || r.Rounds != 4 || r.Concurrency != 3 || r.Max <= 0 || r.P50 <= 0 || r.Max < r.P50 {
		t.Fatalf("result %+v", r)
	}
	for _, want := range []string{"holds kept (then and 1ms after the kill) 4/4", "resumed stream 4/4", "next /lock answered p50", "stream resumed p50"} {
		if !strings.Contains(r.Note, want) {
			t.Errorf("note %q lacks %q", r.Note, want)
		}
	}
	for i, fr := range rounds {
		if !fr.Kept || !fr.Replayed || fr.Lock <= 0 || fr.Stream <= 0 || fr.Problem != "" {
			t.Errorf("round %d: %+v", i+1, fr)
		}
	}
	if f.starts != 3+4 || len(f.running) != 0 {
		t.Fatalf("%d servers started, %d left running; want 7 and 0", f.starts, len(f.running))
	}
	// Every round: a first subscribe, then a resume from the last event
	// read, the lock_assigned of the held key.
	if len(f.lastIDs) != 8 {
		t.Fatalf("subscribes with Last-Event-ID %q, want 8", f.lastIDs)
	}
	for i := 0; i < 8; i += 2 {
		if f.lastIDs[i] != "" || f.lastIDs[i+1] == "" {
			t.Fatalf("subscribes with Last-Event-ID %q: want each round's first without, its resume with", f.lastIDs)
		}
	}
}

// A hold the service lost after the kill is reported, not hidden.
func TestFailoverHoldLost(t *testing.T) {
	f := newFakeService()
	f.loseHolds = true
	r, err := Failover(context.Background(), FailoverOptions{Servers: 2, Rounds: 2, Start: f.start})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(r.Note, "holds kept 0/2") || !strings.Contains(r.Note, "hold lost") {
		t.Fatalf("note %q", r.Note)
	}
	if _, err := Failover(context.Background(), FailoverOptions{Servers: 1, Rounds: 1, Start: f.start}); err == nil {
		t.Fatal("one server: no error")
	}
}

// With client.Client as the node, on real servers sharing one lock state
// (dlocktest.Options.Share): the client's own fail-over moves its next
// lock and its stream, which the tap on its stream sees resumed.
func TestFailoverClient(t *testing.T) {
	first := dlocktest.Start(t, dlocktest.Options{})
	start := func(context.Context) (string, func(), error) {
		srv := dlocktest.Start(t, dlocktest.Options{Share: first})
		return srv.URL(), srv.Stop, nil
	}
	var rounds []FailoverRound
	r, err := Failover(context.Background(), FailoverOptions{Servers: 2, Rounds: 3, Start: start, Client: true, Recheck: time.Millisecond,
		Round: func(fr FailoverRound) { rounds = append(rounds, fr) }})
	if err != nil {
		t.Fatal(err)
	}
	if r.Rounds != 3 || !strings.Contains(r.Note, "holds kept (then and 1ms after the kill) 3/3") || !strings.Contains(r.Note, "resumed stream 3/3") {
		t.Fatalf("result %+v", r)
	}
	for i, fr := range rounds {
		if !fr.Kept || !fr.Replayed || fr.Lock <= 0 || fr.Stream <= 0 {
			t.Errorf("round %d: %+v", i+1, fr)
		}
	}
	first.Stop()
}
