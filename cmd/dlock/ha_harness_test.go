package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/etcdtest"
)

// The high-availability tests run real processes: Debian's etcd as a
// 3-member cluster (internal/etcdtest) and several `dlock serve --backend
// etcd` on it, one lock service (docs/DESIGN.md, "An etcd backend"), which
// they SIGKILL and restart while clients race.

// haCluster is an etcd cluster and the dlock servers that share one data set
// on it.
type haCluster struct {
	t       testing.TB
	etcd    *etcdtest.Cluster
	servers []*haServer
	hc      *http.Client
	streams *http.Client // no timeout: event streams
	prefix  string       // the data set's etcd prefix
}

// haServer is one `dlock serve --backend etcd` process on a fixed
// 127.0.0.1 port, which it keeps across restarts so that clients find it
// again.
type haServer struct {
	t       testing.TB
	name    string
	addr    string
	args    []string
	logPath string

	mu     sync.Mutex
	cmd    *exec.Cmd
	exited chan struct{}
}

// startHA starts a 3-member etcd cluster and n dlock servers on it, each
// with args added to its command line.
func startHA(t testing.TB, n int, args ...string) *haCluster {
	t.Helper()
	ec := etcdtest.StartCluster(t, 3)
	var raw [6]byte
	_, _ = rand.Read(raw[:])
	prefix := "/ha-" + hex.EncodeToString(raw[:]) + "/"
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	str := &http.Transport{DisableKeepAlives: true}
	h := &haCluster{t: t, etcd: ec, hc: &http.Client{Transport: tr, Timeout: 10 * time.Second}, streams: &http.Client{Transport: str}, prefix: prefix}
	t.Cleanup(tr.CloseIdleConnections)
	dir := t.TempDir()
	bin := dlockBinary(t)
	for i := range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := l.Addr().String()
		l.Close()
		s := &haServer{
			t:       t,
			name:    fmt.Sprintf("dlock%d", i),
			addr:    addr,
			logPath: filepath.Join(dir, fmt.Sprintf("dlock%d.log", i)),
			args: append([]string{bin, "serve", "--backend", "etcd",
				"--etcd-endpoints", strings.Join(ec.Endpoints(), ","),
				"--etcd-prefix", prefix,
				"--listen", addr,
				"--log-level", "debug"}, args...),
		}
		h.servers = append(h.servers, s)
		t.Cleanup(func() {
			s.Kill()
			if t.Failed() {
				data, _ := os.ReadFile(s.logPath)
				if len(data) > 8000 {
					data = data[len(data)-8000:]
				}
				t.Logf("--- %s (%s) log tail:\n%s", s.name, s.addr, data)
			}
		})
	}
	for _, s := range h.servers {
		s.start()
	}
	for _, s := range h.servers {
		s.waitUp(h.hc)
	}
	return h
}

// URLs are the servers' base URLs, server i at index i.
func (h *haCluster) URLs() []string {
	var out []string
	for _, s := range h.servers {
		out = append(out, s.URL())
	}
	return out
}

// URL is the server's base URL.
func (s *haServer) URL() string { return "http://" + s.addr }

func (s *haServer) start() {
	s.t.Helper()
	log, err := os.OpenFile(s.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		s.t.Fatal(err)
	}
	defer log.Close()
	fmt.Fprintf(log, "=== %s starts at %s\n", s.name, time.Now().Format(time.RFC3339Nano))
	cmd := exec.Command(s.args[0], s.args[1:]...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.Env = os.Environ()
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		s.t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	s.mu.Lock()
	s.cmd, s.exited = cmd, exited
	s.mu.Unlock()
}

// waitUp waits until the server answers /healthz, failing the test if its
// process exits first.
func (s *haServer) waitUp(hc *http.Client) {
	s.t.Helper()
	s.mu.Lock()
	exited := s.exited
	s.mu.Unlock()
	kit.Await(s.t, s.name+" to answer /healthz", func() error {
		select {
		case <-exited:
			data, _ := os.ReadFile(s.logPath)
			s.t.Fatalf("%s exited while starting:\n%s", s.name, data)
		default:
		}
		resp, err := hc.Get(s.URL() + "/healthz")
		if err != nil {
			return err
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("/healthz: %d", resp.StatusCode)
		}
		return nil
	})
}

// Kill sends SIGKILL to the server's process and waits for it to exit:
// no shutdown, no stream closed politely, keepalives of its sessions
// stopped where they are.
func (s *haServer) Kill() {
	s.mu.Lock()
	cmd, exited := s.cmd, s.exited
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	select {
	case <-exited:
	default:
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-exited
	}
}

// Stop sends SIGTERM, as a service manager stopping the server for an
// upgrade does, and waits for it to exit.
func (s *haServer) Stop() {
	s.mu.Lock()
	cmd, exited := s.cmd, s.exited
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	select {
	case <-exited:
	default:
		syscall.Kill(cmd.Process.Pid, syscall.SIGTERM)
		<-exited
	}
}

// Start starts the stopped server again on its address and waits until it
// answers.
func (s *haServer) Start(hc *http.Client) {
	s.t.Helper()
	s.start()
	s.waitUp(hc)
}

// Restart starts the killed server again on its address and waits until it
// answers.
func (s *haServer) Restart(hc *http.Client) {
	s.t.Helper()
	s.Kill()
	s.start()
	s.waitUp(hc)
}

// failover reports whether the dlock commands take a comma-separated list
// of servers (client fail-over): a status through a list of two servers
// that answer succeeds only then. Asked once per test binary.
var failover struct {
	once sync.Once
	ok   bool
}

func clientFailover(t testing.TB) bool {
	failover.once.Do(func() {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.Write([]byte(`{"type":"pull","resource_id":"probe","state":"free"}`))
		}))
		defer srv.Close()
		cmd := exec.Command(dlockBinary(t), "status", "--resource", "probe", "--server", srv.URL+","+srv.URL)
		cmd.Env = os.Environ()
		out, err := cmd.CombinedOutput()
		failover.ok = err == nil
		if !failover.ok {
			t.Fatalf("the commands refuse a list of servers (client fail-over, docs/HA.md): %s", bytes.TrimSpace(out))
		}
	})
	return failover.ok
}

