package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/datadir"
	"github.com/dlock/dlock/internal/dlocktest/kit"
)

func TestParseServe(t *testing.T) {
	env := map[string]string{
		"DLOCK_LISTEN":                    "127.0.0.1:9999",
		"DLOCK_SHARDS":                    "8",
		"DLOCK_LOCK_TTL":                  "10s",
		"DLOCK_REFCOUNT":                  "server",
		"DLOCK_DATA_DIR":                  "/tmp/x",
		"DLOCK_MAX_HOLD":                  "1h",
		"DLOCK_LOCK_DELAY":                "15s",
		"DLOCK_COMPLETED_MAX":             "7",
		"DLOCK_ALLOW_MULTI_NODE_DOWNLOAD": "false",
	}
	c, err := parseServe([]string{"--shards", "16"}, func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.shards != 16 {
		t.Errorf("flag must win over the environment: shards %d", c.shards)
	}
	if c.listen != "127.0.0.1:9999" || c.rules.LockTTL != 10*time.Second || c.refcount != "server" || c.dataDir != "/tmp/x" ||
		c.rules.MaxHold != time.Hour || c.rules.LockDelay != 15*time.Second || c.rules.CompletedMax != 7 || c.rules.AllowMultiNodeDownload {
		t.Errorf("environment not applied: %+v", c)
	}
	d, err := parseServe(nil, func(string) string { return "" }, io.Discard)
	if err != nil || d.listen != "127.0.0.1:7380" || d.shards != 32 || d.rules.SessionGrace != 5*time.Second ||
		d.rules.ClaimTimeout != 30*time.Second || d.rules.CompletedRetention != 5*time.Minute || d.refcount != "off" || d.rules.LockDelay != 0 {
		t.Errorf("defaults: %+v %v", d, err)
	}
}

// TestParseServeLockDelay: --lock-delay reaches the rules both backends are
// opened with, the flag winning over DLOCK_LOCK_DELAY.
func TestParseServeLockDelay(t *testing.T) {
	env := map[string]string{"DLOCK_LOCK_DELAY": "15s"}
	for _, args := range [][]string{
		{"--lock-delay", "20s"},
		{"--lock-delay", "20s", "--backend", "etcd", "--etcd-endpoints", "http://127.0.0.1:2379"},
	} {
		c, err := parseServe(args, func(k string) string { return env[k] }, io.Discard)
		if err != nil {
			t.Fatalf("parseServe(%v): %v", args, err)
		}
		if c.rules.LockDelay != 20*time.Second {
			t.Errorf("parseServe(%v): lock delay %v, want the flag's 20s", args, c.rules.LockDelay)
		}
	}
}

func TestParseServeRejects(t *testing.T) {
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{[]string{"--shards", "0"}, nil, "shards"},
		{[]string{"--lock-ttl", "soon"}, nil, "lock-ttl"},
		{[]string{"--refcount", "client"}, nil, "refcount"},
		{[]string{"--session-grace", "-1s"}, nil, "session grace"},
		{[]string{"--lock-delay", "-1s"}, nil, "lock delay"},
		{nil, map[string]string{"DLOCK_LOCK_DELAY": "soon"}, "DLOCK_LOCK_DELAY"},
		{nil, map[string]string{"DLOCK_CLAIM_TIMEOUT": "x"}, "DLOCK_CLAIM_TIMEOUT"},
		{[]string{"--update-requires-no-ref"}, nil, "refcount=server"},
		{[]string{"--refcount", "server", "--data-dir", ""}, nil, "data-dir"},
		{[]string{"--listen", "nowhere"}, nil, "listen"},
		{[]string{"extra"}, nil, "no arguments"},
	} {
		_, err := parseServe(tc.args, func(k string) string { return tc.env[k] }, io.Discard)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("parseServe(%v, %v) = %v, want an error mentioning %q", tc.args, tc.env, err, tc.want)
		}
	}
}

