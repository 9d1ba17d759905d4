package server

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/lock"
)

func TestUIPage(t *testing.T) {
	e := newEnv(t, nil)
	resp, err := http.Get(e.ts.URL + "/ui")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/html; charset=utf-8" {
		t.Fatalf("GET /ui: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	// Self-contained: nothing refers to another origin, and the policy
	// would block it if something did.
	if m := regexp.MustCompile(`(?i)(src|href)\s*=\s*["']?(https?:)?//|@import|url\(\s*["']?(https?:)?//`).Find(body); m != nil {
		t.Fatalf("the page refers to something external: %q", m)
	}
	csp := resp.Header.Get("Content-Security-Policy")
	for _, tag := range []string{"script", "style"} {
		inner := regexp.MustCompile(`(?s)<` + tag + `>(.*)</` + tag + `>`).FindSubmatch(body)
		sum := sha256.Sum256(inner[1])
		want := tag + "-src 'sha256-" + base64.StdEncoding.EncodeToString(sum[:]) + "'"
		if !strings.Contains(csp, want) {
			t.Fatalf("policy %q lacks %q", csp, want)
		}
	}
	if !strings.Contains(csp, "default-src 'none'") || !strings.Contains(csp, "connect-src 'self'") {
		t.Fatalf("policy %q", csp)
	}
	for _, c := range []struct {
		method, path string
		status       int
		code         string
	}{
		{"POST", "/ui", 405, "method_not_allowed"},
		{"GET", "/ui/api/keys?limit=x", 400, "invalid_request"},
		{"GET", "/ui/api/keys?limit=0", 400, "invalid_request"},
		{"GET", "/ui/api/keys?cursor=nonsense", 400, "invalid_request"},
		{"GET", "/ui/api/keys?filter=" + strings.Repeat("x", 600), 400, "invalid_request"},
		{"GET", "/ui/api/sessions?cursor=%21%21", 400, "invalid_request"},
		{"POST", "/ui/events", 405, "method_not_allowed"},
		{"GET", "/ui/nope", 404, "not_found"},
	} {
		if status, got := e.call(c.method, c.path, ""); status != c.status || got["code"] != c.code {
			t.Errorf("%s %s: %d %v, want %d %s", c.method, c.path, status, got, c.status, c.code)
		}
	}
}

type uiKeysPage struct {
	Keys []struct {
		Type       string `json:"type"`
		ResourceID string `json:"resource_id"`
		Holder     string `json:"holder"`
		Token      uint64 `json:"token"`
		Queue      []struct {
			NodeID string `json:"node_id"`
		} `json:"queue"`
		QueueLength   int `json:"queue_length"`
		LastCompleted *struct {
			NodeID  string `json:"node_id"`
			Success bool   `json:"success"`
			Error   string `json:"error"`
		} `json:"last_completed"`
	} `json:"keys"`
	Next    string `json:"next"`
	Scanned int    `json:"scanned"`
	Totals  struct {
		Held int `json:"held"`
	} `json:"totals"`
}

func getJSON(t testing.TB, url string, v any) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("GET %s: %d %s", url, resp.StatusCode, body)
	}
	if err := json.Unmarshal(body, v); err != nil {
		t.Fatalf("GET %s: %v in %s", url, err, body)
	}
}