// serverArg is what process i is given as --server: every server, starting
// at server i (so that processes spread over the servers), when the client
// fails over; else server i alone.
func (h *haCluster) serverArg(i int, failover bool) string {
	urls := h.URLs()
	i %= len(urls)
	if !failover {
		return urls[i]
	}
	return strings.Join(append(urls[i:], urls[:i]...), ",")
}

// post sends one JSON request to a server; a network error is returned as
// such (its outcome is unknown), an answer as its status and body.
func (h *haCluster) post(ctx context.Context, base, path string, body any) (int, []byte, error) {
	b, err := json.Marshal(body)
	if err != nil {
		return 0, nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+path, bytes.NewReader(b))
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := h.hc.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, nil, err
	}
	return resp.StatusCode, data, nil
}

// status reads a key's status through one server.
func (h *haCluster) status(ctx context.Context, base, typ, res string) (api.StatusResponse, error) {
	var st api.StatusResponse
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/status?type="+typ+"&resource_id="+url.QueryEscape(res), nil)
	if err != nil {
		return st, err
	}
	resp, err := h.hc.Do(req)
	if err != nil {
		return st, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return st, fmt.Errorf("/status: %d %s", resp.StatusCode, b)
	}
	return st, json.NewDecoder(resp.Body).Decode(&st)
}

// tokenWatch checks what every /status answer of a key says, in the order
// the answers came: a token names one holder only (no double grant), and
// tokens never go backwards (docs/DESIGN.md, "Fencing tokens").
type tokenWatch struct {
	mu      sync.Mutex
	last    uint64
	holders map[uint64]string
	errs    []string
}

func newTokenWatch() *tokenWatch { return &tokenWatch{holders: map[uint64]string{}} }

// see records one answer, read after every earlier one was recorded.
func (w *tokenWatch) see(from string, st api.StatusResponse) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if st.Token < w.last {
		w.errs = append(w.errs, fmt.Sprintf("%s: token %d after %d: a token went backwards", from, st.Token, w.last))
	}
	w.last = max(w.last, st.Token)
	if st.State != "held" {
		return
	}
	if h, ok := w.holders[st.Token]; ok && h != st.Holder {
		w.errs = append(w.errs, fmt.Sprintf("%s: token %d held by %s and by %s: a double grant", from, st.Token, h, st.Holder))
	}
	w.holders[st.Token] = st.Holder
}

func (w *tokenWatch) check(t testing.TB) {
	t.Helper()
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, e := range w.errs {
		t.Error(e)
	}
}

// pollTokens polls the key's /status on every server that is up until ctx
// ends, feeding w; it is how a test watches for a double grant and a token
// going backwards while servers die. Each round asks the servers one after
// the other, so the answers it records are in real-time order.
func (h *haCluster) pollTokens(ctx context.Context, typ, res string, w *tokenWatch) {
	for ctx.Err() == nil {
		for _, s := range h.servers {
			rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			st, err := h.status(rctx, s.URL(), typ, res)
			cancel()
			if err == nil {
				w.see(s.name, st)
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// etcdLeader is the index of the etcd member that leads now.
func (h *haCluster) etcdLeader(t testing.TB) int {
	t.Helper()
	cli := h.etcd.Client(t)
	var leader int
	kit.Await(t, "an etcd leader", func() error {
		for i, ep := range h.etcd.Endpoints() {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			st, err := cli.Status(ctx, ep)
			cancel()
			if err == nil && st.Leader != 0 && st.Leader == st.Header.MemberId {
				leader = i
				return nil
			}
		}
		return fmt.Errorf("no member says it leads")
	})
	return leader
}

// TestHAServeStartsDuringEtcdElection: a dlock server started just as its
// etcd leader dies waits for etcd
// within its start-up bound (30 s) instead of exiting at the first "request timed
// out, possibly due to previous leader failure" (seen in TestHAPullOnce): a
// server restarted by its supervisor during an etcd election must come up.
func TestHAServeStartsDuringEtcdElection(t *testing.T) {
	h := startHA(t, 1)
	s := h.servers[0]
	for range 2 {
		s.Kill()
		leader := h.etcdLeader(t)
		h.etcd.Kill(leader)
		s.start()
		h.etcd.Restart(leader)
		s.waitUp(h.hc)
	}
}

// sessionLease is the etcd lease of node's session, 0 when it has none
// (lock/etcd/records.go: P/s/<node>).
func (h *haCluster) sessionLease(t testing.TB, node string) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := h.etcd.Client(t).Get(ctx, h.prefix+"s/"+url.PathEscape(node))
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		return 0
	}
	var rec struct {
		Lease int64 `json:"l"`
	}
	if err := json.Unmarshal(resp.Kvs[0].Value, &rec); err != nil {
		t.Fatal(err)
	}
	return rec.Lease
}
