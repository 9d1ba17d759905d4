package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"golang.org/x/time/rate"

	"github.com/dlock/dlock/internal/dlocktest"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/doctest"
)

// The modes of the pull benchmark, each on fresh daemons and directories.
const (
	// modeSingle is one node: containerd with its own built-in store.
	modeSingle = "single"
	// modeShared is N nodes, containerd and dlock-content each, on one
	// shared root coordinated by one dlock server.
	modeShared = "shared"
	// modeSeparate is N nodes, containerd with its own built-in store each.
	modeSeparate = "separate"
)

// pullBenchConfig is what the pull benchmark pulls, how many nodes pull
// it, and how fast the registry serves.
type pullBenchConfig struct {
	images, layers int
	layerMiB       float64 // the size of each layer's file; may be a fraction
	nodes          int
	uplinkMiB      float64 // MiB/s, for every node's blob downloads together
	modes          []string
}

var errPullBenchSetting = errors.New("pull benchmark setting")

// pullBenchConfigFromEnv reads the DLOCK_PULL_* variables `make bench-pull`
// passes, each with its default.
func pullBenchConfigFromEnv() (pullBenchConfig, error) {
	cfg := pullBenchConfig{modes: []string{modeSingle, modeShared, modeSeparate}}
	var errs []error
	num := func(env string, def float64, integer bool) float64 {
		s := os.Getenv(env)
		if s == "" {
			return def
		}
		v, err := strconv.ParseFloat(s, 64)
		if err != nil || v <= 0 || (integer && v != float64(int(v))) {
			kind := "a positive number"
			if integer {
				kind = "a positive integer"
			}
			errs = append(errs, fmt.Errorf("%w: %s=%q is not %s", errPullBenchSetting, env, s, kind))
		}
		return v
	}
	cfg.images = int(num("DLOCK_PULL_IMAGES", 4, true))
	cfg.layers = int(num("DLOCK_PULL_LAYERS", 8, true))
	cfg.layerMiB = num("DLOCK_PULL_LAYER_MIB", 4, false)
	cfg.nodes = int(num("DLOCK_PULL_NODES", 3, true))
	cfg.uplinkMiB = num("DLOCK_PULL_UPLINK_MIB", 16, false)
	if m := os.Getenv("DLOCK_PULL_MODES"); m != "" {
		cfg.modes = strings.Split(m, ",")
		for _, mode := range cfg.modes {
			if !slices.Contains([]string{modeSingle, modeShared, modeSeparate}, mode) {
				errs = append(errs, fmt.Errorf("%w: DLOCK_PULL_MODES=%q: %q is not single, shared or separate", errPullBenchSetting, m, mode))
			}
		}
	}
	return cfg, errors.Join(errs...)
}

// BenchmarkSharedPull pulls, with real containerd 1.6 daemons, random
// images from a real docker-registry whose uplink is one throttle for all
// nodes: one node alone, N nodes sharing one store through dlock-content,
// and N nodes with a store each. It prints the wall times, the download
// phases, the registry's bytes and the timeline of one layer another node
// waited for. `make bench-pull` runs it and appends what it prints to
// docs/BENCHMARKS.md; alone, as root:
//
//	go test -run '^$' -bench '^BenchmarkSharedPull$' -benchtime 1x -timeout 60m ./cmd/dlock-content
//
// DLOCK_PULL_IMAGES, DLOCK_PULL_LAYERS, DLOCK_PULL_LAYER_MIB,
// DLOCK_PULL_NODES and DLOCK_PULL_UPLINK_MIB (MiB/s) change the sizes;
// DLOCK_PULL_MODES (single,shared,separate) picks the modes.
func BenchmarkSharedPull(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("SKIPPED LOUDLY: BenchmarkSharedPull needs root to run containerd; run `make bench-pull` as root")
	}
	cfg, err := pullBenchConfigFromEnv()
	if err != nil {
		b.Fatal(err)
	}
	// One run takes minutes: go test's first call, with b.N = 1, is the
	// only one at the default -benchtime as at 1x.
	r := runPullBench(b, cfg)
	fmt.Println(r.String())
	for _, m := range r.modes {
		b.ReportMetric(m.wall.Seconds(), m.mode+"-s")
		b.ReportMetric(float64(m.registryBytes)/(1<<20), m.mode+"-registry-MiB")
	}
	if single := r.mode(modeSingle); single != nil {
		for _, m := range r.modes {
			if m != single {
				b.ReportMetric(m.wall.Seconds()/single.wall.Seconds(), m.mode+"/single")
			}
		}
	}
	if shared := r.mode(modeShared); shared != nil {
		b.ReportMetric(shared.download.Seconds(), "shared-download-s")
	}
	b.ReportMetric(r.bound(r.total).Seconds(), "uplink-bound-s")
}

