package server

import (
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/memory"
)

// Tests of the lock manager's limits over HTTP (docs/SECURITY.md), on the
// lean loop and on net/http.

// checkRefusal checks a refusal: status, JSON error body and Retry-After.
func checkRefusal(t *testing.T, what string, r *http.Response, status int, code string) {
	t.Helper()
	body := bodyOf(r)
	var e api.ErrorBody
	if err := json.Unmarshal([]byte(body), &e); err != nil {
		t.Fatalf("%s: body %q: %v", what, body, err)
	}
	if r.StatusCode != status || e.Code != code || e.Error == "" || e.Message != e.Error || r.Header.Get("Content-Type") != "application/json" {
		t.Errorf("%s: %d %s, want %d with code %s", what, r.StatusCode, body, status, code)
	}
	if ra := r.Header.Get("Retry-After"); ra != "1" {
		t.Errorf("%s: Retry-After %q, want 1", what, ra)
	}
}

func TestLimitRefusals(t *testing.T) {
	for _, lean := range []bool{true, false} {
		t.Run(fmt.Sprint("lean=", lean), func(t *testing.T) {
			e := newEnvMode(t, func(c *memory.Config) {
				c.Shards = 1
				c.MaxQueue = 1
				c.MaxKeys = 3
				c.MaxSessions = 2
				c.MaxSessionsPerNode = 1
			}, lean)
			addr := strings.TrimPrefix(e.ts.URL, "http://")
			lockReq := func(res, node, lease string) string {
				return rawPost("/lock", `{"type":"pull","resource_id":"`+res+`","node_id":"`+node+`"`+lease+`}`)
			}
			// Keep-alive POSTs with a Content-Length, one connection: what
			// the lean loop answers when it serves.
			rs := rawExchange(t, addr, lockReq("r1", "a", "")+lockReq("r1", "b", "")+lockReq("r1", "c", "")+
				lockReq("r2", "a", "")+lockReq("r3", "a", "")+lockReq("r4", "a", ""), 6)
			for i, want := range []int{200, 200, 429, 200, 200, 503} {
				if rs[i].StatusCode != want {
					t.Fatalf("answer %d: %d %s, want %d", i+1, rs[i].StatusCode, bodyOf(rs[i]), want)
				}
			}
			checkRefusal(t, "a second waiter at max-queue 1", rs[2], 429, api.CodeQueueFull)
			checkRefusal(t, "a fourth key at max-keys 3", rs[5], 503, api.CodeTooManyKeys)
			for _, r := range rs[:2] {
				if r.Header.Get("Retry-After") != "" {
					t.Fatalf("a 200 with Retry-After: %v", r.Header)
				}
			}

			// Sessions: one stream per node, two sessions in all.
			e.subscribe("node_id=s1", "").Next(t)
			get := func(query string) *http.Response {
				t.Helper()
				resp, err := http.Get(e.ts.URL + "/subscribe?" + query)
				if err != nil {
					t.Fatal(err)
				}
				body := bodyOf(resp)
				resp.Body.Close()
				resp.Body = nopBody(body)
				return resp
			}
			checkRefusal(t, "a second stream of one node", get("node_id=s1"), 429, api.CodeTooManySessions)
			e.subscribe("node_id=s2", "").Next(t)
			checkRefusal(t, "a third session", get("node_id=s3"), 429, api.CodeTooManySessions)
			r := rawExchange(t, addr, lockReq("r2", "s3", `,"lease":"session"`), 1)[0]
			checkRefusal(t, "a session lease for a third session", r, 429, api.CodeTooManySessions)

			st := e.m.Stats()
			if st.RefusedQueue != 1 || st.RefusedKeys != 1 || st.RefusedNodeStreams != 1 || st.RefusedSessions != 2 {
				t.Fatalf("refusals counted: %+v", st)
			}
			resp, err := http.Get(e.ts.URL + "/metrics")
			if err != nil {
				t.Fatal(err)
			}
			text := bodyOf(resp)
			resp.Body.Close()
			for _, line := range []string{
				`dlock_limit_refusals_total{limit="queue"} 1`,
				`dlock_limit_refusals_total{limit="keys"} 1`,
				`dlock_limit_refusals_total{limit="node_streams"} 1`,
				`dlock_limit_refusals_total{limit="sessions"} 2`,
			} {
				if !strings.Contains(text, line+"\n") {
					t.Errorf("/metrics lacks %q", line)
				}
			}
		})
	}
}

