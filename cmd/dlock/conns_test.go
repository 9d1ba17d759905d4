package main

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestParseServeConns(t *testing.T) {
	env := map[string]string{"DLOCK_MAX_CONNS": "5", "DLOCK_READ_TIMEOUT": "3s", "DLOCK_WRITE_TIMEOUT": "4s", "DLOCK_SHUTDOWN_TIMEOUT": "7s", "DLOCK_PING_INTERVAL": "500ms"}
	c, err := parseServe([]string{"--read-timeout", "2s", "--dead-peer-timeout", "1500ms"}, func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.conns != (connConfig{max: 5, read: 2 * time.Second, write: 4 * time.Second, shutdown: 7 * time.Second, ping: 500 * time.Millisecond, deadPeer: 1500 * time.Millisecond}) {
		t.Errorf("got %+v", c.conns)
	}
	d, err := parseServe(nil, func(string) string { return "" }, io.Discard)
	if err != nil || d.conns != (connConfig{max: 0, read: 10 * time.Second, write: 10 * time.Second, shutdown: 10 * time.Second, ping: time.Second, deadPeer: 3 * time.Second}) {
		t.Errorf("defaults: %+v %v", d.conns, err)
	}
	for _, args := range [][]string{{"--max-conns", "-1"}, {"--read-timeout", "0s"}, {"--write-timeout", "-1s"}, {"--shutdown-timeout", "0s"}, {"--ping-interval", "1ms"}, {"--dead-peer-timeout", "10ms"}} {
		if _, err := parseServe(args, func(string) string { return "" }, io.Discard); err == nil {
			t.Errorf("%v accepted", args)
		}
	}
}

func TestDefaultMaxConns(t *testing.T) {
	for limit, want := range map[uint64]int{0: maxConnsCap, 100: 50, 1024: 768, 20_000: 19_744, 1 << 20: maxConnsCap} {
		if got := defaultMaxConns(limit); got != want {
			t.Errorf("defaultMaxConns(%d) = %d, want %d", limit, got, want)
		}
	}
}

// TestServeSurvivesEMFILE runs dlock serve out of file descriptors for
// real: its limit is lowered under it and idle connections take the rest.
// Accept fails with EMFILE; dlock serve must go on, and serve again once
// connections close (it used to return from Serve and exit).
func TestServeSurvivesEMFILE(t *testing.T) {
	// A data dir of its own: the default one may be another server's,
	// which would make this one refuse to start.
	cmd := exec.Command(dlockBinary(t), "serve", "--listen", "127.0.0.1:0", "--max-conns", "10000", "--data-dir", t.TempDir())
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{}) // closed once cmd.Wait returned waitErr
	var waitErr error
	watching := false // the goroutine that closes exited runs
	defer func() {
		cmd.Process.Kill()
		if watching {
			<-exited
		} else {
			_ = cmd.Wait()
		}
	}()
	sc := bufio.NewScanner(stderr)
	addr := ""
	re := regexp.MustCompile(`addr=(\S+)`)
	for addr == "" && sc.Scan() {
		if m := re.FindStringSubmatch(sc.Text()); m != nil {
			addr = m[1]
		}
	}
	if addr == "" {
		t.Fatal("no listen address logged")
	}
	acceptFailed := make(chan struct{})
	watching = true
	go func() {
		once := false
		for sc.Scan() {
			if !once && strings.Contains(sc.Text(), "accept failed") && strings.Contains(sc.Text(), "too many open files") {
				once = true
				close(acceptFailed)
			}
		}
		waitErr = cmd.Wait()
		close(exited)
	}()
	// The address is logged before Serve starts, and Serve opens
	// descriptors of its own (an event loop's epoll set and eventfd, a
	// duplicate of the listening socket): counted before them, the limit
	// would leave the server one descriptor, enough to accept a
	// connection and never to hand one to a goroutine. An answer says
	// Serve runs.
	warm := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	if resp, err := warm.Get("http://" + addr + "/healthz"); err != nil {
		t.Fatalf("before lowering the limit: %v", err)
	} else {
		resp.Body.Close()
	}
	pid := cmd.Process.Pid
	fds, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/fd")
	if err != nil {
		t.Skipf("cannot count the server's descriptors: %v", err)
	}
	lim := unix.Rlimit{Cur: uint64(len(fds) + 4), Max: uint64(len(fds) + 4)}
	if err := unix.Prlimit(pid, unix.RLIMIT_NOFILE, &lim, nil); err != nil {
		t.Skipf("cannot lower the server's RLIMIT_NOFILE: %v", err)
	}
	var idle []net.Conn
	for range 20 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		idle = append(idle, c)
	}
	select {
	case <-acceptFailed:
	case <-exited:
		t.Fatalf("dlock serve exited out of descriptors: %v", waitErr)
	case <-time.After(10 * time.Second):
		t.Fatal("accept never failed with EMFILE")
	}
	for _, c := range idle {
		c.Close()
	}
	client := &http.Client{Timeout: 10 * time.Second}
	status, body := servedOnceFree(t, client, http.MethodPost, "http://"+addr+"/lock", `{"type":"pull","resource_id":"r","node_id":"a"}`)
	if status != 200 || !strings.Contains(body, `"acquired":true`) {
		t.Fatalf("after EMFILE: %d %s", status, body)
	}
	status, metrics := servedOnceFree(t, client, http.MethodGet, "http://"+addr+"/metrics", "")
	if m := regexp.MustCompile(`(?m)^dlock_accept_errors_total (\d+)`).FindStringSubmatch(metrics); status != 200 || m == nil || m[1] == "0" {
		t.Fatalf("dlock_accept_errors_total: %q in %d %.300s", m, status, metrics)
	}
	client.CloseIdleConnections()
}

// servedOnceFree sends a request until it is served. While the connections
// accepted before the limit was reached are still being closed, a request
// that needs a descriptor the server does not have yet (an event loop's
// hand-over to a goroutine needs one) is answered 503 overloaded with
// Retry-After, and was never run, so it is sent again; any other answer is
// returned.
func servedOnceFree(t *testing.T, client *http.Client, method, url, body string) (int, string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		req, err := http.NewRequest(method, url, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		if body != "" {
			req.Header.Set("Content-Type", "application/json")
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("after EMFILE: %s %s: %v", method, url, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(b), `"code":"overloaded"`) {
			return resp.StatusCode, string(b)
		}
		if resp.Header.Get("Retry-After") == "" {
			t.Fatalf("503 overloaded without Retry-After: %s", b)
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s %s: still 503 overloaded after 30 s", method, url)
		}
		t.Logf("%s %s: 503 overloaded while descriptors are short; sent again", method, url)
		time.Sleep(10 * time.Millisecond) // a back-off, not an order of events
	}
}