// TestSharedPullBench runs the pull benchmark's harness small: one node
// alone, then two sharing a store, and checks what the benchmark's report
// rests on: each blob came from the registry once in shared mode, and the
// timeline of a layer has its holder's download and publish in causal
// order.
func TestSharedPullBench(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED LOUDLY: TestSharedPullBench needs root to run containerd; run `make test` as root to include it")
	}
	r := runPullBench(t, pullBenchConfig{images: 1, layers: 2, layerMiB: 0.25, nodes: 2, uplinkMiB: 64, modes: []string{modeSingle, modeShared}})
	t.Log("\n" + r.String())

	for _, m := range r.modes {
		pulled := map[string]int{}
		for _, p := range m.pulls {
			if p.err == nil {
				pulled[p.node.name]++
			}
		}
		for i := range m.nodes {
			if n := fmt.Sprint("node", i); pulled[n] != r.cfg.images {
				t.Errorf("%s: %s pulled %d images, want %d", m.mode, n, pulled[n], r.cfg.images)
			}
		}
	}
	shared := r.mode(modeShared)
	served := shared.servedPerBlob(r.blobs)
	for d := range r.blobs {
		if served[d] != 1 {
			t.Errorf("shared: blob %s served whole %d times, want once", d, served[d])
		}
	}
	if shared.registryBytes != r.total {
		t.Errorf("shared: the registry served %d bytes, want %d (the image once)", shared.registryBytes, r.total)
	}

	tl := r.timeline
	if tl == nil {
		t.Fatal("no timeline: no layer was published in shared mode")
	}
	if !tl.request.Before(tl.lastByte) {
		t.Errorf("timeline of %s: the holder's registry request at %v is not before its last byte at %v", tl.digest, tl.request, tl.lastByte)
	}
	// The log's times are in whole milliseconds, cut down.
	if tl.published.Before(tl.lastByte.Truncate(time.Millisecond)) {
		t.Errorf("timeline of %s: published at %v, before the last byte at %v", tl.digest, tl.published, tl.lastByte)
	}
	if tl.unlockSent.Before(tl.published) {
		t.Errorf("timeline of %s: unlock sent at %v, before published at %v", tl.digest, tl.unlockSent, tl.published)
	}
	if tl.downloading.IsZero() || tl.downloading.After(tl.published) {
		t.Errorf("timeline of %s: the holder %s logged no download before its publish at %v (downloading: %v)", tl.digest, tl.holder, tl.published, tl.downloading)
	}
	// No waiter is told before the blob is in the shared folder.
	published := map[string]time.Time{}
	for _, ev := range shared.events {
		if ev.msg == "pull: published" {
			published[ev.digest] = ev.at
		}
	}
	for _, ev := range shared.events {
		if ev.msg != "pull: told done" {
			continue
		}
		if p, ok := published[ev.digest]; !ok || ev.at.Before(p) {
			t.Errorf("%s was told %s is done at %v; published at %v (ok %v)", ev.node, ev.digest, ev.at, p, ok)
		}
	}
}

// A benchBlob is one blob of the benchmark's images.
type benchBlob struct {
	image int
	layer int // -1 for the image's config
	size  int64
}

func (b benchBlob) String() string {
	if b.layer < 0 {
		return fmt.Sprintf("image %d's config", b.image)
	}
	return fmt.Sprintf("image %d layer %d", b.image, b.layer)
}

// pullBenchResult is what one run of the harness measured.
type pullBenchResult struct {
	cfg      pullBenchConfig
	version  string               // containerd's
	blobs    map[string]benchBlob // by digest
	total    int64                // bytes of every image's blobs
	modes    []*modeResult
	timeline *timeline // of one layer in shared mode
}

func (r *pullBenchResult) mode(name string) *modeResult {
	for _, m := range r.modes {
		if m.mode == name {
			return m
		}
	}
	return nil
}

// bound is the time the uplink needs for n bytes.
func (r *pullBenchResult) bound(n int64) time.Duration {
	return time.Duration(float64(n) / (r.cfg.uplinkMiB * (1 << 20)) * float64(time.Second))
}

// modeResult is one mode's run: every node pulling every image at once.
type modeResult struct {
	mode          string
	nodes         int
	start         time.Time // the barrier opened
	wall          time.Duration
	download      time.Duration // from start to the last blob byte (shared: or pull-log event)
	lastByte      time.Duration // from start to the last blob byte
	pulls         []pullRun
	requests      []blobRequest
	registryBytes int64
	events        []pullEvent // shared mode's pull log, every node's
}

type pullRun struct {
	node  *ctrNode
	image int
	done  time.Time
	err   error
}

// servedPerBlob counts, by digest, the requests that got a blob whole.
func (m *modeResult) servedPerBlob(blobs map[string]benchBlob) map[string]int {
	n := map[string]int{}
	for _, r := range m.requests {
		if b, ok := blobs[r.digest]; ok && r.status == http.StatusOK && r.bytes == b.size {
			n[r.digest]++
		}
	}
	return n
}

