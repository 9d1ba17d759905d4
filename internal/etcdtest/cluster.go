package etcdtest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Cluster is a cluster of etcd member processes (Debian's etcd binary) on
// 127.0.0.1, each in a process group of its own with its data and log in
// the test's temporary directory.
type Cluster struct {
	tb      testing.TB
	bin     string
	token   string
	initial string // --initial-cluster
	members []*member

	mu      sync.Mutex
	stopped bool
}

type member struct {
	name, dir, logPath string
	client, peer       string // host:port

	mu     sync.Mutex
	cmd    *exec.Cmd
	exited chan struct{} // closed when cmd has been waited for
}

// debianEtcd is where Debian's etcd-server puts etcd (a variable for the
// test of its absence).
var debianEtcd = "/usr/bin/etcd"

// EtcdBinary is the etcd that StartCluster runs: etcd in PATH, else
// /usr/bin/etcd. Without one, it fails the test when CI is "true" and skips
// it otherwise, saying NOT TESTED.
func EtcdBinary(tb testing.TB) string {
	tb.Helper()
	bin, err := exec.LookPath("etcd")
	if err != nil {
		if _, serr := os.Stat(debianEtcd); serr == nil {
			return debianEtcd
		}
		if os.Getenv("CI") == "true" {
			tb.Fatalf("etcdtest: no etcd binary (%v): `make deps` installs Debian's etcd-server as root", err)
		}
		tb.Skipf("NOT TESTED: %s needs an etcd binary and there is none (%v); `make deps` installs Debian's etcd-server as root", tb.Name(), err)
	}
	return bin
}

// StartCluster starts an n-member etcd cluster on free 127.0.0.1 ports and
// waits until a linearizable read succeeds; Stop kills it at tb's cleanup,
// after printing the members' log tails if the test failed.
func StartCluster(tb testing.TB, n int) *Cluster {
	tb.Helper()
	if n < 1 {
		tb.Fatalf("etcdtest: StartCluster of %d members", n)
	}
	bin := EtcdBinary(tb)
	// Free ports are picked before etcd binds them, so another process can
	// take one in between: a start that fails on a taken port is tried
	// again on new ports.
	var err error
	for attempt := 1; attempt <= 3; attempt++ {
		var c *Cluster
		c, err = startCluster(tb, bin, n)
		if err == nil {
			tb.Cleanup(func() {
				if tb.Failed() {
					tb.Logf("etcdtest: the cluster's logs:\n%s", c.logs())
				}
				c.Stop()
			})
			return c
		}
		logs := c.logs()
		c.Stop()
		if !strings.Contains(logs, "address already in use") {
			tb.Fatalf("etcdtest: %v\n%s", err, logs)
		}
		tb.Logf("etcdtest: attempt %d: a port was taken: %v", attempt, err)
	}
	tb.Fatalf("etcdtest: %v", err)
	return nil
}

func startCluster(tb testing.TB, bin string, n int) (*Cluster, error) {
	c := &Cluster{tb: tb, bin: bin, token: "etcdtest-" + randomHex(8)}
	addrs, err := pickAddrs(2 * n)
	if err != nil {
		return c, err
	}
	base := tb.TempDir()
	var initial []string
	for i := range n {
		m := &member{
			name:    fmt.Sprintf("m%d", i),
			client:  addrs[2*i],
			peer:    addrs[2*i+1],
			logPath: filepath.Join(base, fmt.Sprintf("m%d.log", i)),
		}
		m.dir = filepath.Join(base, m.name)
		c.members = append(c.members, m)
		initial = append(initial, m.name+"=http://"+m.peer)
	}
	c.initial = strings.Join(initial, ",")
	for _, m := range c.members {
		if err := c.start(m, "new"); err != nil {
			return c, err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), StartTimeout)
	defer cancel()
	if err := c.waitRead(ctx, c.Endpoints(), c.members...); err != nil {
		return c, fmt.Errorf("the %d-member cluster did not start: %w", n, err)
	}
	return c, nil
}

// pickAddrs is freeAddrs, a variable for the test of a taken port.
var pickAddrs = freeAddrs

// freeAddrs are n free 127.0.0.1 ports, held together while picked so that
// they differ.
func freeAddrs(n int) ([]string, error) {
	var addrs []string
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		defer l.Close()
		addrs = append(addrs, l.Addr().String())
	}
	return addrs, nil
}

