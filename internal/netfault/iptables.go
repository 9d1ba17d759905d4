package netfault

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// TagPrefix begins the iptables comment of every rule this package adds:
// dlock-test-<pid>-<n>, the pid of the test process and a count.
const TagPrefix = "dlock-test-"

// The rules go in the filter table's INPUT chain, which every packet
// crosses on loopback as it is received (OUTPUT as it is sent). A drop on
// receipt is a loss in the network: the sender's stack sent the packet and
// hears nothing back, where a drop in OUTPUT is reported to the sender
// (EPERM to a UDP send, an error the TCP stack sees). Each rule is
// inserted first in the chain, before any ACCEPT of established traffic.
const chain = "INPUT"

var (
	ruleSeq atomic.Int64

	// geteuid and findIptables are variables for the tests of NeedRoot.
	geteuid      = os.Geteuid
	findIptables = lookIptables

	staleOnce sync.Once
	staleErr  error
)

// lookIptables finds iptables in PATH, or where Debian puts it (a root
// shell's PATH may lack the sbin directories).
func lookIptables() (string, error) {
	if p, err := exec.LookPath("iptables"); err == nil {
		return p, nil
	}
	for _, p := range []string{"/usr/sbin/iptables", "/sbin/iptables"} {
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", errors.New("iptables is not installed")
}

// iptables runs bin with args, waiting for the xtables lock (-w) that
// concurrent test processes take.
func iptables(bin string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin, append([]string{"-w"}, args...)...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("iptables %s: %v: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return string(out), nil
}

// NeedRoot skips t, saying what is NOT TESTED, unless this process may
// drop packets with iptables: it runs as root and iptables is installed
// and works. Under CI=true a root process without a working iptables
// fails t instead: `make deps` installs Debian's iptables as root, so its
// absence there is a broken set-up, not a reason to test less. Once per
// test binary, before the first rule, it removes the rules of test
// processes that are gone (CleanupStale). DropAddr and DropOneWay call
// it; a test calls it first to skip before it starts anything.
func NeedRoot(t testing.TB) {
	t.Helper()
	if geteuid() != 0 {
		t.Skipf("NOT TESTED: %s needs root, to drop packets with iptables (partitions on loopback addresses); run `make test` as root", t.Name())
	}
	if err := usable(); err != nil {
		msg := fmt.Sprintf("%s needs a working iptables, to drop packets (partitions on loopback addresses): %v; `make deps` installs Debian's iptables as root", t.Name(), err)
		if os.Getenv("CI") == "true" {
			t.Fatalf("netfault: %s", msg)
		}
		t.Skipf("NOT TESTED: %s", msg)
	}
	if err := cleanupOnce(); err != nil {
		t.Fatalf("netfault: removing the rules that earlier test runs left: %v", err)
	}
}

// Usable is NeedRoot for a program that is not a test (dlock bench): nil
// when this process may drop packets with iptables, else why not. Like
// NeedRoot, the first call removes the rules of processes that are gone.
func Usable() error {
	if geteuid() != 0 {
		return errors.New("dropping packets with iptables needs root")
	}
	if err := usable(); err != nil {
		return fmt.Errorf("dropping packets needs a working iptables: %w (Debian: apt-get install iptables)", err)
	}
	if err := cleanupOnce(); err != nil {
		return fmt.Errorf("removing the rules that earlier runs left: %w", err)
	}
	return nil
}

// usable checks that iptables is there and works: a root without
// CAP_NET_ADMIN (an unprivileged container) has an iptables that fails.
func usable() error {
	bin, err := findIptables()
	if err == nil {
		_, err = iptables(bin, "-S", chain)
	}
	return err
}

// cleanupOnce removes the stale rules once per process (CleanupStale).
func cleanupOnce() error {
	staleOnce.Do(func() {
		bin, err := findIptables()
		if err != nil {
			staleErr = err
			return
		}
		staleErr = cleanupStale(bin)
	})
	return staleErr
}

// DropAddr drops every packet to and from ip, a loopback address of the
// test's own (127.0.0.2 and up; LoopbackAddr hands one out), until heal
// is called or the test ends. It fails the test for any other address:
// 127.0.0.1, an address outside 127.0.0.0/8, one the system uses. As
// NeedRoot, it skips the test unless root.
//
// Only the traffic of processes that use ip is dropped: a client that
// dials from it (DialerFrom), a server that listens on it.
func DropAddr(t testing.TB, ip string) (heal func()) {
	t.Helper()
	if _, err := ownAddr(ip); err != nil {
		t.Fatalf("netfault: DropAddr(%q): %v", ip, err)
	}
	NeedRoot(t)
	return forTest(t, fmt.Sprintf("the partition of %s", ip), func() (func() error, error) { return Drop(ip) })
}

// DropOneWay drops every packet from src to dst, and none from dst to
// src, until heal is called or the test ends. Both are loopback addresses
// and at least one of them is the test's own (as DropAddr's); the other
// may be 127.0.0.1. A TCP connection from src to dst cannot be opened (its
// SYN is lost); an open one delivers dst's bytes to src, while src's
// bytes, and its acknowledgements, are lost.
func DropOneWay(t testing.TB, src, dst string) (heal func()) {
	t.Helper()
	if _, _, err := oneWay(src, dst); err != nil {
		t.Fatalf("netfault: DropOneWay(%q, %q): %v", src, dst, err)
	}
	NeedRoot(t)
	return forTest(t, fmt.Sprintf("the cut from %s to %s", src, dst), func() (func() error, error) { return DropFromTo(src, dst) })
}

// forTest makes a fault with make, failing t if it cannot, and returns
// what undoes it, which also runs at t's cleanup.
func forTest(t testing.TB, what string, make func() (func() error, error)) (heal func()) {
	t.Helper()
	remove, err := make()
	if err != nil {
		t.Fatalf("netfault: %v", err)
	}
	var once sync.Once
	heal = func() {
		once.Do(func() {
			if err := remove(); err != nil {
				t.Errorf("netfault: undoing %s: %v", what, err)
			}
		})
	}
	t.Cleanup(heal)
	return heal
}

// Drop is DropAddr for a program that is not a test (dlock bench): the
// same rules for the same addresses, in place when it returns, removed by
// heal, which the caller must call (a process killed first leaves them to
// the next CleanupStale: a test binary's first rule, or Usable). Call
// Usable first.
func Drop(ip string) (heal func() error, err error) {
	a, err := ownAddr(ip)
	if err != nil {
		return nil, fmt.Errorf("the partition of %q: %w", ip, err)
	}
	return drop(fmt.Sprintf("the partition of %s", a),
		[]string{"-s", a.String() + "/32"},
		[]string{"-d", a.String() + "/32"})
}

// DropFromTo is DropOneWay for a program that is not a test, as Drop is
// DropAddr's.
func DropFromTo(src, dst string) (heal func() error, err error) {
	s, d, err := oneWay(src, dst)
	if err != nil {
		return nil, fmt.Errorf("the cut from %q to %q: %w", src, dst, err)
	}
	return drop(fmt.Sprintf("the cut from %s to %s", s, d),
		[]string{"-s", s.String() + "/32", "-d", d.String() + "/32"})
}

// oneWay checks the addresses of a one-way cut: both loopback addresses,
// at least one of them the caller's own.
func oneWay(src, dst string) (s, d netip.Addr, err error) {
	s, serr := loopbackAddr(src)
	d, derr := loopbackAddr(dst)
	if err := errors.Join(serr, derr); err != nil {
		return s, d, err
	}
	if _, serr = ownAddr(src); serr != nil {
		if _, derr = ownAddr(dst); derr != nil {
			return s, d, fmt.Errorf("neither is a test's own address: %w", errors.Join(serr, derr))
		}
	}
	return s, d, nil
}

// drop adds one DROP rule for each of matches, tagged, and returns what
// removes them; once removed, heal does nothing.
func drop(what string, matches ...[]string) (heal func() error, err error) {
	bin, err := findIptables()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	var mu sync.Mutex
	var added [][]string
	remove := func() error {
		mu.Lock()
		defer mu.Unlock()
		var errs []error
		for i := len(added) - 1; i >= 0; i-- {
			if _, err := iptables(bin, append([]string{"-D"}, added[i]...)...); err != nil {
				errs = append(errs, err)
			}
		}
		added = nil
		return errors.Join(errs...)
	}
	for _, m := range matches {
		tag := fmt.Sprintf("%s%d-%d", TagPrefix, os.Getpid(), ruleSeq.Add(1))
		spec := append(append([]string{chain}, m...), "-m", "comment", "--comment", tag, "-j", "DROP")
		if _, err := iptables(bin, append([]string{"-I"}, spec...)...); err != nil {
			return nil, fmt.Errorf("%s: %w", what, errors.Join(err, remove()))
		}
		added = append(added, spec)
	}
	return remove, nil
}

// Remaining lists the rules this process added that are still in place,
// as `iptables -S` prints them: none once every fault is undone.
func Remaining() ([]string, error) {
	bin, err := findIptables()
	if err != nil {
		return nil, err
	}
	out, err := iptables(bin, "-S")
	if err != nil {
		return nil, err
	}
	var found []string
	for _, line := range strings.Split(out, "\n") {
		if pid, ok := tagPid(strings.Fields(line)); ok && pid == os.Getpid() {
			found = append(found, line)
		}
	}
	return found, nil
}

// CleanupStale removes the rules this package added for test processes
// that are gone (killed before their cleanup ran: go test's -timeout, a
// SIGKILL), found by their comment's prefix and pid; the rules of live
// test processes stay. Without root or iptables it does nothing. The
// package's TestMain calls it, so `make test` does too; NeedRoot calls it
// once per test binary.
func CleanupStale() error {
	if geteuid() != 0 {
		return nil
	}
	bin, err := findIptables()
	if err != nil {
		return nil
	}
	return cleanupStale(bin)
}

func cleanupStale(bin string) error {
	out, err := iptables(bin, "-S")
	if err != nil {
		return err
	}
	var errs []error
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || f[0] != "-A" {
			continue
		}
		pid, ok := tagPid(f)
		if !ok || alive(pid) {
			continue
		}
		if _, err := iptables(bin, append([]string{"-D"}, f[1:]...)...); err != nil {
			// Another test process may have removed it first.
			if _, cerr := iptables(bin, append([]string{"-C"}, f[1:]...)...); cerr == nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// tagPid is the pid in the comment dlock-test-<pid>-<n> of a rule as
// `iptables -S` prints it.
func tagPid(fields []string) (int, bool) {
	for i := 0; i+1 < len(fields); i++ {
		if fields[i] != "--comment" {
			continue
		}
		rest, ok := strings.CutPrefix(strings.Trim(fields[i+1], `"`), TagPrefix)
		if !ok {
			return 0, false
		}
		p, n, ok := strings.Cut(rest, "-")
		pid, perr := strconv.Atoi(p)
		_, nerr := strconv.Atoi(n)
		return pid, ok && perr == nil && nerr == nil && pid > 0
	}
	return 0, false
}

// alive reports whether process pid exists.
func alive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}