// TestServeProcess runs the real binary: it serves, and SIGTERM ends it
// cleanly even with an event stream open.
func TestServeProcess(t *testing.T) {
	cmd := exec.Command(dlockBinary(t), "serve", "--listen", "127.0.0.1:0", "--refcount", "server", "--data-dir", t.TempDir())
	cmd.Env = append(os.Environ(), "DLOCK_SESSION_GRACE=1s")
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	sc := bufio.NewScanner(stderr)
	addr := ""
	re := regexp.MustCompile(`addr=(\S+)`)
	for sc.Scan() {
		if m := re.FindStringSubmatch(sc.Text()); m != nil {
			addr = m[1]
			break
		}
	}
	if addr == "" {
		t.Fatal("no listen address logged")
	}
	go io.Copy(io.Discard, stderr)
	base := "http://" + addr
	resp, err := http.Post(base+"/lock", "application/json", strings.NewReader(`{"type":"pull","resource_id":"r","node_id":"a"}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"acquired":true`) {
		t.Fatalf("lock: %d %s", resp.StatusCode, body)
	}
	stream, err := http.Get(base + "/subscribe?node_id=a")
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Body.Close()
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("exit after SIGTERM: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("dlock serve did not stop after SIGTERM")
	}
	if _, err := io.ReadAll(stream.Body); err != nil && !strings.Contains(err.Error(), "EOF") {
		t.Logf("stream ended with %v", err)
	}
}

// TestServeDataDir: a server holds its data dir (a second one on it refuses
// to start), and a server restarted on it at once never hands out a token
// at or below one the last one issued.
func TestServeDataDir(t *testing.T) {
	dir := t.TempDir()
	start := func() (addr string, stop func() error) {
		t.Helper()
		c, err := parseServe([]string{"--listen", "127.0.0.1:0", "--data-dir", dir}, func(string) string { return "" }, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		ready := make(chan net.Addr, 1)
		c.ready = func(a net.Addr) { ready <- a }
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- runServer(ctx, c, io.Discard) }()
		select {
		case a := <-ready:
			return a.String(), func() error { cancel(); return <-done }
		case err := <-done:
			cancel()
			t.Fatalf("server did not start: %v", err)
		}
		return "", nil
	}
	token := func(addr string) uint64 {
		t.Helper()
		resp, err := http.Post("http://"+addr+"/lock", "application/json", strings.NewReader(`{"type":"pull","resource_id":"r","node_id":"a"}`))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var r struct{ Token uint64 }
		if err := json.NewDecoder(resp.Body).Decode(&r); err != nil || r.Token == 0 {
			t.Fatalf("lock: %d %v %+v", resp.StatusCode, err, r)
		}
		// Failure: the next lock is a new grant with a new token.
		resp, err = http.Post("http://"+addr+"/unlock", "application/json", strings.NewReader(`{"type":"pull","resource_id":"r","node_id":"a","success":false}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return r.Token
	}

	addr, stop := start()
	var last uint64
	for range 20 {
		last = token(addr)
	}
	c, _ := parseServe([]string{"--listen", "127.0.0.1:0", "--data-dir", dir}, func(string) string { return "" }, io.Discard)
	if err := runServer(t.Context(), c, io.Discard); !errors.Is(err, datadir.ErrInUse) {
		t.Fatalf("second server on one data dir: %v", err)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	addr, stop = start()
	if tok := token(addr); tok <= last {
		t.Fatalf("token %d after a restart, %d before", tok, last)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// TestServeEventLoop: the event loop is on by default, off with
// --event-loop=false (or DLOCK_EVENT_LOOP=false), and always off with
// --refcount=server.
func TestServeEventLoop(t *testing.T) {
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want bool
	}{
		{nil, nil, true},
		{[]string{"--event-loop=false"}, nil, false},
		{nil, map[string]string{"DLOCK_EVENT_LOOP": "false"}, false},
		{[]string{"--refcount", "server"}, nil, false},
		{[]string{"--refcount", "server", "--event-loop=true"}, nil, false},
	} {
		c, err := parseServe(tc.args, func(k string) string { return tc.env[k] }, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		if got := c.useEventLoop(); got != tc.want {
			t.Errorf("%v %v: event loop %v, want %v", tc.args, tc.env, got, tc.want)
		}
	}
}

// TestServeDebugListen: --debug-listen serves Go's profiles on a listener
// of its own, not the API's, and logs the address it took, so that a port
// of 0 can be found.
func TestServeDebugListen(t *testing.T) {
	p := startServe(t, "--debug-listen", "127.0.0.1:0")
	re := regexp.MustCompile(`msg="pprof profiles served" addr=(\S+)`)
	var addr string
	kit.WaitFor(t, "the profiles' address logged", func() bool {
		m := re.FindStringSubmatch(p.logs())
		if m != nil {
			addr = m[1]
		}
		return m != nil
	})
	if strings.HasSuffix(addr, ":0") {
		t.Fatalf("logged %s, not the port taken", addr)
	}
	get := func(url string) int {
		t.Helper()
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		return resp.StatusCode
	}
	if code := get("http://" + addr + "/debug/pprof/goroutine?debug=1"); code != http.StatusOK {
		t.Errorf("the profiles' listener answered %d", code)
	}
	if code := get("http://" + p.addr + "/debug/pprof/goroutine?debug=1"); code != http.StatusNotFound {
		t.Errorf("the API's listener answered %d for a profile, want 404", code)
	}
}
