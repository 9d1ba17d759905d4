package server

import (
	"context"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/emulation"
	"github.com/chromedp/chromedp"
	"github.com/chromedp/chromedp/kb"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/etcd"
	"github.com/dlock/dlock/lock/memory"
)

// screenshotEnv names the file TestUIBrowser saves its screenshot to, for
// example docs/ui.png (a path relative to the repository root).
const screenshotEnv = "DLOCK_UI_SCREENSHOT"

// chromium finds Debian's chromium, which `make deps` installs as root.
func chromium(t *testing.T) string {
	t.Helper()
	path, err := exec.LookPath("chromium")
	if err == nil {
		return path
	}
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED LOUDLY: TestUIBrowser needs Debian's chromium and installing it needs root; run `make test` as root")
	}
	t.Fatal("chromium is not installed: run `make deps` as root")
	return ""
}

// browser starts a headless chromium that never reaches for the network:
// without these flags it tries to, and the network is closed here. The
// returned func closes it and waits for it and chromedp's goroutines to end.
func browser(t *testing.T) (context.Context, func()) {
	t.Helper()
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(),
		chromedp.ExecPath(chromium(t)),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.Flag("disable-extensions", true),
		chromedp.Flag("disable-default-apps", true),
		chromedp.Flag("force-color-profile", "srgb"),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1360, 900),
	)
	ctx, cancel := chromedp.NewContext(actx)
	return ctx, func() {
		cctx, ccancel := context.WithTimeout(ctx, 20*time.Second)
		_ = chromedp.Cancel(cctx)
		ccancel()
		cancel()
		cancelAlloc()
	}
}

// pollUI waits until the JavaScript expression is truthy in the page and
// returns its value; the timeout only bounds a broken run.
func pollUI[T any](t *testing.T, ctx context.Context, what, expr string) T {
	t.Helper()
	v, err := chromedp.Run(ctx, chromedp.Poll[T](expr, chromedp.WithPollingInterval(20*time.Millisecond), chromedp.WithPollingTimeout(30*time.Second)))
	if err != nil {
		text, _ := chromedp.Run(ctx, chromedp.Evaluate[string](`document.querySelector("main").innerText`))
		t.Fatalf("waiting for %s: %v\npage shows:\n%s", what, err, text)
	}
	return v
}

func uiEval[T any](t *testing.T, ctx context.Context, expr string) T {
	t.Helper()
	v, err := chromedp.Run(ctx, chromedp.Evaluate[T](expr))
	if err != nil {
		t.Fatalf("evaluating %s: %v", expr, err)
	}
	return v
}

// What a person sees in a held key's row: holder and the queue in order.
const rowJS = `(() => {
	const row = document.querySelector('#keys tr[data-key=' + JSON.stringify(%q) + ']');
	if (!row) return null;
	return {
		holder: row.querySelector('.holder .node').textContent,
		token: row.querySelector('.token').textContent,
		held: row.querySelector('time.held').textContent,
		queue: [...row.querySelectorAll('.queue li')].map((li) => li.textContent),
	};
})()`

type uiRow struct {
	Holder string   `json:"holder"`
	Token  string   `json:"token"`
	Held   string   `json:"held"`
	Queue  []string `json:"queue"`
}

// TestUIBrowser drives the live view in a real headless chromium: a holder
// and two waiters show in order, a failed holder's hand-off arrives without
// a reload, and the filter narrows what is shown. On memory, one server; on
// etcd, the page reads one of two servers of one data set, and the calls
// and streams that change what it shows alternate between them.
func TestUIBrowser(t *testing.T) {
	t.Run("memory", func(t *testing.T) {
		testUIBrowser(t, func(prep func(*Server)) (*env, string) {
			e := newEnvWith(t, envConfig{
				// What the test shows must hold still however long a
				// loaded machine takes to start chromium: no lease or
				// claim runs out.
				mod:  func(c *memory.Config) { c.LockTTL = time.Hour; c.ClaimTimeout = 0 },
				prep: prep,
			})
			return e, e.ts.URL
		}, os.Getenv(screenshotEnv))
	})
	t.Run("etcd, two servers", func(t *testing.T) {
		testUIBrowser(t, func(prep func(*Server)) (*env, string) {
			c := newClusterPrep(t, 2, func(c *etcd.Config) { c.LockTTL = time.Hour; c.ClaimTimeout = 0 }, prep)
			e := &env{t: t, srv: c.members[0].srv, c: c, subs: 1}
			return e, c.members[0].url
		}, "")
	})
}

