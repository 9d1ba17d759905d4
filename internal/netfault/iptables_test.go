package netfault

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
)

// dialTimeout is how long a dial across a partition is given: on
// loopback, an answered dial takes microseconds.
const dialTimeout = 300 * time.Millisecond

// server is a listener on addr (host:0) whose accepted connections the
// test receives on the channel.
func server(t *testing.T, addr string) (net.Listener, <-chan net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	conns := make(chan net.Conn, 16)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns <- c
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
		close(conns)
		for c := range conns {
			c.Close()
		}
	})
	return ln, conns
}

// connect dials addr from ip and returns both ends.
func connect(t *testing.T, ip, addr string, conns <-chan net.Conn) (client, srv net.Conn) {
	t.Helper()
	d := DialerFrom(ip)
	d.Timeout = kit.Patience
	client, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatalf("dial %s from %s: %v", addr, ip, err)
	}
	t.Cleanup(func() { client.Close() })
	if got, _, _ := net.SplitHostPort(client.LocalAddr().String()); got != ip {
		t.Fatalf("the dial left from %s, want %s", got, ip)
	}
	select {
	case srv = <-conns:
	case <-time.After(kit.Patience):
		t.Fatal("the server accepted nothing")
	}
	return client, srv
}

// expectDialTimeout checks that a dial from ip to addr times out.
func expectDialTimeout(t *testing.T, ip, addr string) {
	t.Helper()
	d := DialerFrom(ip)
	d.Timeout = dialTimeout
	c, err := d.Dial("tcp", addr)
	if err == nil {
		c.Close()
		t.Fatalf("a dial from %s to %s went through the partition", ip, addr)
	}
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("a dial from %s to %s: %v; want a timeout (no answer, no refusal)", ip, addr, err)
	}
}

// rules are the lines of `iptables -S` tagged by this package whose tag
// begins with prefix.
func rules(t *testing.T, prefix string) []string {
	t.Helper()
	bin, err := findIptables()
	if err != nil {
		t.Fatal(err)
	}
	out, err := iptables(bin, "-S")
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(line, "--comment "+prefix) || strings.Contains(line, `--comment "`+prefix) {
			found = append(found, line)
		}
	}
	return found
}

// ours is the prefix of this process's tags.
func ours() string { return fmt.Sprintf("%s%d-", TagPrefix, os.Getpid()) }

// TestDropAddr: a client dialing from a dropped address times out (no
// answer, no refusal), bytes on its open connection are held, and after
// the test's cleanup its rules are gone, the dial works and TCP delivers
// what was sent during the partition.
func TestDropAddr(t *testing.T) {
	NeedRoot(t)
	ln, conns := server(t, "127.0.0.1:0")
	ip := LoopbackAddr(t)
	client, srv := connect(t, ip, ln.Addr().String(), conns)

	t.Run("partitioned", func(t *testing.T) {
		DropAddr(t, ip)
		if got := rules(t, ours()); len(got) != 2 {
			t.Fatalf("rules of this process: %q; want two", got)
		}
		expectDialTimeout(t, ip, ln.Addr().String())
		send(t, client, "sent during the partition")
		expectQuiet(t, srv, "the server, partitioned")
		send(t, srv, "the other way")
		expectQuiet(t, client, "the client, partitioned")
	})
	if got := rules(t, ours()); len(got) != 0 {
		t.Fatalf("rules left after the cleanup: %q", got)
	}
	// TCP retransmits what the partition lost (backing off: a second or
	// two after a partition this short).
	expect(t, srv, "sent during the partition")
	expect(t, client, "the other way")
	c2, s2 := connect(t, ip, ln.Addr().String(), conns)
	send(t, c2, "after")
	expect(t, s2, "after")

	// heal ends it before the cleanup, which does not remove it twice.
	t.Run("healed early", func(t *testing.T) {
		heal := DropAddr(t, ip)
		expectDialTimeout(t, ip, ln.Addr().String())
		heal()
		if got := rules(t, ours()); len(got) != 0 {
			t.Fatalf("rules left after heal: %q", got)
		}
		connect(t, ip, ln.Addr().String(), conns)
	})
}

// TestDropAddrOfServer: a server listening on a dropped address is cut
// off from clients on 127.0.0.1, and only it: another address is not.
func TestDropAddrOfServer(t *testing.T) {
	NeedRoot(t)
	ip, other := LoopbackAddr(t), LoopbackAddr(t)
	ln, _ := server(t, net.JoinHostPort(ip, "0"))
	ln2, conns2 := server(t, net.JoinHostPort(other, "0"))
	DropAddr(t, ip)
	expectDialTimeout(t, "127.0.0.1", ln.Addr().String())
	connect(t, "127.0.0.1", ln2.Addr().String(), conns2)
}