// TestUIKeysPaging: with 100,000 held keys a page costs bounded work — at
// most limit keys in the answer, one shard examined for it — and its
// cursor walks every key exactly once.
func TestUIKeysPaging(t *testing.T) {
	if testing.Short() {
		t.Skip("100,000 keys")
	}
	e := newEnv(t, nil)
	const n = 100_000
	ctx := context.Background()
	for i := range n {
		if _, err := e.m.TryLock(ctx, lock.LockRequest{Type: lock.Pull, Resource: fmt.Sprintf("sha256:%064d", i), Node: "node-" + fmt.Sprint(i%7)}); err != nil {
			t.Fatal(err)
		}
	}
	shards := e.m.Config().Shards
	seen := make(map[string]bool, n)
	cursor, pages := "", 0
	for {
		var p uiKeysPage
		getJSON(t, e.ts.URL+"/ui/api/keys?limit=1000&cursor="+url.QueryEscape(cursor), &p)
		pages++
		if len(p.Keys) > lock.MaxInspectLimit {
			t.Fatalf("a page of %d keys, the cap is %d", len(p.Keys), lock.MaxInspectLimit)
		}
		// About n/shards keys a shard: a page reads one, or two when it
		// ends at a shard's last key.
		if p.Scanned > 3*n/shards {
			t.Fatalf("a page examined %d of %d keys", p.Scanned, n)
		}
		if p.Totals.Held != n {
			t.Fatalf("totals %+v", p.Totals)
		}
		for _, k := range p.Keys {
			if seen[k.ResourceID] {
				t.Fatalf("%s listed twice", k.ResourceID)
			}
			seen[k.ResourceID] = true
		}
		if p.Next == "" {
			break
		}
		cursor = p.Next
	}
	if len(seen) != n || pages > n/lock.MaxInspectLimit+shards {
		t.Fatalf("walked %d keys in %d pages", len(seen), pages)
	}
	// Filtered on the server, by resource, then by node. A filter that
	// matches little may take more than one call: a call stops when it has
	// examined its budget of keys, with a cursor to go on from.
	walk := func(query string) (holders []string) {
		for cursor := ""; ; {
			var p uiKeysPage
			getJSON(t, e.ts.URL+"/ui/api/keys?limit=200&"+query+"&cursor="+url.QueryEscape(cursor), &p)
			for _, k := range p.Keys {
				holders = append(holders, k.Holder)
			}
			if cursor = p.Next; cursor == "" {
				return holders
			}
		}
	}
	if got := walk("filter=" + fmt.Sprintf("%064d", 4242)); len(got) != 1 || got[0] != "node-"+fmt.Sprint(4242%7) {
		t.Fatalf("resource filter: %v", got)
	}
	got := walk("node=node-3")
	for _, h := range got {
		if h != "node-3" {
			t.Fatalf("node filter let a key of %s through", h)
		}
	}
	if want := (n + 3) / 7; len(got) != want {
		t.Fatalf("node-3 holds %d keys by the walk, want %d", len(got), want)
	}
}

// uiURL is the server whose /ui a test reads: with two servers, the
// first, while calls and streams alternate between them.
func (e *env) uiURL() string {
	if e.c != nil {
		return e.c.members[0].url
	}
	return e.ts.URL
}

// settled runs check until it reports no difference, at most kit.Patience:
// on memory it holds at once; on etcd, once the server the view reads has
// seen what the other server did.
func settled(t *testing.T, check func() string) {
	t.Helper()
	deadline := time.Now().Add(kit.Patience)
	for {
		diff := check()
		if diff == "" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal(diff)
		}
		time.Sleep(20 * time.Millisecond) // a poll, not an ordering
	}
}

func TestUIKeysAndCompletions(t *testing.T) { onBackends(t, nil, testUIKeysAndCompletions) }