// runPullBench pushes cfg's images into a fresh registry and runs each of
// cfg's modes in turn, every mode on fresh daemons that stop before the
// next mode starts.
func runPullBench(t testing.TB, cfg pullBenchConfig) *pullBenchResult {
	if _, err := exec.LookPath("docker-registry"); err != nil {
		t.Fatal("docker-registry is not installed: `make deps` installs it (Debian package docker-registry)")
	}
	f := flavours()[0] // Debian's containerd 1.6
	f.check(t)
	out, err := exec.Command(f.bin("containerd"), "--version").Output()
	if err != nil {
		t.Fatal(err)
	}
	r := &pullBenchResult{cfg: cfg, blobs: map[string]benchBlob{}}
	if fields := strings.Fields(string(out)); len(fields) >= 3 {
		r.version = fields[2]
	}
	dir, err := os.MkdirTemp("", "dlpb") // short: unix socket paths are limited
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	var bin string
	if slices.Contains(cfg.modes, modeShared) {
		bin = filepath.Join(dir, "dlock-content")
		if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
			t.Fatalf("build: %v\n%s", err, out)
		}
	}
	registry := startRegistry(t, dir)
	r.push(t, registry)
	up := kit.NewUplink(cfg.uplinkMiB * (1 << 20))
	for _, mode := range cfg.modes {
		m := r.run(t, mode, f, bin, registry, up, filepath.Join(dir, mode))
		r.modes = append(r.modes, m)
		if mode == modeShared {
			r.timeline = pickTimeline(m, r.blobs)
		}
	}
	return r
}

// push writes cfg's random images to the registry directly, not through
// the uplink: bench/img<i>:v1.
func (r *pullBenchResult) push(t testing.TB, registry string) {
	layerBytes := int64(r.cfg.layerMiB * (1 << 20))
	for i := range r.cfg.images {
		img, err := random.Image(layerBytes, int64(r.cfg.layers))
		if err != nil {
			t.Fatal(err)
		}
		ref, err := name.ParseReference(fmt.Sprintf("%s/bench/img%d:v1", registry, i), name.Insecure)
		if err != nil {
			t.Fatal(err)
		}
		if err := remote.Write(ref, img); err != nil {
			t.Fatal(err)
		}
		m, err := img.Manifest()
		if err != nil {
			t.Fatal(err)
		}
		r.blobs[m.Config.Digest.String()] = benchBlob{image: i, layer: -1, size: m.Config.Size}
		r.total += m.Config.Size
		for j, l := range m.Layers {
			r.blobs[l.Digest.String()] = benchBlob{image: i, layer: j, size: l.Size}
			r.total += l.Size
		}
	}
}

// run starts mode's nodes, each behind its own listener of one registry
// front, opens a barrier before every node's pull of every image at once,
// and waits until all are done.
func (r *pullBenchResult) run(t testing.TB, mode string, f flavour, bin, registry string, up *rate.Limiter, dir string) *modeResult {
	s := newScope(t)
	defer s.close()
	m := &modeResult{mode: mode, nodes: r.cfg.nodes}
	if mode == modeSingle {
		m.nodes = 1
	}
	front := &registryFront{registry: registry, up: up, tr: &http.Transport{MaxIdleConnsPerHost: 64}}
	var server string
	if mode == modeShared {
		server = dlocktest.Start(s, dlocktest.Options{RefCount: true}).URL()
	}
	var nodes []*ctrNode
	for i := range m.nodes {
		n := &ctrNode{name: fmt.Sprint("node", i), dir: filepath.Join(dir, fmt.Sprint("n", i)), flavour: f}
		n.proxy = front.listen(s, n.name)
		if mode == modeShared {
			n.contentArgs = []string{"--log-level", "debug"}
			n.start(s, bin, filepath.Join(dir, "shared"), server)
		} else {
			n.startContainerd(s, "")
		}
		nodes = append(nodes, n)
	}

	// Generous: a hung pull fails with its output rather than at go
	// test's timeout.
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute+10*r.bound(int64(m.nodes)*r.total))
	defer cancel()
	barrier := make(chan struct{})
	for _, n := range nodes {
		for i := range r.cfg.images {
			m.pulls = append(m.pulls, pullRun{node: n, image: i})
		}
	}
	outs := make([]string, len(m.pulls))
	var wg sync.WaitGroup
	for i := range m.pulls {
		p := &m.pulls[i]
		// ctr's own download concurrency: no --max-concurrent-downloads.
		cmd := exec.CommandContext(ctx, f.bin("ctr"), "-a", p.node.sock, "-n", "default", "images", "pull",
			"--plain-http", "--snapshotter", "native", fmt.Sprintf("%s/bench/img%d:v1", p.node.proxy, p.image))
		wg.Go(func() {
			<-barrier
			out, err := cmd.CombinedOutput()
			p.done, p.err, outs[i] = time.Now(), err, string(out)
		})
	}
	m.start = time.Now()
	close(barrier)
	wg.Wait()
	for i, p := range m.pulls {
		if p.err != nil {
			t.Fatalf("%s: %s's pull of image %d: %v\n%s", mode, p.node.name, p.image, p.err, outs[i])
		}
		m.wall = max(m.wall, p.done.Sub(m.start))
	}
	// Every daemon stops before its log is read: the log is whole.
	s.close()

	m.requests = front.records()
	var last time.Time
	for _, q := range m.requests {
		m.registryBytes += q.bytes
		if q.lastByte.After(last) {
			last = q.lastByte
		}
	}
	if !last.IsZero() {
		m.lastByte = last.Sub(m.start)
	}
	if mode == modeShared {
		for _, n := range nodes {
			evs, err := parsePullLog(n.name, n.contentLog.String())
			if err != nil {
				t.Fatal(err)
			}
			m.events = append(m.events, evs...)
		}
		slices.SortStableFunc(m.events, func(a, b pullEvent) int { return a.at.Compare(b.at) })
		if len(m.events) > 0 && m.events[len(m.events)-1].at.After(last) {
			last = m.events[len(m.events)-1].at
		}
	}
	if !last.IsZero() {
		m.download = last.Sub(m.start)
	}
	return m
}