// start runs member m's process with --initial-cluster-state state.
func (c *Cluster) start(m *member, state string) error {
	log, err := os.OpenFile(m.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer log.Close() // the process has its own descriptor
	fmt.Fprintf(log, "=== etcdtest: %s starts (--initial-cluster-state %s) at %s\n", m.name, state, time.Now().Format(time.RFC3339Nano))
	cmd := exec.Command(c.bin,
		"--name", m.name,
		"--data-dir", m.dir,
		"--listen-client-urls", "http://"+m.client,
		"--advertise-client-urls", "http://"+m.client,
		"--listen-peer-urls", "http://"+m.peer,
		"--initial-advertise-peer-urls", "http://"+m.peer,
		"--initial-cluster", c.initial,
		"--initial-cluster-state", state,
		"--initial-cluster-token", c.token,
		// A restarted member asks before it disrupts the cluster's term.
		"--pre-vote=true",
		"--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn",
	)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.Env = withoutEtcdEnv(os.Environ())
	// A group of its own, killed whole; and killed with the test binary
	// should that die first, by a panic or go test's -timeout, before its
	// cleanups (Linux; strictly, when the thread that started it ends,
	// which Go's runtime does only for a goroutine that locked its thread
	// and returned without unlocking it).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", m.name, err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	m.mu.Lock()
	m.cmd, m.exited = cmd, exited
	m.mu.Unlock()
	return nil
}

// withoutEtcdEnv drops ETCD_* variables, which etcd reads as flags.
func withoutEtcdEnv(env []string) []string {
	out := env[:0]
	for _, kv := range env {
		if !strings.HasPrefix(kv, "ETCD_") {
			out = append(out, kv)
		}
	}
	return out
}

// Endpoints are the members' client URLs, http://127.0.0.1:PORT, member i
// at index i.
func (c *Cluster) Endpoints() []string {
	var eps []string
	for _, m := range c.members {
		eps = append(eps, "http://"+m.client)
	}
	return eps
}

// Client connects a client to every member; it is closed at tb's cleanup.
func (c *Cluster) Client(tb testing.TB) *clientv3.Client {
	tb.Helper()
	return c.ClientOf(tb, c.Endpoints()...)
}

// ClientOf connects a client to the given endpoints only; it is closed at
// tb's cleanup.
func (c *Cluster) ClientOf(tb testing.TB, endpoints ...string) *clientv3.Client {
	tb.Helper()
	cl, err := newClient(endpoints)
	if err != nil {
		tb.Fatalf("etcdtest: %v", err)
	}
	tb.Cleanup(func() { cl.Close() })
	return cl
}

// Kill kills member i (SIGKILL to its process group) and waits for it to
// exit.
func (c *Cluster) Kill(i int) {
	c.tb.Helper()
	m := c.members[i]
	m.mu.Lock()
	cmd, exited := m.cmd, m.exited
	m.mu.Unlock()
	if cmd == nil {
		return
	}
	select {
	case <-exited: // gone already; its group id may be another's now
	default:
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-exited
	}
}

// Restart starts member i again, with its data dir and
// --initial-cluster-state existing, after killing it if it runs; it waits
// until a linearizable read through that member alone succeeds, that is,
// until the member has rejoined the cluster.
func (c *Cluster) Restart(i int) {
	c.tb.Helper()
	c.Kill(i)
	c.mu.Lock()
	stopped := c.stopped
	c.mu.Unlock()
	if stopped {
		c.tb.Fatalf("etcdtest: Restart(%d) of a stopped cluster", i)
	}
	m := c.members[i]
	if err := c.start(m, "existing"); err != nil {
		c.tb.Fatalf("etcdtest: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), StartTimeout)
	defer cancel()
	if err := c.waitRead(ctx, []string{"http://" + m.client}, m); err != nil {
		c.tb.Fatalf("etcdtest: %s did not rejoin: %v\n%s", m.name, err, tail(m.logPath))
	}
}

// Pid is the process id of member i, 0 when it does not run.
func (c *Cluster) Pid(i int) int {
	if !c.Running(i) {
		return 0
	}
	m := c.members[i]
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.cmd.Process.Pid
}

// Running reports whether member i's process runs.
func (c *Cluster) Running(i int) bool {
	m := c.members[i]
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cmd == nil {
		return false
	}
	select {
	case <-m.exited:
		return false
	default:
		return true
	}
}

// Healthy checks that the cluster has as many members as it started with
// and that every member answers, knows the same leader and serves a
// linearizable read.
func (c *Cluster) Healthy(ctx context.Context) error {
	cl, err := newClient(c.Endpoints())
	if err != nil {
		return err
	}
	defer cl.Close()
	ml, err := cl.MemberList(ctx)
	if err != nil {
		return fmt.Errorf("member list: %w", err)
	}
	if len(ml.Members) != len(c.members) {
		return fmt.Errorf("%d members, want %d", len(ml.Members), len(c.members))
	}
	var leader uint64
	for i, ep := range c.Endpoints() {
		st, err := cl.Status(ctx, ep)
		if err != nil {
			return fmt.Errorf("member %d: status: %w", i, err)
		}
		if len(st.Errors) > 0 {
			return fmt.Errorf("member %d: %v", i, st.Errors)
		}
		if st.Leader == 0 || (leader != 0 && st.Leader != leader) {
			return fmt.Errorf("member %d: leader %x, others %x", i, st.Leader, leader)
		}
		leader = st.Leader
		one, err := newClient([]string{ep})
		if err != nil {
			return err
		}
		err = linearizableGet(ctx, one, "/etcdtest-health")
		one.Close()
		if err != nil {
			return fmt.Errorf("member %d: linearizable read: %w", i, err)
		}
	}
	return nil
}

// WaitHealthy waits up to StartTimeout until Healthy has no error.
func (c *Cluster) WaitHealthy(tb testing.TB) {
	tb.Helper()
	deadline := time.Now().Add(StartTimeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		err := c.Healthy(ctx)
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("etcdtest: the cluster is not healthy after %v: %v", StartTimeout, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// waitRead waits until a linearizable read through endpoints succeeds,
// failing early if one of the members watched exits.
func (c *Cluster) waitRead(ctx context.Context, endpoints []string, watched ...*member) error {
	cl, err := newClient(endpoints)
	if err != nil {
		return err
	}
	defer cl.Close()
	for {
		for _, m := range watched {
			m.mu.Lock()
			exited := m.exited
			m.mu.Unlock()
			select {
			case <-exited:
				return fmt.Errorf("%s exited", m.name)
			default:
			}
		}
		rctx, cancel := context.WithTimeout(ctx, time.Second)
		err := linearizableGet(rctx, cl, "/etcdtest-health")
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return errors.Join(ctx.Err(), err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Stop kills every member; later calls do nothing. StartCluster registers
// it with tb's cleanup.
func (c *Cluster) Stop() {
	c.mu.Lock()
	c.stopped = true
	c.mu.Unlock()
	for i := range c.members {
		c.Kill(i)
	}
}

// logs are the tails of the members' logs.
func (c *Cluster) logs() string {
	var b strings.Builder
	for _, m := range c.members {
		fmt.Fprintf(&b, "--- %s (client %s, peer %s) ", m.name, m.client, m.peer)
		b.WriteString(tail(m.logPath))
		b.WriteString("\n")
	}
	return b.String()
}
