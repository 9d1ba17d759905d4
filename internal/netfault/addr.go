package netfault

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"testing"
)

// loopback is 127.0.0.0/8: Linux's lo answers on every address in it
// without any configuration (the kernel's local route covers the /8).
var loopback = netip.MustParsePrefix("127.0.0.0/8")

// wellKnown are loopback addresses other than 127.0.0.1 that some
// systems use, which a test must not cut off: systemd-resolved's stub
// resolvers, Debian's address of the host's own name, Docker's
// embedded DNS server.
var wellKnown = []string{"127.0.0.53", "127.0.0.54", "127.0.1.1", "127.0.0.11"}

// ownAddr checks that ip is a loopback address a test may cut off:
// IPv4, in 127.0.0.0/8, not 127.0.0.1, not the network's first or last
// address, not an address the system uses (wellKnown, and the loopback
// addresses of /etc/hosts and /etc/resolv.conf).
func ownAddr(ip string) (netip.Addr, error) {
	a, err := loopbackAddr(ip)
	if err != nil {
		return a, err
	}
	if a == netip.AddrFrom4([4]byte{127, 0, 0, 1}) {
		return a, fmt.Errorf("%s is everyone's loopback address: a test cuts off an address of its own (127.0.0.2 and up; LoopbackAddr hands one out)", a)
	}
	if used, where := systemAddr(a); used {
		return a, fmt.Errorf("%s is used by the system (%s): a test cuts off an address of its own (LoopbackAddr hands one out)", a, where)
	}
	return a, nil
}

// loopbackAddr parses ip, an IPv4 address in 127.0.0.0/8 that is neither
// the network's first nor its last.
func loopbackAddr(ip string) (netip.Addr, error) {
	a, err := netip.ParseAddr(ip)
	if err != nil {
		return a, err
	}
	a = a.Unmap()
	if !a.Is4() || !loopback.Contains(a) {
		return a, fmt.Errorf("%s is not in 127.0.0.0/8: netfault cuts off loopback addresses only", ip)
	}
	if b := a.As4(); b == [4]byte{127, 0, 0, 0} || b == [4]byte{127, 255, 255, 255} {
		return a, fmt.Errorf("%s is 127.0.0.0/8's network or broadcast address", a)
	}
	return a, nil
}

// systemAddr reports whether a is a loopback address the system uses, and
// where it found it.
func systemAddr(a netip.Addr) (bool, string) {
	for _, w := range wellKnown {
		if a.String() == w {
			return true, "a well-known loopback service address"
		}
	}
	for _, f := range []struct {
		path string
		word func(fields []string) []string
	}{
		{"/etc/hosts", func(f []string) []string { return f[:1] }},
		{"/etc/resolv.conf", func(f []string) []string {
			if f[0] == "nameserver" && len(f) > 1 {
				return f[1:2]
			}
			return nil
		}},
	} {
		file, err := os.Open(f.path)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(file)
		for sc.Scan() {
			line, _, _ := strings.Cut(sc.Text(), "#")
			fields := strings.Fields(line)
			if len(fields) == 0 {
				continue
			}
			for _, w := range f.word(fields) {
				if b, err := netip.ParseAddr(w); err == nil && b.Unmap() == a {
					file.Close()
					return true, f.path
				}
			}
		}
		file.Close()
	}
	return false, ""
}

// The addresses LoopbackAddr hands out are in 127.77.0.0/16, far from
// the low addresses that systems use (wellKnown).
const addrCount = 1 << 16

var (
	addrMu   sync.Mutex
	addrNext = os.Getpid() % 256 * 256 // processes start apart
)

// LoopbackAddr returns a loopback address (in 127.77.0.0/16) that no other
// test of any test process on this machine holds, until t's cleanup: a
// test cuts it off (DropAddr) without cutting off another's. An address is
// held by binding an abstract unix socket named after it, which the kernel
// frees when the process ends, killed or not.
func LoopbackAddr(t testing.TB) string {
	t.Helper()
	a, release, err := ReserveAddr()
	if err != nil {
		t.Fatalf("netfault: %v", err)
	}
	t.Cleanup(release)
	return a
}

// ReserveAddr is LoopbackAddr for a program that is not a test (dlock
// bench): the address is held until release, or until the process ends.
func ReserveAddr() (addr string, release func(), err error) {
	addrMu.Lock()
	defer addrMu.Unlock()
	for range addrCount {
		i := addrNext
		addrNext = (addrNext + 1) % addrCount
		if i%256 == 0 || i%256 == 255 {
			continue
		}
		a := netip.AddrFrom4([4]byte{127, 77, byte(i >> 8), byte(i)})
		if _, err := ownAddr(a.String()); err != nil {
			continue
		}
		claim, err := net.Listen("unix", "@dlock-netfault-"+a.String())
		if err != nil {
			continue // another process holds it
		}
		return a.String(), func() { claim.Close() }, nil
	}
	return "", nil, errors.New("no free loopback address in 127.77.0.0/16")
}

// DialerFrom returns a dialer whose connections leave from ip (any port):
// a client that dials with it is cut off by DropAddr(t, ip). It panics if
// ip is not an IP address.
func DialerFrom(ip string) *net.Dialer {
	a := net.ParseIP(ip)
	if a == nil {
		panic(fmt.Sprintf("netfault: DialerFrom(%q): not an IP address", ip))
	}
	return &net.Dialer{LocalAddr: &net.TCPAddr{IP: a}}
}