// scope collects the cleanups of one mode's daemons, servers and proxies,
// so that they stop before the next mode starts; t's own cleanup runs
// what a failed mode left.
type scope struct {
	testing.TB
	mu  sync.Mutex
	fns []func()
}

func newScope(t testing.TB) *scope {
	s := &scope{TB: t}
	t.Cleanup(s.close)
	return s
}

func (s *scope) Cleanup(f func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.fns = append(s.fns, f)
}

// close runs the cleanups, last first, once.
func (s *scope) close() {
	for {
		s.mu.Lock()
		if len(s.fns) == 0 {
			s.mu.Unlock()
			return
		}
		f := s.fns[len(s.fns)-1]
		s.fns = s.fns[:len(s.fns)-1]
		s.mu.Unlock()
		f()
	}
}

// A blobRequest is one GET of a blob through the registry front.
type blobRequest struct {
	node     string
	digest   string
	arrived  time.Time
	lastByte time.Time // zero when no byte of the body was written
	bytes    int64
	status   int
}

// registryFront is the registry as the nodes see it: a reverse proxy with
// a listener per node, so that it knows which node asked, and one uplink
// for the blob bodies of all.
type registryFront struct {
	registry string
	up       *rate.Limiter
	tr       *http.Transport

	mu       sync.Mutex
	requests []blobRequest
}

// listen serves the front on a new listener for node and returns its
// address.
func (f *registryFront) listen(t testing.TB, node string) string {
	target, err := url.Parse("http://" + f.registry)
	if err != nil {
		t.Fatal(err)
	}
	rp := httputil.NewSingleHostReverseProxy(target)
	rp.Transport = f.tr
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		i := strings.Index(r.URL.Path, "/blobs/sha256:")
		if r.Method != http.MethodGet || i < 0 {
			rp.ServeHTTP(w, r)
			return
		}
		pw := &kit.PacedWriter{ResponseWriter: w, Uplink: f.up}
		q := blobRequest{node: node, digest: r.URL.Path[i+len("/blobs/"):], arrived: time.Now()}
		// Deferred: the reverse proxy panics with http.ErrAbortHandler
		// when the node hangs up mid-body.
		defer func() {
			q.lastByte, q.bytes, q.status = pw.Last, pw.N, pw.Status
			f.mu.Lock()
			f.requests = append(f.requests, q)
			f.mu.Unlock()
		}()
		rp.ServeHTTP(pw, r)
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: h}
	go hs.Serve(ln)
	t.Cleanup(func() {
		hs.Close()
		f.tr.CloseIdleConnections()
	})
	return ln.Addr().String()
}

func (f *registryFront) records() []blobRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.requests)
}

// A pullEvent is one line of dlock-content's pull log (docs/CONTAINERD.md):
// slog's text, msg="pull: ...", at debug level.
type pullEvent struct {
	node   string // whose dlock-content logged it
	at     time.Time
	msg    string
	digest string
	attrs  [][2]string // the others, in the line's order
}

var errLogLine = errors.New("unreadable pull log line")

// parsePullLog reads every pull-log line of one node's dlock-content log,
// whatever its event: a new event shows up in the timeline as it is.
func parsePullLog(node, log string) ([]pullEvent, error) {
	var evs []pullEvent
	for line := range strings.Lines(log) {
		if !strings.Contains(line, `msg="pull: `) {
			continue
		}
		fields, err := logFields(strings.TrimSpace(line))
		if err != nil {
			return nil, fmt.Errorf("%s: %w", node, err)
		}
		ev := pullEvent{node: node}
		for _, kv := range fields {
			switch kv[0] {
			case "time":
				ev.at, err = time.Parse(time.RFC3339Nano, kv[1])
				if err != nil {
					return nil, fmt.Errorf("%s: %w: %q: %v", node, errLogLine, line, err)
				}
			case "level":
			case "msg":
				ev.msg = kv[1]
			case "digest":
				ev.digest = kv[1]
			default:
				ev.attrs = append(ev.attrs, kv)
			}
		}
		if ev.at.IsZero() || ev.digest == "" {
			return nil, fmt.Errorf("%s: %w: no time or digest: %q", node, errLogLine, line)
		}
		evs = append(evs, ev)
	}
	return evs, nil
}