type stringBody struct{ *strings.Reader }

func (stringBody) Close() error { return nil }

func nopBody(s string) stringBody { return stringBody{strings.NewReader(s)} }

// TestIDAliasing: two ids that encoding/json would both turn into
// "a\uFFFD", and ids with invalid UTF-8 or bidi controls, are refused with
// 400 by both JSON parsers and in query strings, so two byte strings never
// name one node.
func TestIDAliasing(t *testing.T) {
	for _, lean := range []bool{true, false} {
		t.Run(fmt.Sprint("lean=", lean), func(t *testing.T) {
			e := newEnvMode(t, nil, lean)
			addr := strings.TrimPrefix(e.ts.URL, "http://")
			ids := []string{`a\ud800`, `a\udfff`, `a\ufffd`, "a\xff", `a\u202e`, "a\u2066", `a\u200f`}
			var raw string
			for _, id := range ids {
				raw += rawPost("/lock", `{"type":"pull","resource_id":"r","node_id":"`+id+`"}`)
				raw += rawPost("/lock", `{"type":"pull","resource_id":"`+id+`","node_id":"n"}`)
				raw += rawPost("/unlock", `{"type":"pull","resource_id":"r","node_id":"`+id+`"}`)
				raw += rawPost("/cancel", `{"type":"pull","resource_id":"r","node_id":"`+id+`"}`)
			}
			for i, r := range rawExchange(t, addr, raw, 4*len(ids)) {
				if body := bodyOf(r); r.StatusCode != 400 || !strings.Contains(body, `"invalid_request"`) {
					t.Errorf("request %d (id %q): %d %s, want 400 invalid_request", i+1, ids[i/4], r.StatusCode, body)
				}
			}
			for _, q := range []string{"a%ED%A0%80", "a%EF%BF%BD", "a%FF", "a%E2%80%AE"} {
				resp, err := http.Get(e.ts.URL + "/subscribe?node_id=" + q)
				if err != nil {
					t.Fatal(err)
				}
				if resp.StatusCode != 400 { // a stream: its body never ends
					t.Errorf("/subscribe?node_id=%s: %d, want 400", q, resp.StatusCode)
				} else if body := bodyOf(resp); !strings.Contains(body, "invalid_request") {
					t.Errorf("/subscribe?node_id=%s: %s", q, body)
				}
				resp.Body.Close()
				if status, _ := e.call("GET", "/status?type=pull&resource_id=r&node_id="+q, ""); status != 400 {
					t.Errorf("/status?node_id=%s: %d, want 400", q, status)
				}
			}
			if st := e.m.Stats(); st.Keys != 0 || st.Sessions != 0 {
				t.Fatalf("refused ids left state: %+v", st)
			}
		})
	}
}

// TestReplayBoundedHTTP: a reconnect with Last-Event-ID: 0 gets at most the
// session log's bytes of replay, the newest events, after a subscribed
// event whose id shows the gap; error texts of 60 KiB arrive cut to 1 KiB.
func TestReplayBoundedHTTP(t *testing.T) {
	const logBytes = lock.MinSessionLogBytes
	e := newEnv(t, func(c *memory.Config) { c.SessionLogBytes = logBytes })
	w := e.subscribe("node_id=w", "")
	w.Next(t)
	long := strings.Repeat("é", 30<<10)
	const n = 40
	var seen []string
	for i := range n {
		r := "r" + strconv.Itoa(i)
		e.call("POST", "/lock", `{"type":"pull","resource_id":"`+r+`","node_id":"a"}`)
		e.call("POST", "/lock", `{"type":"pull","resource_id":"`+r+`","node_id":"w"}`)
		status, _ := e.call("POST", "/unlock", `{"type":"pull","resource_id":"`+r+`","node_id":"a","success":true,"error":"`+long+`"}`)
		if status != 200 {
			t.Fatalf("unlock: %d", status)
		}
		f := w.Next(t)
		msg, _ := f.JSON(t)["error"].(string)
		if f.Event != "operation_completed" || len(msg) > lock.MaxErrorLen || !strings.HasSuffix(msg, "…") || !utf8.ValidString(msg) {
			t.Fatalf("event %d: %s with an error of %d bytes", i, f.Event, len(msg))
		}
		seen = append(seen, f.ID)
	}
	_, st := e.call("GET", "/status?type=pull&resource_id=r0", "")
	if c, _ := st["last_completed"].(map[string]any); c == nil || len(c["error"].(string)) > lock.MaxErrorLen {
		t.Fatalf("completion record: %v", st["last_completed"])
	}

	replay := e.subscribe("node_id=w", "0")
	br := replay.R
	// frameBytes reads one frame and returns its id and size on the api.
	frameBytes := func() (id string, size int) {
		for {
			line, err := br.ReadString('\n')
			if err != nil {
				t.Fatalf("reading the replay: %v", err)
			}
			size += len(line)
			if v, ok := strings.CutPrefix(line, "id: "); ok {
				id = strings.TrimSpace(v)
			}
			if line == "\n" && id != "" {
				return id, size
			}
		}
	}
	subID, _ := frameBytes()
	var replayed []string
	total := 0
	for len(replayed) == 0 || replayed[len(replayed)-1] != seen[n-1] {
		id, size := frameBytes()
		replayed = append(replayed, id)
		total += size
		if len(replayed) > n {
			t.Fatalf("replay longer than the events: %v", replayed)
		}
	}
	k := len(replayed)
	if total > logBytes || k >= n {
		t.Fatalf("Last-Event-ID: 0 replayed %d events in %d bytes, want at most %d bytes", k, total, logBytes)
	}
	if strings.Join(replayed, ",") != strings.Join(seen[n-k:], ",") {
		t.Fatalf("replayed %v, want the newest %d of %v", replayed, k, seen)
	}
	if subID != seen[n-k-1] {
		t.Fatalf("subscribed id %s, want %s: the newest event let go, so the client sees the gap", subID, seen[n-k-1])
	}
	if e.m.Stats().ReplayGaps != 1 {
		t.Fatalf("ReplayGaps = %d", e.m.Stats().ReplayGaps)
	}
}

