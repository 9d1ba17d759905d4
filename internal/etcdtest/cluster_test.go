package etcdtest

import (
	"context"
	"net"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
)

// TestCluster: dlock's client (etcd client v3.7) against a cluster of
// Debian's etcd (3.4 here): transactions, leases and watches; one member of
// three killed, writes go on; restarted, it rejoins.
func TestCluster(t *testing.T) {
	start := time.Now()
	c := StartCluster(t, 3)
	out, _ := exec.Command(EtcdBinary(t), "--version").Output()
	version, _, _ := strings.Cut(string(out), "\n")
	t.Logf("3-member cluster of %s ready in %v at %v", version, time.Since(start), c.Endpoints())
	cl := c.Client(t)
	exercise(t, cl, Prefix(t))

	p := Prefix(t)
	put := func(what string) {
		t.Helper()
		// A request in flight to the killed member fails; the client's
		// next try goes to another.
		deadline := time.Now().Add(10 * time.Second)
		for {
			ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
			_, err := cl.Put(ctx, p+what, what)
			cancel()
			if err == nil {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("put %s: %v", what, err)
			}
			t.Logf("put %s: %v (trying again)", what, err)
			time.Sleep(100 * time.Millisecond)
		}
	}
	c.Kill(1)
	if c.Running(1) {
		t.Fatal("member 1 runs after Kill")
	}
	put("with-two")
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
	if err := c.Healthy(ctx); err == nil {
		t.Error("healthy with a member killed")
	}
	cancel()

	start = time.Now()
	c.Restart(1)
	t.Logf("member 1 rejoined in %v", time.Since(start))
	c.WaitHealthy(t)
	put("with-three")
	// The restarted member has what was written while it was down.
	r, err := c.ClientOf(t, c.Endpoints()[1]).Get(t.Context(), p+"with-two")
	if err != nil || len(r.Kvs) != 1 {
		t.Fatalf("member 1's read of the write made while it was down: %+v %v", r, err)
	}
	c.Stop()
	c.Stop() // idempotent
	for i := range 3 {
		if c.Running(i) {
			t.Errorf("member %d runs after Stop", i)
		}
	}
}

// TestNoEtcdBinary: without etcd, a test fails in CI and skips elsewhere,
// saying NOT TESTED; either way it names `make deps`.
func TestNoEtcdBinary(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	old := debianEtcd
	debianEtcd = filepath.Join(t.TempDir(), "etcd")
	defer func() { debianEtcd = old }()
	for _, ci := range []string{"true", ""} {
		t.Setenv("CI", ci)
		o := kit.Catch(t, func(tb testing.TB) {
			EtcdBinary(tb)
			t.Errorf("CI=%q: EtcdBinary returned", ci)
		})
		switch {
		case ci == "true" && (o.FatalMsg == "" || o.SkipMsg != ""):
			t.Errorf("CI=true: failed %q, skipped %q; want a failure", o.FatalMsg, o.SkipMsg)
		case ci != "true" && (o.SkipMsg == "" || o.FatalMsg != "" || !strings.HasPrefix(o.SkipMsg, "NOT TESTED: ")):
			t.Errorf("CI unset: failed %q, skipped %q; want a skip saying NOT TESTED", o.FatalMsg, o.SkipMsg)
		}
		if msg := o.FatalMsg + o.SkipMsg; !strings.Contains(msg, "make deps") {
			t.Errorf("CI=%q: %q does not name `make deps`", ci, msg)
		}
	}
}

// TestClusterPortTaken: a start that finds a port taken between picking
// and binding starts again on new ports.
func TestClusterPortTaken(t *testing.T) {
	EtcdBinary(t)
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	calls := 0
	pickAddrs = func(n int) ([]string, error) {
		calls++
		addrs, err := freeAddrs(n)
		if calls == 1 && err == nil {
			addrs[0] = taken.Addr().String() // member 0's client port
		}
		return addrs, err
	}
	defer func() { pickAddrs = freeAddrs }()
	c := StartCluster(t, 1)
	if calls != 2 {
		t.Fatalf("%d starts, want 2", calls)
	}
	if c.Endpoints()[0] == "http://"+taken.Addr().String() {
		t.Fatal("the cluster has the taken port")
	}
}
