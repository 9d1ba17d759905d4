package server

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/etcd"
	"github.com/dlock/dlock/lock/memory"
	"github.com/dlock/dlock/refcount"
)

// TestOriginalClientTranscript replays testdata/original-client.transcript,
// the original design's client's flows as HTTP (its header says what that
// client sends and reads, and the file's format), against a real server:
// on the memory backend, and on two servers sharing one etcd data set.
// docs/MIGRATION.md is written from it.
func TestOriginalClientTranscript(t *testing.T) {
	const file = "testdata/original-client.transcript"
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	servers, err := parseTranscript(string(data))
	if err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	for _, backend := range []string{"memory", "etcd, two servers"} {
		t.Run(backend, func(t *testing.T) {
			for i, s := range servers {
				name := strings.Join(s.flags, " ")
				if name == "" {
					name = "defaults"
				}
				t.Run(fmt.Sprintf("server %d %s", i+1, name), func(t *testing.T) {
					e := transcriptEnv(t, backend, s.flags)
					for _, f := range s.flows {
						t.Run(f.title, func(t *testing.T) { (&replay{t: t, e: e, vars: map[string]any{}}).run(f) })
					}
				})
			}
		})
	}
}

// transcriptEnv starts a server as `dlock serve FLAGS` would, for the few
// flags the transcript uses.
func transcriptEnv(t *testing.T, backend string, flags []string) *env {
	rules := lock.DefaultRules()
	refs := false
	for _, f := range flags {
		name, val, _ := strings.Cut(f, "=")
		var err error
		switch name {
		case "--allow-multi-node-download":
			rules.AllowMultiNodeDownload, err = strconv.ParseBool(val)
		case "--lock-ttl":
			rules.LockTTL, err = time.ParseDuration(val)
		case "--refcount":
			if refs = val == "server"; !refs && val != "off" {
				err = fmt.Errorf("not off or server")
			}
		default:
			err = fmt.Errorf("the transcript's servers take no such flag")
		}
		if err != nil {
			t.Fatalf("%s: %v", f, err)
		}
	}
	if backend == "memory" {
		return newEnv(t, func(c *memory.Config) {
			c.Rules = rules
			if refs {
				store, err := refcount.OpenServerStore(t.TempDir() + "/refcount.db")
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { store.Close() })
				c.RefStore = store
			}
		})
	}
	return newPairEnv(t, func(c *etcd.Config) { c.Rules = rules; c.RefCounting = refs })
}

// The transcript, parsed.
type (
	tServer struct {
		flags []string
		flows []tFlow
	}
	tFlow struct {
		title string
		steps []tStep
	}
	tStep struct {
		line   int
		kind   string // "call", "await", "parallel", "stream", "data"
		stream string // stream and data
		n      int    // parallel
		method string
		path   string
		body   string
		want   []tAnswer // call and await: one; parallel: groups
	}
	tAnswer struct {
		count  int // parallel groups
		status int
		fields map[string]any
	}
)