// TestEventWireSize: the size a session log counts for an event is never
// below its frame on the wire, whatever its texts hold.
func TestEventWireSize(t *testing.T) {
	long := func(s string, n int) string { return strings.Repeat(s, n)[:n] }
	at := time.Date(2026, 12, 31, 23, 59, 59, 999999999, time.FixedZone("x", -11*3600))
	texts := []string{"", "plain", long("<", lock.MaxErrorLen), long("\x01", lock.MaxErrorLen), long("\u2028", lock.MaxErrorLen), long("\xff", lock.MaxErrorLen), long(`"\`, lock.MaxErrorLen)}
	ids := []string{"a", long("&", lock.MaxResourceLen), long("é", lock.MaxResourceLen), long("\u2029", lock.MaxResourceLen)}
	// A type's name is not counted: the fixed part has room for the
	// longest (docs/DESIGN.md, "Other types").
	longest, err := lock.ParseType(long("z", lock.MaxTypeLen))
	if err != nil {
		t.Fatal(err)
	}
	for _, text := range texts {
		for _, id := range ids {
			node := id[:min(len(id), lock.MaxNodeLen)]
			for _, ev := range []*lock.Event{
				{Name: lock.EventLockAssigned, Key: lock.Key{Type: lock.Update, Resource: id}, Node: node, Token: math.MaxUint64},
				{Name: lock.EventOperationCompleted, Key: lock.Key{Type: lock.Delete, Resource: id}, Node: node, Error: text, CompletedAt: at, NextHolder: node},
				{Name: lock.EventLockAssigned, Key: lock.Key{Type: longest, Resource: id}, Node: node, Token: math.MaxUint64},
				{Name: lock.EventOperationCompleted, Key: lock.Key{Type: longest, Resource: id}, Node: node, Error: text, CompletedAt: at, NextHolder: node},
			} {
				frame := appendDelivery(nil, lock.Delivery{ID: math.MaxUint64, Event: ev})
				if len(frame) > ev.WireSize() {
					t.Fatalf("%s with id %q…, text %q…: frame of %d bytes, counted %d", ev.Name, id[:min(len(id), 4)], text[:min(len(text), 4)], len(frame), ev.WireSize())
				}
			}
		}
	}
	if max := (&lock.Event{Name: lock.EventOperationCompleted, Key: lock.Key{Type: lock.Update, Resource: long("<", lock.MaxResourceLen)},
		Node: long("<", lock.MaxNodeLen), Error: long("<", lock.MaxErrorLen), NextHolder: long("<", lock.MaxNodeLen)}).WireSize(); max > lock.MinSessionLogBytes {
		t.Fatalf("the largest event counts %d bytes, more than the least log (%d)", max, lock.MinSessionLogBytes)
	}
}
