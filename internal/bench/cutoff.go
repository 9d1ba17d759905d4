package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/dlock/dlock/internal/netfault"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// The cut-off scenarios prove, with real faults on real processes, that a
// node cut off from the lock service stops before its lock moves on, and
// that the lock moves on within its bound (docs/DESIGN.md, "The holder
// stops first"). They are shared by cmd/dlock's TestCutoff* and `dlock
// bench --scenario cutoff`.
//
// A round: a holder H and a waiter W, two `dlock run` processes on one key
// (type update, so that H's success hands the key to W rather than
// completing W's wait), each given its own list of servers and H its own
// loopback address (--source-addr), so that a fault can cut off H alone.
// Both commands append a line "NODE UNIX-NANOSECONDS" to one shared file
// every 50 ms: H's until a stop file appears, W's five lines. Once H has
// written three lines and W is queued, and then 0 to 19 more of H's lines
// (the cut's moment spread over the second that H's confirmations and the
// server's pings repeat in), the fault is made; the round then
// waits for W's command to finish, healing nothing before. When H is still
// writing long after the cut, past the moment its lock would have moved on
// had it been lost (grace + ping + dead-peer + 2 s), it kept its hold (by moving to a server
// that can vouch for it): the stop file ends its command, and W's runs
// after. The file alone then says whether the two commands overlapped. On
// etcd, another data set of the same etcd changes all along, as on an etcd
// that other users share.

// Cutoff scenarios, by name.
const (
	CutoffMemoryCut        = "memory-cut"           // memory: H's address dropped, both ways
	CutoffMemoryToHolder   = "memory-to-holder"     // memory: the server's packets to H dropped
	CutoffMemoryFromHolder = "memory-from-holder"   // memory: H's packets to the server dropped
	CutoffEtcdCut          = "etcd-cut"             // etcd: H's address dropped, cut off from every server
	CutoffEtcdFrozen       = "etcd-frozen"          // etcd: H's server frozen (SIGSTOP) and its address dropped
	CutoffEtcdOffEtcd      = "etcd-server-off-etcd" // etcd: H's server cut off from etcd (black-holed proxies)
)

// CutoffScenarios lists the scenarios in the order they run: the memory
// engine's, then the etcd engine's.
var CutoffScenarios = []string{CutoffMemoryCut, CutoffMemoryToHolder, CutoffMemoryFromHolder, CutoffEtcdCut, CutoffEtcdFrozen, CutoffEtcdOffEtcd}

// CutoffEtcd reports whether a scenario runs on the etcd engine.
func CutoffEtcd(name string) bool { return strings.HasPrefix(name, "etcd-") }

// The servers' timings in the scenarios: the ping interval and dead-peer
// timeout are dlock serve's defaults, given explicitly; the grace is 3 s
// on the memory engine and the default 5 s on etcd (whose sessions are
// etcd leases of that TTL, kept alive every third of it).
const (
	cutoffPing     = time.Second
	cutoffDeadPeer = 3 * time.Second
	// cutoffSlack is what the bound allows past grace + ping + dead-peer:
	// a hand-off on a loaded machine, the waiter's command starting. It
	// is a bound on liveness, not a measure of speed.
	cutoffSlack = 10 * time.Second
)

func cutoffGrace(name string) time.Duration {
	if CutoffEtcd(name) {
		return 5 * time.Second
	}
	return 3 * time.Second
}

// CutoffBound is the longest a scenario's key may take, from the cut, to
// reach the waiter when the holder stopped: the grace, the ping interval
// and the dead-peer timeout (docs/DESIGN.md's derived bound), plus a
// slack of 10 s.
func CutoffBound(name string) time.Duration {
	return cutoffGrace(name) + cutoffPing + cutoffDeadPeer + cutoffSlack
}

// cutoffMayKeep reports whether H may keep its hold through the fault: it
// reaches another server that reaches etcd. A node cut off from every
// server, or whose packets one way are lost, must stop.
func cutoffMayKeep(name string) bool {
	return name == CutoffEtcdFrozen || name == CutoffEtcdOffEtcd
}