func parseTranscript(text string) ([]tServer, error) {
	var servers []tServer
	var last *tStep // the request an answer line belongs to
	lines := strings.Split(text, "\n")
	for i, raw := range lines {
		n := i + 1
		line := strings.TrimSpace(raw)
		if line == "" || strings.HasPrefix(line, "# ") || line == "#" {
			continue
		}
		fail := func(format string, args ...any) ([]tServer, error) {
			return nil, fmt.Errorf("line %d %q: %s", n, line, fmt.Sprintf(format, args...))
		}
		if rest, ok := strings.CutPrefix(line, "== server"); ok {
			servers = append(servers, tServer{flags: strings.Fields(rest)})
			last = nil
			continue
		}
		if len(servers) == 0 {
			return fail("before the first == server")
		}
		s := &servers[len(servers)-1]
		if title, ok := strings.CutPrefix(line, "## "); ok {
			s.flows = append(s.flows, tFlow{title: title})
			last = nil
			continue
		}
		if len(s.flows) == 0 {
			return fail("before the first ## flow")
		}
		f := &s.flows[len(s.flows)-1]
		step := tStep{line: n}
		var req string
		switch head, rest, _ := strings.Cut(line, " "); {
		case head == ">":
			step.kind, req = "call", rest
		case head == "await" && strings.HasPrefix(rest, "> "):
			step.kind, req = "await", rest[2:]
		case head == "parallel":
			count, r, _ := strings.Cut(rest, " > ")
			var err error
			if step.n, err = strconv.Atoi(count); err != nil || step.n < 2 {
				return fail("parallel wants a count of 2 or more")
			}
			step.kind, req = "parallel", r
		case head == "stream":
			name, r, ok := strings.Cut(rest, " > ")
			if !ok || !strings.HasPrefix(r, "GET ") {
				return fail("stream wants NAME > GET PATH")
			}
			step.kind, step.stream, step.method, step.path = "stream", name, "GET", strings.TrimPrefix(r, "GET ")
		case head == "<":
			if last == nil {
				return fail("an answer without a request")
			}
			a, err := parseAnswer(rest, last.kind == "parallel")
			if err != nil {
				return fail("%v", err)
			}
			if last.kind != "parallel" && len(last.want) == 1 {
				return fail("a second answer to one request")
			}
			last.want = append(last.want, a)
			continue
		case strings.HasPrefix(rest, "< data: "):
			step.kind, step.stream = "data", head
			a, err := parseFields(strings.TrimPrefix(rest, "< data: "))
			if err != nil {
				return fail("%v", err)
			}
			step.want = []tAnswer{{fields: a}}
		default:
			return fail("not a line of the format (the file's header describes it)")
		}
		if req != "" {
			method, r, _ := strings.Cut(req, " ")
			path, body, _ := strings.Cut(r, " ")
			if method != "GET" && method != "POST" || !strings.HasPrefix(path, "/") {
				return fail("a request is METHOD /PATH [BODY]")
			}
			step.method, step.path, step.body = method, path, body
		}
		f.steps = append(f.steps, step)
		last = nil
		if step.kind == "call" || step.kind == "await" || step.kind == "parallel" {
			last = &f.steps[len(f.steps)-1]
		}
	}
	for _, s := range servers {
		for _, f := range s.flows {
			for _, st := range f.steps {
				if (st.kind == "call" || st.kind == "await" || st.kind == "parallel") && len(st.want) == 0 {
					return nil, fmt.Errorf("line %d: a request without its answer", st.line)
				}
			}
		}
	}
	return servers, nil
}

// parseAnswer reads "STATUS {FIELDS}", with "Kx " first in a parallel
// step's groups.
func parseAnswer(s string, counted bool) (tAnswer, error) {
	var a tAnswer
	if counted {
		k, rest, ok := strings.Cut(s, "x ")
		n, err := strconv.Atoi(k)
		if !ok || err != nil || n < 1 {
			return a, fmt.Errorf("a parallel answer is Kx STATUS {FIELDS}")
		}
		a.count, s = n, rest
	}
	st, rest, _ := strings.Cut(s, " ")
	var err error
	if a.status, err = strconv.Atoi(st); err != nil {
		return a, fmt.Errorf("status %q", st)
	}
	a.fields, err = parseFields(rest)
	return a, err
}

func parseFields(s string) (map[string]any, error) {
	var m map[string]any
	if err := decodeNumbers([]byte(s), &m); err != nil || m == nil {
		return nil, fmt.Errorf("fields %q are not a JSON object: %v", s, err)
	}
	return m, nil
}

// decodeNumbers decodes JSON keeping numbers exact: tokens are 64-bit.
func decodeNumbers(data []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(data))
	d.UseNumber()
	if err := d.Decode(v); err != nil {
		return err
	}
	if d.More() {
		return fmt.Errorf("more after the JSON value")
	}
	return nil
}

// replay runs one flow against e.
type replay struct {
	t       *testing.T
	e       *env
	vars    map[string]any
	streams map[string]*dataLines
}

func (r *replay) run(f tFlow) {
	for _, st := range f.steps {
		switch st.kind {
		case "call":
			status, body := r.do(st.method, st.path, r.subst(st.body))
			if err := r.match(st.want[0], status, body, r.vars); err != nil {
				r.t.Fatalf("line %d, %s %s: %v", st.line, st.method, st.path, err)
			}
		case "await":
			kit.Await(r.t, fmt.Sprintf("line %d's answer", st.line), func() error {
				status, body := r.do(st.method, st.path, r.subst(st.body))
				try := maps.Clone(r.vars) // an answer that does not match binds nothing
				if err := r.match(st.want[0], status, body, try); err != nil {
					return err
				}
				r.vars = try
				return nil
			})
		case "parallel":
			r.parallel(st)
		case "stream":
			r.open(st)
		case "data":
			s := r.streams[st.stream]
			if s == nil {
				r.t.Fatalf("line %d: no stream %s open in this flow", st.line, st.stream)
			}
			got := s.next(r.t, st.line)
			if err := r.matchFields(st.want[0].fields, got, r.vars, ""); err != nil {
				r.t.Fatalf("line %d, stream %s: data %s: %v", st.line, st.stream, got, err)
			}
		}
	}
}

