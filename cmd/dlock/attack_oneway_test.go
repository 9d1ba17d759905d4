package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/netfault"
	"github.com/dlock/dlock/lock"
)

// startMemoryServe runs one `dlock serve` (memory backend) process on
// 127.0.0.1 with args added: the real listener, with TCP_USER_TIMEOUT and
// keepalives (server.Listen), which an in-process test server lacks.
func startMemoryServe(t *testing.T, args ...string) *haServer {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	s := &haServer{t: t, name: "dlock-memory", addr: addr, logPath: filepath.Join(t.TempDir(), "dlock.log"),
		args: append([]string{dlockBinary(t), "serve", "--listen", addr, "--data-dir", t.TempDir(), "--log-level", "debug"}, args...)}
	t.Cleanup(s.Kill)
	s.start()
	s.waitUp(&http.Client{Timeout: 5 * time.Second})
	return s
}

// clientFrom is a client of node whose connections all leave from ip, so
// that netfault's rules on ip cut it alone.
func clientFrom(ip, node string, servers []string) *client.Client {
	d := netfault.DialerFrom(ip)
	tr := func() *http.Client {
		return &http.Client{Transport: &http.Transport{DialContext: d.DialContext, MaxIdleConnsPerHost: 16}}
	}
	return &client.Client{Servers: servers, Node: node, ShortClient: tr(), LongClient: tr()}
}

// TestAttackOneWayCut: a holder is cut off one way only, by iptables on
// loopback (netfault.DropOneWay; root), while a waiter on 127.0.0.1 waits.
//
//   - holder→server dropped: the server's pings reach the holder (its
//     stream is not silent), but its confirmations, and its TCP
//     acknowledgements, never arrive;
//   - server→holder dropped: the holder's requests arrive and are handled,
//     their answers and the pings never come back.
//
// On the memory engine (one `dlock serve`) and on etcd (one `dlock serve
// --backend etcd` on 3 members), with a session lease and with a ttl lease.
// The holder's Lost must close at least half its margin before the waiter
// is granted, and the key must move on within grace (or ttl) + ping +
// dead-peer and a little.
func TestAttackOneWayCut(t *testing.T) {
	netfault.NeedRoot(t)
	const grace, ttl = 2 * time.Second, 3 * time.Second
	args := []string{"--session-grace", grace.String(), "--lock-ttl", ttl.String(), "--ping-interval", "1s", "--dead-peer-timeout", "3s"}
	backends := []struct {
		name  string
		start func(t *testing.T) []string
	}{
		{"memory", func(t *testing.T) []string { return []string{startMemoryServe(t, args...).URL()} }},
		{"etcd", func(t *testing.T) []string { return startHA(t, 1, args...).URLs() }},
	}
	for _, be := range backends {
		for _, lease := range []lock.Lease{lock.LeaseSession, lock.LeaseTTL} {
			for _, dir := range []string{"holder→server", "server→holder"} {
				t.Run(fmt.Sprintf("%s/%s/%s", be.name, lease, dir), func(t *testing.T) {
					oneWayCut(t, be.start(t), lease, dir == "holder→server")
				})
			}
		}
	}
}

func oneWayCut(t *testing.T, servers []string, lease lock.Lease, up bool) {
	ip := netfault.LoopbackAddr(t)
	key := client.Request{Type: lock.Pull, Resource: "sha256:oneway", Lease: lease}
	a := clientFrom(ip, "holder", servers)
	a.MaxRetries = -1 // one attempt each: the cut is what is tested
	b := &client.Client{Servers: servers, Node: "waiter"}
	defer a.Close()
	defer b.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*kit.Patience)
	defer cancel()
	if err := a.Connect(ctx); err != nil {
		t.Fatal(err)
	}
	ra, err := a.Lock(ctx, key)
	if err != nil || !ra.Acquired {
		t.Fatalf("holder: %+v %v", ra, err)
	}
	lost := lostAt(ra.Lost)
	granted := lockLater(ctx, b, key)
	awaitQueued(t, "holder", func() (api.StatusResponse, error) { return b.Status(ctx, lock.Pull, key.Resource) })
	if up {
		netfault.DropOneWay(t, ip, "127.0.0.1")
	} else {
		netfault.DropOneWay(t, "127.0.0.1", ip)
	}
	cut := time.Now()
	var g grant
	select {
	case g = <-granted:
	case <-time.After(kit.Patience):
		select {
		case at := <-lost:
			t.Fatalf("the holder took its hold as lost %v after the cut, and the key never moved on (%v)", at.Sub(cut), kit.Patience)
		default:
			t.Fatalf("neither moved in %v: the holder believes it holds, the waiter waits", kit.Patience)
		}
	}
	if g.err != nil || !g.r.Acquired {
		t.Fatalf("waiter: %+v %v", g.r, g.err)
	}
	stoppedFirst(t, "cut", cut, g, lost, ra.Margin)
	// grace or ttl + ping + dead-peer, and 2 s for the rest (etcd's
	// lease expiry runs every 500 ms; the hand-over's transactions).
	bound := 2*time.Second + time.Second + 3*time.Second + 2*time.Second
	if lease == lock.LeaseTTL {
		bound = 3*time.Second + time.Second + 2*time.Second
	}
	if d := g.at.Sub(cut); d > bound {
		t.Errorf("the key moved on %v after the cut, want within %v", d, bound)
	}
	b.Unlock(ctx, key, nil)
}