// CutoffEnv is where cut-off rounds run.
type CutoffEnv struct {
	// Bin is the dlock binary: the servers and the nodes.
	Bin string
	// Etcd are an etcd cluster's client URLs, for the etcd scenarios;
	// each round uses a data set of its own (a fresh prefix).
	Etcd []string
	// Dir is a directory for the rounds' files: each round makes a
	// directory of its own in it, with the shared file and the servers'
	// and nodes' logs.
	Dir string
	// LostStatus is dlock run's exit status for a lost lock (75).
	LostStatus int
}

// CutoffOutcome is one round's outcome.
type CutoffOutcome struct {
	Scenario string
	// Kept: H was still writing long past the cut (grace + ping +
	// dead-peer + 2 s), so it kept its hold, and its command was then
	// ended; Stopped and Next say nothing of the fault then.
	Kept bool
	// Stopped is the time from the cut to H's last line: H's command was
	// stopped at most 50 ms later (when not Kept).
	Stopped time.Duration
	// Next is the time from the cut to W's first line.
	Next time.Duration
	// Bound is CutoffBound of the scenario.
	Bound time.Duration
	// Overlap is how long W's lines and H's overlapped: H's last line's
	// time minus W's first's, 0 when W's first came after H's last.
	// OverlapLines counts H's lines written after W's first line, in the
	// file's order or by their times: 0.
	Overlap      time.Duration
	OverlapLines int
	// HolderLines and WaiterLines are the lines each wrote.
	HolderLines, WaiterLines int
	// The nodes' exit statuses and what they printed.
	HolderStatus, WaiterStatus int
	HolderStderr, WaiterStderr string
	// Problems are what breaks the scenario's promise: an overlap, a
	// holder that neither stopped as it should nor kept its hold, a key
	// that did not move on within its bound, a node that failed.
	Problems []string
	// Dir holds the round's files: the shared file, every log.
	Dir string
}

// RunCutoff runs one round of the named scenario in env: it starts the
// round's servers, makes the fault, and undoes everything before it
// returns (the fault healed, frozen servers thawed, processes killed). It
// returns an error when the round could not be run (a server that did not
// start, a fault that could not be made); the scenario's failures are the
// outcome's Problems. It needs root (netfault.Usable).
func RunCutoff(ctx context.Context, env CutoffEnv, name string) (CutoffOutcome, error) {
	o := CutoffOutcome{Scenario: name, Bound: CutoffBound(name)}
	if !slices.Contains(CutoffScenarios, name) {
		return o, fmt.Errorf("no cut-off scenario %q", name)
	}
	if err := netfault.Usable(); err != nil {
		return o, err
	}
	if CutoffEtcd(name) && len(env.Etcd) == 0 {
		return o, fmt.Errorf("%s: no etcd", name)
	}
	dir, err := os.MkdirTemp(env.Dir, name+"-")
	if err != nil {
		return o, err
	}
	o.Dir = dir
	r := &cutoffRound{env: env, name: name, dir: dir, id: runID()}
	defer r.undo()
	if err := r.setUp(ctx); err != nil {
		return o, err
	}
	err = r.run(ctx, &o)
	return o, err
}

// cutoffRound is one round's state: what it started, what undoes it.
type cutoffRound struct {
	env  CutoffEnv
	name string
	dir  string
	id   string

	servers []*serveProc
	holder  cutoffNode
	waiter  cutoffNode
	cut     func() (heal func() error, err error)
	undos   []func() // run in reverse order by undo
}

// cutoffNode is what a node is given.
type cutoffNode struct {
	name    string
	servers []string
	source  string // --source-addr, "" for none
}

func (r *cutoffRound) later(f func()) { r.undos = append(r.undos, f) }

func (r *cutoffRound) undo() {
	for i := len(r.undos) - 1; i >= 0; i-- {
		r.undos[i]()
	}
	r.undos = nil
}