// subst puts the values of the variables named in a request body in, the
// longest names first ($t1 before $t).
func (r *replay) subst(body string) string {
	names := slices.SortedFunc(maps.Keys(r.vars), func(a, b string) int { return cmp.Compare(len(b), len(a)) })
	for _, name := range names {
		body = strings.ReplaceAll(body, "$"+name, fmt.Sprint(r.vars[name]))
	}
	if strings.Contains(body, "$") {
		r.t.Fatalf("request %s names a variable no answer bound", body)
	}
	return body
}

// do sends a request to the server whose turn it is and checks what every
// answer must be.
func (r *replay) do(method, path, body string) (int, []byte) {
	r.t.Helper()
	req, err := http.NewRequest(method, r.e.base(&r.e.calls)+path, strings.NewReader(body))
	if err != nil {
		r.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		r.t.Fatal(err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		r.t.Fatal(err)
	}
	if got, want := resp.Header.Get(api.EpochHeader), r.e.backend().Info().Epoch; got != want {
		r.t.Fatalf("%s %s: epoch header %q, want %q", method, path, got, want)
	}
	if err := originalReads(path, resp.StatusCode, data); err != nil {
		r.t.Fatalf("%s %s %s: %d %s: %v", method, path, body, resp.StatusCode, data, err)
	}
	return resp.StatusCode, data
}

// originalReads checks that the original client can read an answer: the
// fields it reads have the types it decodes them into, and an error's text
// is one it neither misses nor retries.
func originalReads(path string, status int, data []byte) error {
	var shape any
	switch {
	case path == "/lock" && (status == http.StatusOK || status == http.StatusForbidden):
		shape = &struct {
			Acquired bool   `json:"acquired"`
			Skip     bool   `json:"skip"`
			Message  string `json:"message"`
			Error    string `json:"error"`
		}{}
	case path == "/unlock":
		shape = &struct {
			Released bool   `json:"released"`
			Message  string `json:"message"`
		}{}
	default:
		shape = &map[string]any{}
	}
	if err := json.Unmarshal(data, shape); err != nil {
		return fmt.Errorf("the original client cannot read it: %w", err)
	}
	if status >= 400 && status < 500 {
		var e api.ErrorBody
		if err := json.Unmarshal(data, &e); err != nil || e.Error == "" || e.Message != e.Error || e.Code == "" {
			return fmt.Errorf("an error body needs code, and error = message: %+v %v", e, err)
		}
		for _, word := range []string{"timeout", "connection", "network", "EOF", "refused"} {
			if strings.Contains(e.Message, word) {
				return fmt.Errorf("the message has %q: the original client would retry it", word)
			}
		}
	}
	return nil
}

// match checks a status and the fields of a JSON answer, binding the
// variables it meets for the first time in vars.
func (r *replay) match(want tAnswer, status int, body []byte, vars map[string]any) error {
	var got map[string]any
	if err := decodeNumbers(body, &got); err != nil {
		return fmt.Errorf("answer %s is not a JSON object: %v", body, err)
	}
	if status != want.status {
		return fmt.Errorf("status %d %s, want %d", status, body, want.status)
	}
	if err := r.matchFields(want.fields, got, vars, ""); err != nil {
		return fmt.Errorf("%s: %v", body, err)
	}
	return nil
}

func (r *replay) matchFields(want, got map[string]any, vars map[string]any, in string) error {
	for k, w := range want {
		g, present := got[k]
		switch w := w.(type) {
		case nil:
			if present && g != nil {
				return fmt.Errorf("%s%s is %v, want it absent", in, k, g)
			}
			continue
		case map[string]any:
			gm, ok := g.(map[string]any)
			if !ok {
				return fmt.Errorf("%s%s is %v, want an object", in, k, g)
			}
			if err := r.matchFields(w, gm, vars, in+k+"."); err != nil {
				return err
			}
			continue
		case string:
			if name, ok := strings.CutPrefix(w, "$"); ok {
				if !present || g == nil {
					return fmt.Errorf("%s%s is absent, want $%s", in, k, name)
				}
				if v, bound := vars[name]; !bound {
					vars[name] = g
				} else if !reflect.DeepEqual(v, g) {
					return fmt.Errorf("%s%s is %v, want $%s = %v", in, k, g, name, v)
				}
				continue
			}
		}
		if !present || !reflect.DeepEqual(w, g) {
			return fmt.Errorf("%s%s is %v, want %v", in, k, g, w)
		}
	}
	return nil
}

// parallel sends n requests at once, spread over the servers, and matches
// the answers to the groups in order, each answer to one group.
func (r *replay) parallel(st tStep) {
	type answer struct {
		status int
		body   []byte
	}
	answers := make([]answer, st.n)
	bases := make([]string, st.n)
	for i := range bases {
		bases[i] = r.e.base(&r.e.calls)
	}
	start := make(chan struct{})
	var wg sync.WaitGroup
	errs := make(chan error, st.n)
	for i := range st.n {
		body := strings.ReplaceAll(r.subst(strings.ReplaceAll(st.body, "$i", "\x00")), "\x00", strconv.Itoa(i+1))
		wg.Go(func() {
			<-start
			resp, err := http.Post(bases[i]+st.path, "application/json", strings.NewReader(body))
			if err != nil {
				errs <- err
				return
			}
			defer resp.Body.Close()
			data, err := io.ReadAll(resp.Body)
			if err == nil {
				err = originalReads(st.path, resp.StatusCode, data)
			}
			if err != nil {
				errs <- fmt.Errorf("request %d: %w", i+1, err)
			}
			answers[i] = answer{resp.StatusCode, data}
		})
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		r.t.Fatalf("line %d: %v", st.line, err)
	}
	used := make([]bool, st.n)
	for _, g := range st.want {
		found := 0
		for i, a := range answers {
			if used[i] || found == g.count {
				continue
			}
			try := maps.Clone(r.vars)
			if r.match(g, a.status, a.body, try) == nil {
				used[i], found, r.vars = true, found+1, try
			}
		}
		if found != g.count {
			var all []string
			for _, a := range answers {
				all = append(all, fmt.Sprintf("%d %s", a.status, a.body))
			}
			r.t.Fatalf("line %d: %d answers match %d %v, want %d; the answers:\n%s", st.line, found, g.status, g.fields, g.count, strings.Join(all, "\n"))
		}
	}
	for i, u := range used {
		if !u {
			r.t.Fatalf("line %d: answer %d %s matches no group", st.line, answers[i].status, answers[i].body)
		}
	}
}

// dataLines are the `data:` lines of an event stream, read as the original
// client reads them: every other line is passed over.
type dataLines struct {
	lines chan string
	err   chan error
}

// open opens an event stream, on another server than the calls' when there
// are two, and waits for its subscribed event.
func (r *replay) open(st tStep) {
	if r.streams == nil {
		r.streams = map[string]*dataLines{}
	}
	if r.streams[st.stream] != nil {
		r.t.Fatalf("line %d: stream %s is open already", st.line, st.stream)
	}
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, r.e.base(&r.e.subs)+st.path, nil)
	if err != nil {
		r.t.Fatal(err)
	}
	req.Header.Set("Accept", "text/event-stream")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		cancel()
		r.t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		cancel()
		r.t.Fatalf("line %d: GET %s: %d %s", st.line, st.path, resp.StatusCode, body)
	}
	s := &dataLines{lines: make(chan string, 64), err: make(chan error, 1)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(nil, 64<<10)
		for sc.Scan() {
			if data, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
				select {
				case s.lines <- data:
				case <-ctx.Done():
					return
				}
			}
		}
		s.err <- fmt.Errorf("the stream ended: %v", sc.Err())
	}()
	r.t.Cleanup(func() {
		cancel()
		resp.Body.Close()
		<-done
	})
	if first := s.next(r.t, st.line); first["event"] != "subscribed" || first["type"] != nil {
		r.t.Fatalf("line %d: the stream's first data %v, want subscribed, without a type", st.line, first)
	}
	r.streams[st.stream] = s
}