// logFields splits one line of slog's text handler into its keys and
// values; a quoted value is unquoted.
func logFields(line string) ([][2]string, error) {
	var out [][2]string
	for line != "" {
		k, rest, ok := strings.Cut(line, "=")
		if !ok || k == "" || strings.ContainsAny(k, " \"") {
			return nil, fmt.Errorf("%w: %q", errLogLine, line)
		}
		var v string
		if strings.HasPrefix(rest, `"`) {
			q, err := strconv.QuotedPrefix(rest)
			if err != nil {
				return nil, fmt.Errorf("%w: %q: %v", errLogLine, line, err)
			}
			v, _ = strconv.Unquote(q)
			rest = rest[len(q):]
		} else {
			v, rest, _ = strings.Cut(rest, " ")
		}
		out = append(out, [2]string{k, v})
		line = strings.TrimLeft(rest, " ")
	}
	return out, nil
}

// The pull-log events the timeline's summary names (content/store.go,
// content/writer.go).
const (
	evDownloading = "pull: downloading"
	evPublished   = "pull: published"
	evUnlockSent  = "pull: unlock sent"
	evWaiting     = "pull: waiting for another node"
	evToldDone    = "pull: told done"
	evFound       = "pull: found the blob another node pulled"
)

// timeline is the story of one layer in shared mode, from its holder's
// registry request on.
type timeline struct {
	digest string
	blob   benchBlob
	holder string // the node that published it
	waited bool   // false: no layer had a waiter, this one is only pulled
	// lag is from the publish to its last waiter's find.
	lag time.Duration
	// The holder's: zero when not seen.
	downloading, request, lastByte, published, unlockSent time.Time
	rows                                                  []timelineRow
	waiters                                               []waiter
}

type timelineRow struct {
	at    time.Time
	node  string
	event string
}

type waiter struct {
	node                     string
	waiting, toldDone, found time.Time // zero when not logged
}

// pickTimeline chooses a layer another node waited for, the one whose
// last waiter found it latest after its publish; a layer that was only
// pulled when none was waited for; nil when none was published.
func pickTimeline(m *modeResult, blobs map[string]benchBlob) *timeline {
	byDigest := map[string][]pullEvent{}
	for _, ev := range m.events {
		byDigest[ev.digest] = append(byDigest[ev.digest], ev)
	}
	var best *timeline
	better := func(tl *timeline) bool {
		switch {
		case best == nil:
			return true
		case tl.waited != best.waited:
			return tl.waited
		case tl.lag != best.lag:
			return tl.lag > best.lag
		}
		return cmp.Or(cmp.Compare(tl.blob.image, best.blob.image), cmp.Compare(tl.blob.layer, best.blob.layer)) < 0
	}
	for d, b := range blobs {
		if b.layer < 0 {
			continue
		}
		tl := newTimeline(d, b, byDigest[d], m.requests)
		if tl != nil && better(tl) {
			best = tl
		}
	}
	return best
}

// newTimeline puts one blob's pull-log events and registry requests in
// time order; nil when no node published it.
func newTimeline(d string, b benchBlob, evs []pullEvent, reqs []blobRequest) *timeline {
	tl := &timeline{digest: d, blob: b}
	waiters := map[string]*waiter{}
	w := func(node string) *waiter {
		if waiters[node] == nil {
			waiters[node] = &waiter{node: node}
		}
		return waiters[node]
	}
	for _, ev := range evs {
		if ev.msg == evPublished {
			tl.holder, tl.published = ev.node, ev.at
		}
	}
	if tl.holder == "" {
		return nil
	}
	for _, ev := range evs {
		event := ev.msg
		for _, kv := range ev.attrs {
			event += " " + kv[0] + "=" + kv[1]
		}
		tl.rows = append(tl.rows, timelineRow{at: ev.at, node: ev.node, event: event})
		switch {
		case ev.node == tl.holder && ev.msg == evDownloading:
			tl.downloading = ev.at
		case ev.node == tl.holder && ev.msg == evUnlockSent:
			tl.unlockSent = ev.at
		case ev.msg == evWaiting:
			w(ev.node).waiting = ev.at
		case ev.msg == evToldDone:
			w(ev.node).toldDone = ev.at
		case ev.msg == evFound:
			w(ev.node).found = ev.at
		}
	}
	for _, q := range reqs {
		if q.digest != d {
			continue
		}
		tl.rows = append(tl.rows, timelineRow{at: q.arrived, node: q.node, event: "registry: request"})
		if !q.lastByte.IsZero() {
			tl.rows = append(tl.rows, timelineRow{at: q.lastByte, node: q.node,
				event: fmt.Sprintf("registry: last byte (%s, HTTP %d)", mib(q.bytes), q.status)})
		}
		// The holder's last request before its publish is its download.
		if q.node == tl.holder && (tl.published.IsZero() || !q.arrived.Truncate(time.Millisecond).After(tl.published)) && q.arrived.After(tl.request) {
			tl.request, tl.lastByte = q.arrived, q.lastByte
		}
	}
	slices.SortStableFunc(tl.rows, func(a, b timelineRow) int { return a.at.Compare(b.at) })
	for _, n := range slices.Sorted(maps.Keys(waiters)) {
		wt := waiters[n]
		if wt.waiting.IsZero() {
			continue // told done or found without a wait: not a waiter
		}
		tl.waiters = append(tl.waiters, *wt)
		tl.waited = true
		if !wt.found.IsZero() {
			tl.lag = max(tl.lag, wt.found.Sub(tl.published))
		}
	}
	return tl
}