// testUIBrowser runs the browser test on the env newEnv starts, whose
// /ui is at the URL it returns; prep is called on its servers before they
// serve. screenshot, when not empty, is where the page's picture goes.
func testUIBrowser(t *testing.T, newEnv func(prep func(*Server)) (*env, string), screenshot string) {
	ctx, closeBrowser := browser(t)
	// The page's first reads of the completions are answered only once
	// node-a's failure has arrived on the live feed, each with the state of
	// when it was asked: the worst order, made certain. An answer read
	// before an event must not undo it (the page once lost the event so,
	// when a loaded machine answered late).
	snapshotsHeld := make(chan struct{})
	release := sync.OnceFunc(func() { close(snapshotsHeld) })
	e, uiURL := newEnv(func(s *Server) {
		rt := s.routes["/ui/api/completions"]
		h := rt.h
		rt.h = func(w http.ResponseWriter, r *http.Request) error {
			select {
			case <-snapshotsHeld:
				return h(w, r)
			default:
			}
			snap := httptest.NewRecorder()
			err := h(snap, r)
			select {
			case <-snapshotsHeld:
			case <-r.Context().Done():
			}
			maps.Copy(w.Header(), snap.Header())
			w.WriteHeader(snap.Code)
			w.Write(snap.Body.Bytes())
			return err
		}
	})
	defer release()
	defer closeBrowser() // before the server's cleanup, and before goleak looks
	// Chromium starts before the locks are taken, not in the middle.
	if err := chromedp.Do(ctx); err != nil {
		t.Fatal(err)
	}

	lockAs := func(typ, res, node string) {
		t.Helper()
		body := fmt.Sprintf(`{"type":%q,"resource_id":%q,"node_id":%q}`, typ, res, node)
		if status, got := e.call("POST", "/lock", body); status != 200 {
			t.Fatalf("lock %s %s %s: %d %v", typ, res, node, status, got)
		}
	}
	unlockAs := func(typ, res, node, errMsg string) {
		t.Helper()
		body := fmt.Sprintf(`{"type":%q,"resource_id":%q,"node_id":%q,"success":%t,"error":%q}`, typ, res, node, errMsg == "", errMsg)
		if status, got := e.call("POST", "/unlock", body); status != 200 {
			t.Fatalf("unlock %s %s %s: %d %v", typ, res, node, status, got)
		}
	}

	const (
		layer = "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
		other = "sha256:60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752"
		base  = "sha256:fd61d9c3fb1d6c0a5b4dfb4d6cd5c3e2c0a6f6b8f1c7f8e4a1b2c3d4e5f60718"
		gone  = "sha256:2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae"
		busy  = "sha256:b5bb9d8014a0f9b1d61e21e796d78dccdf1352f23cd32812f4850b878ae4944c"
	)
	// The waiters have session streams, as real clients do, so the
	// hand-off is pushed to them; the holder holds under a ttl lease.
	for _, n := range []string{"node-b", "node-c", "node-e"} {
		s := e.subscribe("node_id="+n, "")
		s.Next(t)
	}
	lockAs("pull", layer, "node-a")
	lockAs("pull", layer, "node-b")
	lockAs("pull", layer, "node-c")
	lockAs("pull", other, "node-d")
	lockAs("pull", other, "node-e")
	lockAs("update", base, "builder-1")
	for _, n := range []string{"node-g", "node-h", "node-i", "node-j"} {
		lockAs("pull", busy, n)
	}
	lockAs("pull", gone, "node-f")
	unlockAs("pull", gone, "node-f", "")

	// Light mode for the screenshot; the page follows the system's.
	if err := chromedp.Do(ctx,
		chromedp.Func(func(ctx context.Context, t *chromedp.Target) error {
			_, err := cdp.Call(ctx, t, emulation.SetEmulatedMedia, emulation.SetEmulatedMediaParams{
				Features: []*emulation.MediaFeature{{Name: "prefers-color-scheme", Value: "light"}},
			})
			return err
		}),
		chromedp.Navigate(uiURL+"/ui"),
	); err != nil {
		t.Fatal(err)
	}
	pollUI[bool](t, ctx, "the live feed to connect", `document.getElementById("conn").textContent === "Live"`)
	loadID := uiEval[string](t, ctx, `window.dlockLoadId`)

	var row uiRow
	row = pollUI[uiRow](t, ctx, "the holder and its queue", fmt.Sprintf(rowJS, "pull:"+layer))
	if row.Holder != "node-a" || !slices.Equal(row.Queue, []string{"node-b", "node-c"}) || row.Token == "" || row.Held == "" {
		t.Fatalf("row %+v, want node-a holding and node-b, node-c waiting in that order", row)
	}

	// The three sessions' streams are open (on etcd, two of them on the
	// other server, which tells this one while the page looks).
	pollUI[bool](t, ctx, "three sessions, each connected", `(() => {
		const rows = [...document.querySelectorAll('#sessions tbody tr')];
		return rows.length === 3 && rows.every((r) => r.innerText.includes("connected") && !r.innerText.includes("in grace"));
	})()`)

	unlockAs("pull", layer, "node-a", "disk full")
	row = pollUI[uiRow](t, ctx, "the hand-off to node-b", fmt.Sprintf(`(() => { const r = %s; return r && r.holder === "node-b" ? r : null; })()`,
		fmt.Sprintf(rowJS, "pull:"+layer)))
	if !slices.Equal(row.Queue, []string{"node-c"}) {
		t.Fatalf("after the hand-off: %+v, want node-c alone waiting", row)
	}
	completionJS := fmt.Sprintf(`(() => {
		const r = document.querySelector('#completions tr[data-key=' + JSON.stringify(%q) + ']');
		return r ? r.innerText : null;
	})()`, "pull:"+layer)
	done := pollUI[string](t, ctx, "node-a's failure among the completions", completionJS)
	// The page's reads of the completions, from before the failure, land.
	release()
	pollUI[bool](t, ctx, "the completions read at load", fmt.Sprintf(`document.querySelector('#completions tr[data-key=' + JSON.stringify(%q) + ']') !== null`, "pull:"+gone))
	if after := uiEval[string](t, ctx, completionJS+` || ""`); after != done {
		t.Fatalf("node-a's failure %q became %q once the completions read before it landed", done, after)
	}
	for _, want := range []string{"node-a", "failed", "disk full", "node-b"} {
		if !strings.Contains(done, want) {
			t.Fatalf("completion row %q lacks %q", done, want)
		}
	}
	if got := uiEval[string](t, ctx, `window.dlockLoadId`); got != loadID {
		t.Fatalf("the page was reloaded (load id %s, then %s): updates must arrive live", loadID, got)
	}

	// The filter: by resource, then by node.
	if err := chromedp.Do(ctx, chromedp.SendKeys(chromedp.CSS("#filter"), "60303ae")); err != nil {
		t.Fatal(err)
	}
	// Poll for exactly what the filter must leave: the rows of before stay
	// until the filtered page arrives.
	shownKeys := `[...document.querySelectorAll('#keys tbody tr')].map((r) => r.dataset.key).join(" ")`
	pollUI[bool](t, ctx, "the resource filter to leave pull:"+other, shownKeys+` === "pull:`+other+`"`)
	// From the keyboard: "/" focuses the filter and selects its text.
	if err := chromedp.Do(ctx, chromedp.Focus(chromedp.CSS("#held-h")), chromedp.KeyEvent("/"), chromedp.KeyEvent(kb.Backspace),
		chromedp.SendKeys(chromedp.CSS("#node"), "builder-1")); err != nil {
		t.Fatal(err)
	}
	pollUI[bool](t, ctx, "the node filter to leave update:"+base, shownKeys+` === "update:`+base+`" && location.search === "?node=builder-1"`)
	// Clear (keyboard: focus the button, press Enter).
	if err := chromedp.Do(ctx, chromedp.Focus(chromedp.CSS(`button[type=reset]`)), chromedp.KeyEvent(kb.Enter)); err != nil {
		t.Fatal(err)
	}
	pollUI[bool](t, ctx, "every key back", `document.querySelectorAll('#keys tbody tr').length === 4 && document.querySelectorAll('#sessions tbody tr').length === 3`)
	if got := uiEval[string](t, ctx, `window.dlockLoadId`); got != loadID {
		t.Fatal("the page was reloaded while filtering")
	}

	if out := screenshot; out != "" {
		if !filepath.IsAbs(out) {
			_, file, _, _ := runtime.Caller(0)
			out = filepath.Join(filepath.Dir(file), "..", out)
		}
		// Let the hand-off's highlight fade: the screenshot shows the
		// steady page.
		pollUI[bool](t, ctx, "the highlight to fade", `document.querySelectorAll("tr.flash").length === 0 || document.getAnimations().every((a) => a.playState === "finished")`)
		uiEval[bool](t, ctx, `document.activeElement.blur(), true`)
		png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(out, png, 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("screenshot saved to %s", out)
	}
}

// endableOps records the operator feeds its Inspector opens, so that a
// test can end the last one as the backend ends a feed that did not keep
// up: the server then ends the page's event stream.
type endableOps struct {
	lock.Inspector
	opened func(lock.OpStream)
}

func (o endableOps) WatchOps(ctx context.Context) (lock.OpStream, error) {
	st, err := o.Inspector.WatchOps(ctx)
	if err == nil {
		o.opened(st)
	}
	return st, err
}

// TestUIBrowserStates: the page's first seconds and its empty tables.
// Until the first data arrives it says it is loading, not "Live"; on an
// empty server each table says what would be there; a filter that matches
// nothing says so; a broken event stream says it is reconnecting. The
// first read of the held keys is held until the test lets it go, and a
// reconnecting stream until the test has seen the page say so: no timing
// decides what the page shows when it is looked at.
func TestUIBrowserStates(t *testing.T) {
	ctx, closeBrowser := browser(t)
	keysAsked := make(chan struct{}, 1)
	keysHeld := make(chan struct{})
	releaseKeys := sync.OnceFunc(func() { close(keysHeld) })
	var (
		mu         sync.Mutex
		lastFeed   lock.OpStream // the page's last operator feed
		streamGate chan struct{} // not nil: a new /ui/events waits until it is closed
	)
	e := newEnvWith(t, envConfig{
		prep: func(s *Server) {
			s.inspect = endableOps{s.inspect, func(st lock.OpStream) {
				mu.Lock()
				lastFeed = st
				mu.Unlock()
			}}
			keys := s.routes["/ui/api/keys"]
			hk := keys.h
			keys.h = func(w http.ResponseWriter, r *http.Request) error {
				select {
				case keysAsked <- struct{}{}:
				default:
				}
				select {
				case <-keysHeld:
				case <-r.Context().Done():
				}
				return hk(w, r)
			}
			events := s.routes["/ui/events"]
			he := events.h
			events.h = func(w http.ResponseWriter, r *http.Request) error {
				mu.Lock()
				gate := streamGate
				mu.Unlock()
				if gate != nil {
					select {
					case <-gate:
					case <-r.Context().Done():
					}
				}
				return he(w, r)
			}
		},
	})
	defer releaseKeys()
	defer closeBrowser() // before the server's cleanup, and before goleak looks

	if err := chromedp.Do(ctx, chromedp.Navigate(e.ts.URL+"/ui")); err != nil {
		t.Fatal(err)
	}
	select {
	case <-keysAsked:
	case <-time.After(30 * time.Second):
		t.Fatal("the page never asked for the held keys")
	}
	// The event stream is open and the keys are not read yet: the page
	// says it is loading, and the keys' table does not say it is empty.
	// (The completions and sessions, read apart, may have arrived.)
	pollUI[bool](t, ctx, "the badge to say loading", `document.getElementById("conn").textContent === "Loading…"`)
	type loadingState struct {
		Live     bool     `json:"live"`
		Busy     []string `json:"busy"`
		Rows     []string `json:"rows"`
		Counters []string `json:"counters"`
		Empty    bool     `json:"empty"`
	}
	const stateJS = `(() => ({
		live: document.getElementById("conn").classList.contains("live"),
		busy: ["totals", "keys"].map((id) => document.getElementById(id).getAttribute("aria-busy")),
		rows: [...document.querySelectorAll("#keys tbody tr")].map((r) => r.innerText.trim()),
		counters: [...document.querySelectorAll(".totals dd")].map((d) => d.textContent),
		empty: !document.getElementById("keys-empty").hidden,
	}))()`
	st := uiEval[loadingState](t, ctx, stateJS)
	if st.Live || !slices.Equal(st.Busy, []string{"true", "true"}) || !slices.Equal(st.Rows, []string{"Loading…"}) ||
		!slices.Equal(st.Counters, []string{"Loading…", "Loading…", "Loading…", "Loading…"}) || st.Empty {
		t.Fatalf("before the keys are read the page shows %+v, want it loading and not live", st)
	}

	releaseKeys()
	pollUI[bool](t, ctx, "the badge to say Live", `(() => { const c = document.getElementById("conn"); return c.textContent === "Live" && c.classList.contains("live"); })()`)
	st = uiEval[loadingState](t, ctx, stateJS)
	if !slices.Equal(st.Busy, []string{"false", "false"}) || len(st.Rows) != 0 ||
		!slices.Equal(st.Counters, []string{"0", "0", "0", "0"}) {
		t.Fatalf("once read, the empty server shows %+v", st)
	}
	emptyJS := `["keys-empty", "done-empty", "sess-empty"].map((id) => { const p = document.getElementById(id); return p.hidden ? "" : p.textContent; })`
	want := []string{
		"No key is held. Held keys appear here with their holder, fencing token and how long they have been held.",
		"No completion is kept. A holder’s unlock (success or failure) appears here for as long as the server keeps it (--completed-retention, 5 minutes unless set).",
		"No session: a node has a session while its event stream (/subscribe) is open, and for --session-grace after it closes.",
	}
	if got := pollUI[[]string](t, ctx, "the empty states", emptyJS+`.every((s) => s !== "") && `+emptyJS); !slices.Equal(got, want) {
		t.Fatalf("empty states %q, want %q", got, want)
	}
	if got := uiEval[[]string](t, ctx, `["keys", "completions", "sessions"].map((id) => document.getElementById(id).getAttribute("aria-busy"))`); !slices.Equal(got, []string{"false", "false", "false"}) {
		t.Fatalf("aria-busy %q once read", got)
	}

	// What the labels say, and that the ones one line cannot explain have
	// a tooltip.
	type label struct {
		Text  string `json:"text"`
		Title bool   `json:"title"`
	}
	labels := uiEval[[]label](t, ctx, `[...document.querySelectorAll(".totals dt, #keys th, #completions th, #sessions th")].map((e) => ({ text: e.textContent, title: e.title !== "" }))`)
	wantLabels := []label{
		{"Keys held", true}, {"Queued requests", true}, {"Node sessions", true}, {"Keys with state (held, queued or recently completed)", true},
		{"Key", false}, {"Holder", false}, {"Fencing token", true}, {"Held for", false}, {"Queue, in order", true},
		{"When", false}, {"Key", false}, {"Node", true}, {"Outcome", false}, {"Error", false}, {"Went to", true},
		{"Node", false}, {"Open streams", true}, {"State", true}, {"Keys held or awaited", true},
	}
	if !slices.Equal(labels, wantLabels) {
		t.Fatalf("labels %+v, want %+v", labels, wantLabels)
	}

	// A filter that matches nothing says so, in each table it filters;
	// the sessions, which only the node filters, keep their own words.
	if err := chromedp.Do(ctx, chromedp.SendKeys(chromedp.CSS("#filter"), "x")); err != nil {
		t.Fatal(err)
	}
	want[0], want[1] = "No key matches the filter “x”.", "No completion matches the filter “x”."
	if got := pollUI[[]string](t, ctx, "the filter's empty states", emptyJS+`[0].startsWith("No key matches") && `+emptyJS); !slices.Equal(got, want) {
		t.Fatalf("with the filter x: %q, want %q", got, want)
	}
	if err := chromedp.Do(ctx, chromedp.SendKeys(chromedp.CSS("#node"), "node-z")); err != nil {
		t.Fatal(err)
	}
	want = []string{
		"No key matches the filter “x” and the node “node-z”.",
		"No completion matches the filter “x” and the node “node-z”.",
		"No session matches the node “node-z”.",
	}
	if got := pollUI[[]string](t, ctx, "the node filter's empty states", emptyJS+`[2].startsWith("No session matches") && `+emptyJS); !slices.Equal(got, want) {
		t.Fatalf("with the filter x and the node node-z: %q, want %q", got, want)
	}

	// The stream breaks: the badge says so until it is open again.
	gate := make(chan struct{})
	mu.Lock()
	streamGate = gate
	feed := lastFeed
	mu.Unlock()
	feed.Close()
	pollUI[bool](t, ctx, "the badge to say the stream broke", `(() => { const c = document.getElementById("conn"); return c.textContent === "Reconnecting…" && !c.classList.contains("live"); })()`)
	mu.Lock()
	streamGate = nil
	mu.Unlock()
	close(gate)
	pollUI[bool](t, ctx, "the badge to say Live again", `document.getElementById("conn").textContent === "Live"`)
}