// next returns the stream's next data line, decoded, and checks that the
// original client can read it.
func (s *dataLines) next(t *testing.T, line int) map[string]any {
	t.Helper()
	timeout := time.NewTimer(kit.Patience)
	defer timeout.Stop()
	select {
	case data := <-s.lines:
		var ev struct { // what the original client decodes
			Type        string    `json:"type"`
			ResourceID  string    `json:"resource_id"`
			NodeID      string    `json:"node_id"`
			Success     bool      `json:"success"`
			Error       string    `json:"error"`
			CompletedAt time.Time `json:"completed_at"`
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			t.Fatalf("line %d: the original client cannot read data %s: %v", line, data, err)
		}
		var m map[string]any
		if err := decodeNumbers([]byte(data), &m); err != nil {
			t.Fatalf("line %d: data %s: %v", line, data, err)
		}
		return m
	case err := <-s.err:
		t.Fatalf("line %d: %v", line, err)
	case <-timeout.C:
		t.Fatalf("line %d: no data line within %v", line, kit.Patience)
	}
	return nil
}

// TestParseTranscriptRejects: a line the format does not know, or a
// request without its answer, is an error, never a step passed over.
func TestParseTranscriptRejects(t *testing.T) {
	head := "== server\n## flow\n"
	for _, bad := range []string{
		"> POST /lock {}\n",                                // no answer
		"> POST /lock {}\n< 200 {}\n< 200 {}\n",            // two answers
		"< 200 {}\n",                                       // no request
		"> PUT /lock {}\n< 200 {}\n",                       // a method it does not send
		"> POST /lock {}\n< 200 [1]\n",                     // fields not an object
		"> POST /lock {}\n<200 {}\n",                       // not a line of the format
		"parallel 10 > POST /lock {}\n< 200 {}\n",          // a group without its count
		"parallel 1 > POST /lock {}\n< 1x 200 {}\n",        // not parallel
		"stream s > POST /lock\n",                          // streams are GET
		"s < data {}\n",                                    // data: without its colon
		"await POST /status\n< 200 {}\n",                   // await wants "> "
		"#comment without its space\n> GET /x\n< 200 {}\n", // not a comment
		"> GET /status\n< 2OO {}\n",                        // status not a number
	} {
		if _, err := parseTranscript(head + bad); err == nil {
			t.Errorf("parsed %q", bad)
		}
	}
	if _, err := parseTranscript("## flow\n"); err == nil {
		t.Error("a flow before its server")
	}
	s, err := parseTranscript(head + "parallel 3 > POST /lock {\"node_id\":\"n-$i\"}\n< 1x 200 {}\n< 2x 200 {}\nstream s > GET /subscribe?node_id=n\ns < data: {\"event\":\"x\"}\n")
	if err != nil || len(s) != 1 || len(s[0].flows[0].steps) != 3 || len(s[0].flows[0].steps[0].want) != 2 {
		t.Fatalf("a good transcript: %+v %v", s, err)
	}
}