// setUp starts the round's servers and readies its fault.
func (r *cutoffRound) setUp(ctx context.Context) error {
	hAddr, release, err := netfault.ReserveAddr()
	if err != nil {
		return err
	}
	r.later(release)
	grace := cutoffGrace(r.name)
	common := []string{"--session-grace", grace.String(), "--ping-interval", cutoffPing.String(), "--dead-peer-timeout", cutoffDeadPeer.String(), "--log-level", "debug"}
	r.holder = cutoffNode{name: "holder-" + r.id, source: hAddr}
	r.waiter = cutoffNode{name: "waiter-" + r.id}
	if !CutoffEtcd(r.name) {
		s, err := r.serve(ctx, "memory", "127.0.0.1", common)
		if err != nil {
			return err
		}
		r.holder.servers, r.waiter.servers = []string{s.url}, []string{s.url}
		switch r.name {
		case CutoffMemoryCut:
			r.cut = func() (func() error, error) { return netfault.Drop(hAddr) }
		case CutoffMemoryToHolder:
			r.cut = func() (func() error, error) { return netfault.DropFromTo("127.0.0.1", hAddr) }
		case CutoffMemoryFromHolder:
			r.cut = func() (func() error, error) { return netfault.DropFromTo(hAddr, "127.0.0.1") }
		}
		return nil
	}
	// Three servers on one data set; H's first is server 0, the one the
	// fault hits, W's server 1.
	prefix := fmt.Sprintf("/dlock-cutoff-%s-%d/", r.id, time.Now().UnixNano())
	// The etcd is shared, as a real one may be: another data set changes
	// every 100 ms, so that etcd's revision moves on outside this one's.
	if err := r.elsewhere(prefix); err != nil {
		return err
	}
	etcdFlags := func(endpoints []string) []string {
		return append([]string{"--backend", "etcd", "--etcd-endpoints", strings.Join(endpoints, ","), "--etcd-prefix", prefix}, common...)
	}
	host0, endpoints0 := "127.0.0.1", r.env.Etcd
	var proxies []*netfault.Proxy
	switch r.name {
	case CutoffEtcdFrozen:
		// Server 0 on an address of its own, to be dropped.
		a, release, err := netfault.ReserveAddr()
		if err != nil {
			return err
		}
		r.later(release)
		host0 = a
	case CutoffEtcdOffEtcd:
		// Server 0 reaches etcd through proxies, to be black-holed.
		endpoints0 = nil
		for _, ep := range r.env.Etcd {
			u, err := url.Parse(ep)
			if err != nil {
				return err
			}
			p, err := netfault.ListenProxy("127.0.0.1:0", u.Host)
			if err != nil {
				return err
			}
			r.later(func() { p.Close() })
			proxies = append(proxies, p)
			endpoints0 = append(endpoints0, "http://"+p.Addr())
		}
	}
	for i := range 3 {
		host, eps := "127.0.0.1", r.env.Etcd
		if i == 0 {
			host, eps = host0, endpoints0
		}
		if _, err := r.serve(ctx, fmt.Sprintf("etcd%d", i), host, etcdFlags(eps)); err != nil {
			return err
		}
	}
	urls := func(order ...int) []string {
		var out []string
		for _, i := range order {
			out = append(out, r.servers[i].url)
		}
		return out
	}
	r.holder.servers, r.waiter.servers = urls(0, 1, 2), urls(1, 2, 0)
	s0 := r.servers[0]
	switch r.name {
	case CutoffEtcdCut:
		r.cut = func() (func() error, error) { return netfault.Drop(hAddr) }
	case CutoffEtcdFrozen:
		r.cut = func() (func() error, error) {
			if err := netfault.Suspend(s0.pid); err != nil {
				netfault.Thaw(s0.pid)
				return nil, err
			}
			heal, err := netfault.Drop(host0)
			if err != nil {
				netfault.Thaw(s0.pid)
				return nil, err
			}
			return func() error { return errors.Join(heal(), netfault.Thaw(s0.pid)) }, nil
		}
	case CutoffEtcdOffEtcd:
		r.cut = func() (func() error, error) {
			for _, p := range proxies {
				p.Blackhole()
			}
			return func() error {
				for _, p := range proxies {
					p.Heal()
				}
				return nil
			}, nil
		}
	}
	return nil
}