// TestDropOneWay: from a client's address to the server's, dropped; the
// other way, not: the client reads the server, the server does not read
// the client, a new dial fails; healed, the client's bytes come.
func TestDropOneWay(t *testing.T) {
	NeedRoot(t)
	ln, conns := server(t, "127.0.0.1:0")
	ip := LoopbackAddr(t)
	client, srv := connect(t, ip, ln.Addr().String(), conns)
	heal := DropOneWay(t, ip, "127.0.0.1")
	send(t, srv, "down")
	expect(t, client, "down")
	send(t, client, "up")
	expectQuiet(t, srv, "the server, its client's packets dropped")
	expectDialTimeout(t, ip, ln.Addr().String())
	heal()
	expect(t, srv, "up")
}

// TestDropRefuses: 127.0.0.1, addresses outside 127.0.0.0/8 and those the
// system uses are refused, before any rule is added and without root.
func TestDropRefuses(t *testing.T) {
	for _, ip := range []string{"127.0.0.1", "10.0.0.1", "0.0.0.0", "::1", "::ffff:127.0.0.1", "127.0.0.0", "127.255.255.255", "127.0.0.53", "127.0.1.1", "localhost", ""} {
		o := kit.Catch(t, func(tb testing.TB) { DropAddr(tb, ip) })
		if o.FatalMsg == "" || !strings.Contains(o.FatalMsg, "DropAddr") {
			t.Errorf("DropAddr(%q): failed %q, skipped %q; want a failure", ip, o.FatalMsg, o.SkipMsg)
		}
	}
	for _, pair := range [][2]string{{"127.0.0.1", "127.0.0.1"}, {"127.0.0.1", "127.0.0.53"}, {"127.0.0.2", "10.0.0.1"}, {"192.168.1.1", "127.0.0.2"}} {
		o := kit.Catch(t, func(tb testing.TB) { DropOneWay(tb, pair[0], pair[1]) })
		if o.FatalMsg == "" || !strings.Contains(o.FatalMsg, "DropOneWay") {
			t.Errorf("DropOneWay(%q, %q): failed %q, skipped %q; want a failure", pair[0], pair[1], o.FatalMsg, o.SkipMsg)
		}
	}
	for _, ip := range []string{"127.0.0.2", "127.0.0.3", "127.77.1.2", "127.254.0.1"} {
		if _, err := ownAddr(ip); err != nil {
			t.Errorf("ownAddr(%q): %v", ip, err)
		}
	}
}

// TestNeedRoot: without root, a skip saying NOT TESTED; as root without
// iptables, a failure under CI=true and a skip elsewhere, each naming
// `make deps`.
func TestNeedRoot(t *testing.T) {
	oldEuid, oldFind := geteuid, findIptables
	defer func() { geteuid, findIptables = oldEuid, oldFind }()
	findIptables = func() (string, error) { return "", errors.New("iptables is not installed") }
	for _, c := range []struct {
		euid     int
		ci       string
		fail     bool
		mentions string
	}{
		{1000, "true", false, "run `make test` as root"},
		{1000, "", false, "run `make test` as root"},
		{0, "true", true, "make deps"},
		{0, "", false, "make deps"},
	} {
		geteuid = func() int { return c.euid }
		t.Setenv("CI", c.ci)
		o := kit.Catch(t, func(tb testing.TB) { NeedRoot(tb) })
		switch {
		case c.fail && (o.FatalMsg == "" || o.SkipMsg != ""):
			t.Errorf("euid %d, CI=%q: failed %q, skipped %q; want a failure", c.euid, c.ci, o.FatalMsg, o.SkipMsg)
		case !c.fail && (o.SkipMsg == "" || o.FatalMsg != "" || !strings.HasPrefix(o.SkipMsg, "NOT TESTED: ")):
			t.Errorf("euid %d, CI=%q: failed %q, skipped %q; want a skip saying NOT TESTED", c.euid, c.ci, o.FatalMsg, o.SkipMsg)
		}
		if msg := o.FatalMsg + o.SkipMsg; !strings.Contains(msg, c.mentions) {
			t.Errorf("euid %d, CI=%q: %q does not say %q", c.euid, c.ci, msg, c.mentions)
		}
	}
}