// TestMigrationExcerpts: every exchange docs/MIGRATION.md shows is a run of
// lines of the transcript, which TestOriginalClientTranscript replays, and
// the page shows nothing else to run.
func TestMigrationExcerpts(t *testing.T) {
	doc, err := os.ReadFile("../docs/MIGRATION.md")
	if err != nil {
		t.Fatal(err)
	}
	tr, err := os.ReadFile("testdata/original-client.transcript")
	if err != nil {
		t.Fatal(err)
	}
	lines := func(s string) []string {
		var out []string
		for l := range strings.Lines(s) {
			if l = strings.TrimSpace(l); l != "" {
				out = append(out, l)
			}
		}
		return out
	}
	transcript := lines(string(tr))
	var blocks []string
	var block *strings.Builder // the open block's text, nil outside one
	for n, l := range strings.Split(string(doc), "\n") {
		fence, ok := strings.CutPrefix(strings.TrimSpace(l), "```")
		switch {
		case !ok && block != nil:
			block.WriteString(l + "\n")
		case !ok:
		case block != nil:
			blocks = append(blocks, block.String())
			block = nil
		default:
			if fence != "transcript" {
				t.Errorf("line %d: a %q block: this page shows only transcript excerpts, which a test runs", n+1, fence)
			}
			block = &strings.Builder{}
		}
	}
	if block != nil || len(blocks) == 0 {
		t.Fatalf("%d blocks, and one not closed: %v", len(blocks), block != nil)
	}
	for _, b := range blocks {
		ex := lines(b)
		found := false
		for i := 0; i+len(ex) <= len(transcript) && !found; i++ {
			found = slices.Equal(transcript[i:i+len(ex)], ex)
		}
		if !found {
			t.Errorf("this excerpt is not a run of lines of the transcript:\n%s", b)
		}
	}
}