// String is the report: a table of the modes and the timeline.
func (r *pullBenchResult) String() string {
	var sb strings.Builder
	c := r.cfg
	fmt.Fprintf(&sb, "%d images × %d layers × %g MiB (%d blobs with the configs, %s in all); %d nodes; registry uplink %g MiB/s for all nodes together; containerd %s\n",
		c.images, c.layers, c.layerMiB, len(r.blobs), mib(r.total), c.nodes, c.uplinkMiB, r.version)
	fmt.Fprintf(&sb, "every node runs `ctr images pull --plain-http --snapshotter native` for every image, all at once (ctr's default download concurrency)\n\n")
	single := r.mode(modeSingle)
	sb.WriteString("| mode | nodes | all pulls done | vs single | last registry byte | download phase | registry bytes | × images | uplink bound |\n")
	sb.WriteString("| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
	for _, m := range r.modes {
		ratio := "-"
		if single != nil {
			ratio = fmt.Sprintf("%.2f", m.wall.Seconds()/single.wall.Seconds())
		}
		fmt.Fprintf(&sb, "| %s | %d | %s | %s | %s | %s | %s | %.2f | %s |\n", m.mode, m.nodes, secs(m.wall), ratio,
			secs(m.lastByte), secs(m.download), mib(m.registryBytes), float64(m.registryBytes)/float64(r.total), secs(r.bound(m.registryBytes)))
	}
	sb.WriteString("\nall pulls done: from the start of every pull to the exit of the last. download phase: to the last blob byte the registry front wrote (shared: or the last pull-log event, if later). uplink bound: registry bytes ÷ uplink.\n")
	sb.WriteString("pulls exited, first to last:")
	sep := " "
	for _, m := range r.modes {
		first := m.wall
		for _, p := range m.pulls {
			first = min(first, p.done.Sub(m.start))
		}
		fmt.Fprintf(&sb, "%s%s %.2f–%.2f s", sep, m.mode, first.Seconds(), m.wall.Seconds())
		sep = "; "
	}
	sb.WriteString("\n")
	if m := r.mode(modeShared); m != nil {
		if w := waitsOf(m.events); w.n > 0 {
			fmt.Fprintf(&sb, "shared: %d waits for a blob another node pulled; told done after the holder's unlock: median %v, max %v; containerd moved on after told done: median %v, max %v\n",
				w.n, w.told[len(w.told)/2], w.told[len(w.told)-1], w.moved[len(w.moved)/2], w.moved[len(w.moved)-1])
		}
	}
	if tl := r.timeline; tl != nil {
		sb.WriteString("\n")
		tl.write(&sb)
	} else if r.mode(modeShared) != nil {
		sb.WriteString("\nno timeline: no layer was published in shared mode\n")
	}
	return sb.String()
}

func (tl *timeline) write(sb *strings.Builder) {
	zero, what := tl.request, tl.holder+"'s registry request"
	if zero.IsZero() {
		zero, what = tl.rows[0].at, "its first event"
	}
	if tl.waited {
		fmt.Fprintf(sb, "timeline of one layer in shared mode that other nodes waited for: %s (%s, %s), its last waiter found it %d ms after it was published\n",
			tl.blob, short(tl.digest), mib(tl.blob.size), tl.lag.Milliseconds())
	} else {
		fmt.Fprintf(sb, "timeline of one layer in shared mode (no layer had a waiter): %s (%s, %s)\n", tl.blob, short(tl.digest), mib(tl.blob.size))
	}
	fmt.Fprintf(sb, "t = 0 at %s; the pull log's times are in whole ms\n\n", what)
	ms := func(at time.Time) string {
		if at.IsZero() {
			return "-"
		}
		return fmt.Sprintf("%+d ms", at.Truncate(time.Millisecond).Sub(zero.Truncate(time.Millisecond)).Milliseconds())
	}
	fmt.Fprintf(sb, "%10s  %-6s  %s\n", "t", "node", "event")
	for _, row := range tl.rows {
		fmt.Fprintf(sb, "%10s  %-6s  %s\n", ms(row.at), row.node, row.event)
	}
	fmt.Fprintf(sb, "\nholder %s: registry request %s, last byte %s, published %s, unlock sent %s\n",
		tl.holder, ms(tl.request), ms(tl.lastByte), ms(tl.published), ms(tl.unlockSent))
	for _, w := range tl.waiters {
		fmt.Fprintf(sb, "waiter %s: waiting since %s, told done %s, found (moved on) %s", w.node, ms(w.waiting), ms(w.toldDone), ms(w.found))
		if !w.found.IsZero() && !tl.unlockSent.IsZero() {
			fmt.Fprintf(sb, ", %d ms after the unlock was sent", w.found.Sub(tl.unlockSent).Milliseconds())
		}
		sb.WriteString("\n")
	}
}

func short(d string) string {
	if len(d) > len("sha256:")+12 {
		return d[:len("sha256:")+12]
	}
	return d
}

func mib(n int64) string { return fmt.Sprintf("%.2f MiB", float64(n)/(1<<20)) }

func secs(d time.Duration) string { return fmt.Sprintf("%.2f s", d.Seconds()) }

// TestPullLogTimeline reads pull-log lines as slog's text handler writes
// them, events the summary names and others alike, and puts one blob's
// story in time order from its holder's registry request.
func TestPullLogTimeline(t *testing.T) {
	const d = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	logs := map[string]string{
		"node0": `time=2026-11-26T10:00:00.000Z level=INFO msg="dlock-content serving" socket=/x
time=2026-11-26T10:00:00.010Z level=DEBUG msg="pull: downloading" digest=` + d + ` token=7
time=2026-11-26T10:00:01.100Z level=DEBUG msg="pull: published" digest=` + d + `
time=2026-11-26T10:00:01.102Z level=DEBUG msg="pull: unlock sent" digest=` + d + `
`,
		"node1": `time=2026-11-26T10:00:00.050Z level=DEBUG msg="pull: waiting for another node" digest=` + d + ` holder=node0 position=1
time=2026-11-26T10:00:01.105Z level=DEBUG msg="pull: told done" digest=` + d + `
time=2026-11-26T10:00:01.300Z level=DEBUG msg="pull: found the blob another node pulled" digest=` + d + ` waited=1.25s
`,
		"node2": `time=2026-11-26T10:00:00.060Z level=DEBUG msg="pull: waiting for another node" digest=` + d + ` holder=node0 position=2
time=2026-11-26T10:00:00.500Z level=DEBUG msg="pull: handed over" digest=` + d + ` note="a \"quoted\" value"
`,
	}
	m := &modeResult{}
	for _, node := range []string{"node0", "node1", "node2"} {
		evs, err := parsePullLog(node, logs[node])
		if err != nil {
			t.Fatal(err)
		}
		m.events = append(m.events, evs...)
	}
	if len(m.events) != 8 {
		t.Fatalf("%d events, want 8: %+v", len(m.events), m.events)
	}
	at := func(ms int) time.Time { return time.Date(2026, 11, 26, 10, 0, 0, ms*int(time.Millisecond), time.UTC) }
	m.requests = []blobRequest{{node: "node0", digest: d, arrived: at(20), lastByte: at(1050), bytes: 100, status: http.StatusOK}}
	blobs := map[string]benchBlob{d: {image: 0, layer: 0, size: 100}, "sha256:cfg": {layer: -1, size: 1}}
	tl := pickTimeline(m, blobs)
	if tl == nil {
		t.Fatal("no timeline")
	}
	if tl.holder != "node0" || !tl.request.Equal(at(20)) || !tl.published.Equal(at(1100)) || !tl.unlockSent.Equal(at(1102)) || !tl.downloading.Equal(at(10)) {
		t.Errorf("holder %s: request %v, published %v, unlock sent %v, downloading %v", tl.holder, tl.request, tl.published, tl.unlockSent, tl.downloading)
	}
	if len(tl.waiters) != 2 || !tl.waiters[0].toldDone.Equal(at(1105)) || !tl.waiters[0].found.Equal(at(1300)) || !tl.waiters[1].found.IsZero() {
		t.Errorf("waiters: %+v", tl.waiters)
	}
	if tl.lag != 200*time.Millisecond {
		t.Errorf("lag %v, want 200ms", tl.lag)
	}
	var sb strings.Builder
	tl.write(&sb)
	var order []string
	for line := range strings.Lines(sb.String()) {
		if f := strings.Fields(line); len(f) > 3 && f[1] == "ms" {
			order = append(order, f[2]+" "+strings.Join(f[3:], " "))
		}
	}
	want := []string{
		"node0 pull: downloading token=7",
		"node0 registry: request",
		"node1 pull: waiting for another node holder=node0 position=1",
		"node2 pull: waiting for another node holder=node0 position=2",
		`node2 pull: handed over note=a "quoted" value`,
		"node0 registry: last byte (0.00 MiB, HTTP 200)",
		"node0 pull: published",
		"node0 pull: unlock sent",
		"node1 pull: told done",
		"node1 pull: found the blob another node pulled waited=1.25s",
	}
	if !slices.Equal(order, want) {
		t.Errorf("timeline rows:\n%s\nwant\n%s\nreport:\n%s", strings.Join(order, "\n"), strings.Join(want, "\n"), sb.String())
	}
	if _, err := parsePullLog("node3", `time=2026-11-26T10:00:00.000Z level=DEBUG msg="pull: downloading" digest=`+d+` bad="unterminated`); !errors.Is(err, errLogLine) {
		t.Errorf("an unterminated quote: %v, want %v", err, errLogLine)
	}
}

// waits sums up shared mode's waits from the pull log: for every waiter
// told a blob was done, how long after the holder's unlock it was told,
// and how long after that its containerd found the blob. Sorted.
type waits struct {
	n           int
	told, moved []time.Duration
}

func waitsOf(evs []pullEvent) waits {
	unlock := map[string]time.Time{}  // digest → the holder's unlock sent
	told := map[[2]string]time.Time{} // node, digest → told done
	var w waits
	for _, ev := range evs {
		switch ev.msg {
		case "pull: unlock sent":
			unlock[ev.digest] = ev.at
		case "pull: told done":
			told[[2]string{ev.node, ev.digest}] = ev.at
		}
	}
	for _, ev := range evs {
		if ev.msg != "pull: found the blob another node pulled" {
			continue
		}
		t, ok := told[[2]string{ev.node, ev.digest}]
		u, unlocked := unlock[ev.digest]
		if !ok || !unlocked {
			continue
		}
		w.n++
		w.told = append(w.told, t.Sub(u))
		w.moved = append(w.moved, ev.at.Sub(t))
	}
	slices.Sort(w.told)
	slices.Sort(w.moved)
	return w
}

// The page that shows `make bench-pull` (docs/DEVELOPMENT.md, "Commands in
// the docs").
const performancePage = "docs/PERFORMANCE.md"

// TestDocsBenchPull runs docs/PERFORMANCE.md's `make bench-pull` lines as
// written, at a small scale: every size the line sets, and those it leaves
// at their defaults, are made small (one image of two 256 KiB layers, two
// nodes, a 64 MiB/s uplink), and the section goes to a file of the test's
// rather than docs/BENCHMARKS.md. The section must hold every mode's row.
func TestDocsBenchPull(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED LOUDLY: TestDocsBenchPull needs root to run containerd; run `make test` as root to include it")
	}
	all, err := doctest.Read(filepath.Join("..", "..", performancePage))
	if err != nil {
		t.Fatal(err)
	}
	blocks := doctest.Marked(all, "TestDocsBenchPull")
	if len(blocks) != 1 {
		t.Fatalf("%s: %d blocks marked TestDocsBenchPull, want 1", performancePage, len(blocks))
	}
	small := []string{"DLOCK_PULL_IMAGES=1", "DLOCK_PULL_LAYERS=2", "DLOCK_PULL_LAYER_MIB=0.25", "DLOCK_PULL_NODES=2", "DLOCK_PULL_UPLINK_MIB=64"}
	for line := range strings.Lines(strings.TrimSpace(blocks[0].Text)) {
		fields := strings.Fields(line)
		if len(fields) < 2 || fields[0] != "make" || fields[1] != "bench-pull" {
			t.Fatalf("%s:%d: %q is not `make bench-pull [VAR=VALUE…]`", performancePage, blocks[0].Line, line)
		}
		for _, v := range fields[2:] {
			name, _, ok := strings.Cut(v, "=")
			if !ok || !strings.HasPrefix(name, "DLOCK_PULL_") {
				t.Fatalf("%s: %q in %q is not a DLOCK_PULL_* setting", performancePage, v, line)
			}
			t.Setenv(name, strings.TrimPrefix(v, name+"=")) // the benchmark must accept it
		}
		if _, err := pullBenchConfigFromEnv(); err != nil {
			t.Fatalf("%s: %q: %v", performancePage, line, err)
		}
		out := filepath.Join(t.TempDir(), "BENCHMARKS.md")
		args := append(append(fields[1:], small...), "BENCH_PULL_OUT="+out)
		cmd := exec.Command("make", args...)
		cmd.Dir = filepath.Join("..", "..")
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("make %s: %v\n%s", strings.Join(args, " "), err, b)
		}
		section, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		modes := []string{modeSingle, modeShared, modeSeparate}
		for _, v := range fields[2:] {
			if m, ok := strings.CutPrefix(v, "DLOCK_PULL_MODES="); ok {
				modes = strings.Split(m, ",")
			}
		}
		for _, m := range modes {
			if !regexp.MustCompile(`(?m)^\| ` + m + ` \| [12] \| `).Match(section) {
				t.Errorf("%q: the section has no row for %s:\n%s", line, m, section)
			}
		}
		if !strings.Contains(string(section), "— make bench-pull") {
			t.Errorf("%q: no section heading:\n%s", line, section)
		}
	}
}