// TestCleanupStale: a rule tagged with the pid of a process that is gone
// is removed; one of a live process (this one) is not.
func TestCleanupStale(t *testing.T) {
	NeedRoot(t)
	bin, err := findIptables()
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile("/proc/sys/kernel/pid_max")
	if err != nil {
		t.Fatal(err)
	}
	var pidMax int
	if _, err := fmt.Sscan(string(raw), &pidMax); err != nil {
		t.Fatal(err)
	}
	gone := pidMax + 1 // no process has it
	if alive(gone) {
		t.Fatalf("pid %d is alive", gone)
	}
	ip := LoopbackAddr(t) // the rules match only this test's address
	add := func(tag string) {
		spec := []string{chain, "-s", ip + "/32", "-d", ip + "/32", "-m", "comment", "--comment", tag, "-j", "DROP"}
		if _, err := iptables(bin, append([]string{"-I"}, spec...)...); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _, _ = iptables(bin, append([]string{"-D"}, spec...)...) })
	}
	stale := fmt.Sprintf("%s%d-", TagPrefix, gone)
	add(stale + "1")
	add(stale + "2")
	add(ours() + "999999")
	if got := rules(t, stale); len(got) != 2 {
		t.Fatalf("rules of the gone pid before CleanupStale: %q", got)
	}
	if err := CleanupStale(); err != nil {
		t.Fatal(err)
	}
	if got := rules(t, stale); len(got) != 0 {
		t.Errorf("rules of the gone pid after CleanupStale: %q", got)
	}
	if got := rules(t, ours()+"999999"); len(got) != 1 {
		t.Errorf("CleanupStale removed the rule of a live process: %q", got)
	}
}

// TestLoopbackAddr: the addresses handed out differ and are held, and
// Linux serves them without configuration: a server listens on one, a
// client dials it from another.
func TestLoopbackAddr(t *testing.T) {
	a, b := LoopbackAddr(t), LoopbackAddr(t)
	if a == b {
		t.Fatalf("LoopbackAddr gave %s twice", a)
	}
	for _, ip := range []string{a, b} {
		if _, err := ownAddr(ip); err != nil {
			t.Fatalf("LoopbackAddr gave %s: %v", ip, err)
		}
		if l, err := net.Listen("unix", "@dlock-netfault-"+ip); err == nil {
			l.Close()
			t.Fatalf("%s is not held", ip)
		}
	}
	ln, conns := server(t, net.JoinHostPort(a, "0"))
	client, srv := connect(t, b, ln.Addr().String(), conns)
	if got, _, _ := net.SplitHostPort(srv.RemoteAddr().String()); got != b {
		t.Fatalf("the server sees the client at %s, want %s", got, b)
	}
	send(t, client, "x")
	expect(t, srv, "x")
}

// TestDropForPrograms: Drop and DropFromTo, for programs that are not
// tests (dlock bench), add the rules DropAddr and DropOneWay add, and
// their heal removes them; bad addresses are refused without a rule.
func TestDropForPrograms(t *testing.T) {
	NeedRoot(t)
	if err := Usable(); err != nil {
		t.Fatal(err)
	}
	ip, release, err := ReserveAddr()
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	ln, conns := server(t, "127.0.0.1:0")
	heal, err := Drop(ip)
	if err != nil {
		t.Fatal(err)
	}
	if got := rules(t, ours()); len(got) != 2 {
		heal()
		t.Fatalf("rules after Drop: %q", got)
	}
	expectDialTimeout(t, ip, ln.Addr().String())
	if err := heal(); err != nil {
		t.Fatal(err)
	}
	if err := heal(); err != nil {
		t.Fatalf("a second heal: %v", err)
	}
	connect(t, ip, ln.Addr().String(), conns)
	heal, err = DropFromTo(ip, "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	if got := rules(t, ours()); len(got) != 1 {
		heal()
		t.Fatalf("rules after DropFromTo: %q", got)
	}
	expectDialTimeout(t, ip, ln.Addr().String())
	if err := heal(); err != nil {
		t.Fatal(err)
	}
	if got := rules(t, ours()); len(got) != 0 {
		t.Fatalf("rules after heal: %q", got)
	}
	for _, bad := range [][2]string{{"127.0.0.1", ""}, {"10.0.0.1", ""}, {"127.0.0.1", "127.0.0.1"}} {
		var err error
		if bad[1] == "" {
			_, err = Drop(bad[0])
		} else {
			_, err = DropFromTo(bad[0], bad[1])
		}
		if err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
	if got := rules(t, ours()); len(got) != 0 {
		t.Fatalf("rules after the refusals: %q", got)
	}
}

// TestRemaining: the rules of this process in place, listed; none once
// healed.
func TestRemaining(t *testing.T) {
	NeedRoot(t)
	heal := DropAddr(t, LoopbackAddr(t))
	got, err := Remaining()
	if err != nil || len(got) != 2 {
		t.Fatalf("Remaining with one DropAddr: %q %v", got, err)
	}
	heal()
	if got, err := Remaining(); err != nil || len(got) != 0 {
		t.Fatalf("Remaining after heal: %q %v", got, err)
	}
}