func testUIKeysAndCompletions(t *testing.T, e *env) {
	for _, n := range []string{"a", "b", "c"} {
		e.call("POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"`+n+`"}`)
	}
	e.call("POST", "/unlock", `{"type":"pull","resource_id":"r","node_id":"a","error":"disk full"}`)
	e.call("POST", "/lock", `{"type":"delete","resource_id":"old","node_id":"gc"}`)
	e.call("POST", "/unlock", `{"type":"delete","resource_id":"old","node_id":"gc"}`)
	settled(t, func() string {
		var p uiKeysPage
		getJSON(t, e.uiURL()+"/ui/api/keys", &p)
		if len(p.Keys) != 1 {
			return fmt.Sprintf("keys %+v", p.Keys)
		}
		k := p.Keys[0]
		if k.Type != "pull" || k.ResourceID != "r" || k.Holder != "b" || k.Token == 0 || len(k.Queue) != 1 || k.Queue[0].NodeID != "c" ||
			k.QueueLength != 1 || k.LastCompleted == nil || k.LastCompleted.NodeID != "a" || k.LastCompleted.Error != "disk full" {
			return fmt.Sprintf("key %+v", k)
		}
		return ""
	})
	type completions struct {
		Completions []struct {
			Type       string `json:"type"`
			ResourceID string `json:"resource_id"`
			NodeID     string `json:"node_id"`
			Success    bool   `json:"success"`
			Error      string `json:"error"`
			NextHolder string `json:"next_holder"`
		} `json:"completions"`
	}
	settled(t, func() string {
		var c completions
		getJSON(t, e.uiURL()+"/ui/api/completions", &c)
		if len(c.Completions) != 2 || c.Completions[0].NodeID != "gc" || !c.Completions[0].Success ||
			c.Completions[1].NodeID != "a" || c.Completions[1].Error != "disk full" || c.Completions[1].NextHolder != "b" {
			return fmt.Sprintf("completions %+v", c.Completions)
		}
		return ""
	})
	var c completions
	getJSON(t, e.uiURL()+"/ui/api/completions?node=a", &c)
	if len(c.Completions) != 1 || c.Completions[0].ResourceID != "r" {
		t.Fatalf("completions of a %+v", c.Completions)
	}
}

// TestUISessions: on etcd, n1 and n3 stream to the other server than the
// one whose view is read, which tells it their streams while it looks.
func TestUISessions(t *testing.T) { onBackends(t, nil, testUISessions) }

func testUISessions(t *testing.T, e *env) {
	for _, n := range []string{"n1", "n2", "n3"} {
		e.subscribe("node_id="+n, "").Next(t)
	}
	e.call("POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"n2"}`)
	type sessions struct {
		Sessions []struct {
			NodeID  string `json:"node_id"`
			Streams int    `json:"streams"`
			InGrace bool   `json:"in_grace"`
			Keys    int    `json:"keys"`
		} `json:"sessions"`
		Next  string `json:"next"`
		Total int    `json:"total"`
	}
	var p sessions
	settled(t, func() string {
		getJSON(t, e.uiURL()+"/ui/api/sessions?limit=2", &p)
		if len(p.Sessions) != 2 || p.Total != 3 || p.Next == "" || p.Sessions[0].NodeID != "n1" || p.Sessions[1].NodeID != "n2" ||
			p.Sessions[0].Streams != 1 || p.Sessions[0].InGrace || p.Sessions[1].Keys != 1 || p.Sessions[1].Streams != 1 || p.Sessions[1].InGrace {
			return fmt.Sprintf("sessions %+v", p)
		}
		return ""
	})
	settled(t, func() string {
		var p2 sessions
		getJSON(t, e.uiURL()+"/ui/api/sessions?limit=2&cursor="+url.QueryEscape(p.Next), &p2)
		if len(p2.Sessions) != 1 || p2.Sessions[0].NodeID != "n3" || p2.Sessions[0].Streams != 1 || p2.Next != "" {
			return fmt.Sprintf("second page %+v", p2)
		}
		return ""
	})
}

// TestUIEvents: one operator stream carries every key's transitions in
// order, queue joins and leaves and session changes included.
func TestUIEvents(t *testing.T) {
	for _, lean := range []bool{true, false} {
		t.Run(fmt.Sprint("lean=", lean), func(t *testing.T) { testUIEvents(t, newEnvMode(t, nil, lean)) })
	}
	// On etcd, the stream on one server carries what calls on both did,
	// and n's session stream opens on the other server.
	t.Run("etcd, two servers", func(t *testing.T) { testUIEvents(t, newPairEnv(t, nil)) })
}

func testUIEvents(t *testing.T, e *env) {
	ops := kit.OpenStream(t, e.uiURL()+"/ui/events", "")
	if f := ops.Next(t); f.Event != "subscribed" || f.JSON(t)["epoch"] != e.backend().Info().Epoch {
		t.Fatalf("first frame %v", f)
	}
	e.call("POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"a"}`)
	e.call("POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"b"}`)
	e.call("POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"c"}`)
	e.call("POST", "/cancel", `{"type":"pull","resource_id":"r","node_id":"c"}`)
	e.call("POST", "/lock", `{"type":"update","resource_id":"s","node_id":"x"}`)
	e.call("POST", "/unlock", `{"type":"pull","resource_id":"r","node_id":"a","error":"boom"}`)
	e.subscribe("node_id=n", "").Next(t)
	var got []string
	for range 8 {
		f := ops.Next(t)
		d := f.JSON(t) // fails unless the data names the frame's event
		s := f.Event + ":" + d["node_id"].(string)
		if f.Event != "session" {
			s += "@" + d["type"].(string) + ":" + d["resource_id"].(string)
		}
		got = append(got, s)
	}
	want := "lock_assigned:a@pull:r queue_joined:b@pull:r queue_joined:c@pull:r queue_left:c@pull:r " +
		"lock_assigned:x@update:s lock_assigned:b@pull:r operation_completed:a@pull:r session:n"
	if strings.Join(got, " ") != want {
		t.Fatalf("operator stream\n got %s\nwant %s", strings.Join(got, " "), want)
	}
}

// TestUIOtherType: a key of a type besides the three (the seeds'
// image-layer) shows in the operators' view under its name, held and
// queued, and its completion too.
func TestUIOtherType(t *testing.T) { onBackends(t, nil, testUIOtherType) }

func testUIOtherType(t *testing.T, e *env) {
	for _, n := range []string{"a", "b"} {
		e.call("POST", "/lock", `{"type":"image-layer","resource_id":"sha256:l","node_id":"`+n+`"}`)
	}
	e.call("POST", "/unlock", `{"type":"image-layer","resource_id":"sha256:l","node_id":"a","error":"registry gone"}`)
	settled(t, func() string {
		var p uiKeysPage
		getJSON(t, e.uiURL()+"/ui/api/keys?filter=sha256:l", &p)
		if len(p.Keys) != 1 || p.Keys[0].Type != "image-layer" || p.Keys[0].Holder != "b" || p.Keys[0].LastCompleted == nil {
			return fmt.Sprintf("keys %+v", p.Keys)
		}
		return ""
	})
}