// elsewhere writes, until the round ends, a key outside the round's data
// set every 100 ms.
func (r *cutoffRound) elsewhere(prefix string) error {
	cli, err := clientv3.New(clientv3.Config{Endpoints: r.env.Etcd, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		return err
	}
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			_, _ = cli.Put(ctx, "/dlock-cutoff-elsewhere"+prefix, time.Now().String())
			cancel()
		}
	}()
	r.later(func() { close(stop); <-done; cli.Close() })
	return nil
}

// serve starts one `dlock serve` of the round on host.
func (r *cutoffRound) serve(ctx context.Context, name, host string, flags []string) (*serveProc, error) {
	s, err := startServe(ctx, r.env.Bin, host, flags, filepath.Join(r.dir, name+".log"))
	if err != nil {
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	r.later(s.kill)
	r.servers = append(r.servers, s)
	return s, nil
}

// run runs the nodes, makes the fault and fills o.
func (r *cutoffRound) run(ctx context.Context, o *CutoffOutcome) error {
	lines := filepath.Join(r.dir, "lines")
	stop := filepath.Join(r.dir, "stop")
	key := "cutoff-" + r.id
	hScript := fmt.Sprintf(`while [ ! -e %s ]; do echo "%s $(date +%%s%%N)" >> %s; sleep 0.05; done`, shq(stop), r.holder.name, shq(lines))
	wScript := fmt.Sprintf(`i=0; while [ $i -lt 5 ]; do echo "%s $(date +%%s%%N)" >> %s; i=$((i+1)); sleep 0.05; done`, r.waiter.name, shq(lines))
	h, err := r.runNode(r.holder, key, hScript)
	if err != nil {
		return err
	}
	defer h.kill()
	read := func() ([]cutoffLine, error) { return readCutoffLines(lines) }
	// H runs its command: three lines written.
	if err := waitUntil(ctx, 30*time.Second, "the holder's command to write 3 lines", func() (bool, error) {
		if h.done() {
			return false, fmt.Errorf("the holder exited: %d %s", h.status(), h.stderr())
		}
		ls, err := read()
		return count(ls, r.holder.name) >= 3, err
	}); err != nil {
		return err
	}
	w, err := r.runNode(r.waiter, key, wScript)
	if err != nil {
		return err
	}
	defer w.kill()
	// W is queued behind H (asked of W's server).
	if err := waitUntil(ctx, 30*time.Second, "the waiter to be queued", func() (bool, error) {
		if w.done() {
			return false, fmt.Errorf("the waiter exited: %d %s", w.status(), w.stderr())
		}
		st, err := keyStatus(r.waiter.servers[0], key)
		return err == nil && st.Holder == r.holder.name && st.QueueLength >= 1, nil
	}); err != nil {
		return err
	}
	// The cut comes at a moment spread over a second (0 to 19 more of
	// H's lines, each 50 ms apart): over the period of H's confirmations
	// and of the server's pings, whose phases the timeline depends on.
	more := count(mustRead(read), r.holder.name) + rand.IntN(20)
	if err := waitUntil(ctx, 30*time.Second, "the holder's command to write more lines", func() (bool, error) {
		if h.done() || w.done() {
			return false, fmt.Errorf("a node exited before the cut: holder %d %s, waiter %d %s", h.status(), h.stderr(), w.status(), w.stderr())
		}
		ls, err := read()
		return count(ls, r.holder.name) >= more, err
	}); err != nil {
		return err
	}
	heal, err := r.cut()
	if err != nil {
		return fmt.Errorf("making the fault: %w", err)
	}
	cut := time.Now()
	healed := false
	doHeal := func() error {
		if healed {
			return nil
		}
		healed = true
		return heal()
	}
	defer doHeal()
	// The outcome: W's command finished (H stopped, or kept its hold and
	// was then ended), or neither within the bound and patience.
	keptAfter := time.Duration(0)
	if cutoffMayKeep(r.name) {
		keptAfter = cutoffGrace(r.name) + cutoffPing + cutoffDeadPeer + 2*time.Second
	}
	giveUp := cut.Add(o.Bound + 30*time.Second)
	for !w.done() {
		if err := ctx.Err(); err != nil {
			return err
		}
		if time.Now().After(giveUp) {
			o.Problems = append(o.Problems, fmt.Sprintf("the waiter's command did not finish within %v of the cut", time.Since(cut).Round(time.Millisecond)))
			break
		}
		ls, err := read()
		if err != nil {
			return err
		}
		if !o.Kept && keptAfter > 0 && !h.done() && count(ls, r.waiter.name) == 0 && lastOf(ls, r.holder.name).After(cut.Add(keptAfter)) {
			// H works on long past the moment its key would have moved
			// on: it kept its hold. Its command ends now.
			o.Kept = true
			if err := os.WriteFile(stop, nil, 0o600); err != nil {
				return err
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	// Healed, H's dlock run gets its unlock through and exits.
	if err := doHeal(); err != nil {
		return fmt.Errorf("undoing the fault: %w", err)
	}
	if err := os.WriteFile(stop, nil, 0o600); err != nil {
		return err
	}
	for _, n := range []*nodeProc{h, w} {
		if !n.wait(30 * time.Second) {
			o.Problems = append(o.Problems, fmt.Sprintf("%s did not exit within 30 s of the heal", n.name))
		}
	}
	o.HolderStatus, o.HolderStderr = h.status(), h.stderr()
	o.WaiterStatus, o.WaiterStderr = w.status(), w.stderr()
	ls, err := read()
	if err != nil {
		return err
	}
	r.judge(o, ls, cut)
	return nil
}

// judge fills o from the shared file's lines and checks the promise.
func (r *cutoffRound) judge(o *CutoffOutcome, ls []cutoffLine, cut time.Time) {
	hName, wName := r.holder.name, r.waiter.name
	o.HolderLines, o.WaiterLines = count(ls, hName), count(ls, wName)
	hLast := lastOf(ls, hName)
	firstW := slices.IndexFunc(ls, func(l cutoffLine) bool { return l.node == wName })
	if firstW >= 0 {
		wFirst := ls[firstW].at
		o.Next = wFirst.Sub(cut)
		if d := hLast.Sub(wFirst); d > 0 {
			o.Overlap = d
		}
		for i, l := range ls {
			if l.node == hName && (i > firstW || !l.at.Before(wFirst)) {
				o.OverlapLines++
			}
		}
	}
	if !o.Kept {
		o.Stopped = hLast.Sub(cut)
	}
	var p []string
	if o.Overlap > 0 || o.OverlapLines > 0 {
		p = append(p, fmt.Sprintf("OVERLAP: %d lines of the holder at or after the waiter's first, by %v", o.OverlapLines, o.Overlap))
	}
	switch {
	case o.Kept && !cutoffMayKeep(r.name):
		p = append(p, "the holder kept working although cut off")
	case o.Kept:
		if o.HolderStatus != 0 {
			p = append(p, fmt.Sprintf("the holder kept its hold, yet exited %d: %s", o.HolderStatus, o.HolderStderr))
		}
	default:
		if o.HolderStatus != r.env.LostStatus || !strings.Contains(o.HolderStderr, "lock lost") {
			p = append(p, fmt.Sprintf("the holder stopped with status %d, not %d saying lock lost: %s", o.HolderStatus, r.env.LostStatus, o.HolderStderr))
		}
		if firstW < 0 {
			p = append(p, "the waiter never ran")
		} else if o.Next > o.Bound {
			p = append(p, fmt.Sprintf("the key moved on %v after the cut, past its bound of %v", o.Next.Round(time.Millisecond), o.Bound))
		}
	}
	if o.WaiterStatus != 0 || o.WaiterLines != 5 {
		p = append(p, fmt.Sprintf("the waiter exited %d after %d lines: %s", o.WaiterStatus, o.WaiterLines, o.WaiterStderr))
	}
	o.Problems = append(o.Problems, p...)
}

// runNode starts `dlock run` for n.
func (r *cutoffRound) runNode(n cutoffNode, key, script string) (*nodeProc, error) {
	args := []string{"run", "--node", n.name, "--server", strings.Join(n.servers, ","), "--type", "update", "--resource", key, "--always"}
	if n.source != "" {
		args = append(args, "--source-addr", n.source)
	}
	args = append(args, "--", "sh", "-c", script)
	cmd := exec.Command(r.env.Bin, args...)
	cmd.Env = withoutDlockEnv()
	p := &nodeProc{name: n.name, exited: make(chan struct{})}
	cmd.Stdout = io.Discard
	cmd.Stderr = &p.err
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p.cmd = cmd
	go func() { cmd.Wait(); close(p.exited) }()
	return p, nil
}

// nodeProc is one `dlock run` of a round.
type nodeProc struct {
	name   string
	cmd    *exec.Cmd
	err    lockedBuffer
	exited chan struct{}
}

func (p *nodeProc) done() bool {
	select {
	case <-p.exited:
		return true
	default:
		return false
	}
}

func (p *nodeProc) wait(d time.Duration) bool {
	select {
	case <-p.exited:
		return true
	case <-time.After(d):
		return false
	}
}

// status is the exit status, -1 while it runs or when a signal ended it.
func (p *nodeProc) status() int {
	if !p.done() {
		return -1
	}
	return p.cmd.ProcessState.ExitCode()
}

func (p *nodeProc) stderr() string { return strings.TrimSpace(p.err.String()) }

// kill ends the node and its command (both in its process group).
func (p *nodeProc) kill() {
	if !p.done() {
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.exited
	}
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// serveProc is one `dlock serve` process.
type serveProc struct {
	url    string
	pid    int
	exited chan struct{}
}

// kill ends the server (thawing it first if it was frozen: a stopped
// process dies of SIGKILL all the same, and SIGCONT is harmless).
func (s *serveProc) kill() {
	_ = syscall.Kill(-s.pid, syscall.SIGKILL)
	_ = syscall.Kill(s.pid, syscall.SIGCONT)
	<-s.exited
}

// startServe starts `bin serve` on a free port of host with flags, its log
// in logPath, and waits until it answers /healthz.
func startServe(ctx context.Context, bin, host string, flags []string, logPath string) (*serveProc, error) {
	var err error
	for range 3 { // a free port can be taken before the server binds it
		var s *serveProc
		if s, err = startServeOnce(ctx, bin, host, flags, logPath); err == nil {
			return s, nil
		}
	}
	return nil, err
}

func startServeOnce(ctx context.Context, bin, host string, flags []string, logPath string) (*serveProc, error) {
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return nil, err
	}
	addr := ln.Addr().String()
	ln.Close()
	log, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer log.Close()
	cmd := exec.Command(bin, append([]string{"serve", "--listen", addr, "--data-dir", ""}, flags...)...)
	cmd.Env = withoutDlockEnv()
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	s := &serveProc{url: "http://" + addr, pid: cmd.Process.Pid, exited: make(chan struct{})}
	go func() { cmd.Wait(); close(s.exited) }()
	hc := &http.Client{Timeout: time.Second}
	defer hc.CloseIdleConnections()
	err = waitUntil(ctx, 30*time.Second, "dlock serve on "+addr+" to answer /healthz", func() (bool, error) {
		select {
		case <-s.exited:
			return false, fmt.Errorf("dlock serve on %s exited (log: %s)", addr, logPath)
		default:
		}
		resp, err := hc.Get(s.url + "/healthz")
		if err != nil {
			return false, nil
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, nil
	})
	if err != nil {
		s.kill()
		return nil, err
	}
	return s, nil
}

// withoutDlockEnv is the environment without DLOCK_* settings: those are
// for the servers a user runs, not for the round's.
func withoutDlockEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DLOCK_") {
			env = append(env, kv)
		}
	}
	return env
}

// waitUntil polls cond every 20 ms until it holds, fails, or patience
// runs out.
func waitUntil(ctx context.Context, patience time.Duration, what string, cond func() (bool, error)) error {
	deadline := time.Now().Add(patience)
	for {
		ok, err := cond()
		if err != nil {
			return fmt.Errorf("waiting for %s: %w", what, err)
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %v waiting for %s", patience, what)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

type keyState struct {
	Holder      string `json:"holder"`
	QueueLength int    `json:"queue_length"`
}

var statusClient = &http.Client{Timeout: 2 * time.Second}

// keyStatus reads an update key's /status from a server.
func keyStatus(base, key string) (keyState, error) {
	var st keyState
	resp, err := statusClient.Get(base + "/status?type=update&resource_id=" + url.QueryEscape(key))
	if err != nil {
		return st, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return st, fmt.Errorf("/status: %s", resp.Status)
	}
	return st, json.NewDecoder(resp.Body).Decode(&st)
}

// cutoffLine is one line of the shared file.
type cutoffLine struct {
	node string
	at   time.Time
}

// readCutoffLines reads the shared file, in its order; a last line not yet
// complete is left for the next read.
func readCutoffLines(path string) ([]cutoffLine, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return parseCutoffLines(data)
}

func parseCutoffLines(data []byte) ([]cutoffLine, error) {
	data = data[:bytes.LastIndexByte(data, '\n')+1] // a last line being written waits
	var ls []cutoffLine
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) != 2 {
			return nil, fmt.Errorf("a line of the shared file is not \"NODE NANOSECONDS\": %q", sc.Text())
		}
		ns, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("a line of the shared file: %q: %v", sc.Text(), err)
		}
		ls = append(ls, cutoffLine{node: f[0], at: time.Unix(0, ns)})
	}
	return ls, sc.Err()
}

// mustRead is the lines read, none on an error (which the next read,
// checked, reports).
func mustRead(read func() ([]cutoffLine, error)) []cutoffLine {
	ls, _ := read()
	return ls
}

func count(ls []cutoffLine, node string) int {
	n := 0
	for _, l := range ls {
		if l.node == node {
			n++
		}
	}
	return n
}

// lastOf is the latest time of node's lines, zero without one.
func lastOf(ls []cutoffLine, node string) time.Time {
	var t time.Time
	for _, l := range ls {
		if l.node == node && l.at.After(t) {
			t = l.at
		}
	}
	return t
}

// shq quotes s for sh.
func shq(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// CutoffSummary is a scenario's rounds, as dlock bench prints them. The
// times of the rounds in which the holder kept its hold are left out of
// the stopped and next figures: the fault did not move the key then.
type CutoffSummary struct {
	Scenario string `json:"scenario"`
	Rounds   int    `json:"rounds"`
	// Kept counts the rounds in which the holder kept its hold.
	Kept int `json:"kept"`
	// Stopped: cut → the holder's last line; Next: cut → the next
	// holder's first line (p50 and max over the rounds it stopped in).
	StoppedP50 float64 `json:"stopped_p50_ms"`
	StoppedMax float64 `json:"stopped_max_ms"`
	NextP50    float64 `json:"next_p50_ms"`
	NextMax    float64 `json:"next_max_ms"`
	Bound      float64 `json:"bound_ms"`
	// Overlap is the longest overlap of any round, and OverlapLines all
	// rounds' holder lines at or after the waiter's first: both 0.
	Overlap      float64  `json:"overlap_ms"`
	OverlapLines int      `json:"overlap_lines"`
	Problems     []string `json:"problems,omitempty"`
}

// SummarizeCutoff sums up a scenario's rounds.
func SummarizeCutoff(name string, rounds []CutoffOutcome) CutoffSummary {
	s := CutoffSummary{Scenario: name, Rounds: len(rounds), Bound: ms(CutoffBound(name))}
	var stopped, next []time.Duration
	for i, o := range rounds {
		if o.Kept {
			s.Kept++
		} else {
			stopped, next = append(stopped, o.Stopped), append(next, o.Next)
		}
		s.Overlap = max(s.Overlap, ms(o.Overlap))
		s.OverlapLines += o.OverlapLines
		for _, p := range o.Problems {
			s.Problems = append(s.Problems, fmt.Sprintf("round %d: %s", i+1, p))
		}
	}
	if len(stopped) > 0 {
		s.StoppedP50, s.StoppedMax = median(stopped)/1e3, durMax(stopped)/1e3
		s.NextP50, s.NextMax = median(next)/1e3, durMax(next)/1e3
	}
	return s
}

// Failed reports a round that broke the promise: an overlap, or any
// other problem.
func (s CutoffSummary) Failed() bool {
	return s.Overlap > 0 || s.OverlapLines > 0 || len(s.Problems) > 0
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1e3 }
