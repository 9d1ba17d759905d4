package bench

import (
	"context"
	"crypto/tls"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest"
	"github.com/dlock/dlock/internal/rawhttp"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The scenarios run, briefly, against a real server and produce numbers.
func TestScenarios(t *testing.T) {
	srv := dlocktest.Start(t, dlocktest.Options{})
	ctx := context.Background()
	opts := Options{Duration: 300 * time.Millisecond, Concurrency: 4, Waiters: 50}
	for name, f := range map[string]func(context.Context, string, Options) (Result, error){
		"pairs": Pairs, "handoff": Handoff, "fanout": Fanout, "sessions": Sessions,
	} {
		r, err := f(ctx, srv.URL(), opts)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if r.Ops == 0 || r.Rate <= 0 || r.P50 <= 0 || r.Max < r.P99 || r.P99 < r.P50 {
			t.Fatalf("%s: implausible result %+v", name, r)
		}
	}
	if st := srv.Memory.Stats(); st.Queued != 0 {
		t.Fatalf("scenarios left %d waiters queued", st.Queued)
	}
}

func TestMemory(t *testing.T) {
	srv := dlocktest.Start(t, dlocktest.Options{})
	r, err := HeldLocks(context.Background(), srv.URL(), Options{}.Dialer, 500, 4)
	if err != nil || r.RSSMiB <= 0 || srv.Memory.Stats().Held != 500 {
		t.Fatalf("held locks: %+v %v (held %d)", r, err, srv.Memory.Stats().Held)
	}
	r, err = OpenSessions(context.Background(), srv.URL(), Options{}.Dialer, 50)
	if err != nil || r.RSSMiB <= 0 {
		t.Fatalf("open sessions: %+v %v", r, err)
	}
	// The server's CPU was read (its /metrics, in steps of 10 ms, may
	// say none was used by 50 streams), and this process's counted.
	if strings.Contains(r.Note, "server CPU unknown") || r.ServerCPUPerOp < 0 || r.BenchCPUPerOp <= 0 {
		t.Fatalf("open sessions' CPU: %+v", r)
	}
}

// TestOpenSessionsCredentials: the sessions are opened with the dialer's
// token, by the load generator's own opener over plain HTTP and through
// crypto/tls over HTTPS; every one reaches the server.
func TestOpenSessionsCredentials(t *testing.T) {
	tokens := map[string]string{"0p3rat0r-0p3rat0r-0p3rat0r": "*"}
	pki := dlocktest.NewPKI(t)
	for _, c := range []struct {
		name string
		auth *dlocktest.Auth
		d    rawhttp.Dialer
	}{
		{"http", &dlocktest.Auth{Tokens: tokens}, rawhttp.Dialer{Token: "0p3rat0r-0p3rat0r-0p3rat0r"}},
		{"https", &dlocktest.Auth{Tokens: tokens, PKI: pki}, rawhttp.Dialer{Token: "0p3rat0r-0p3rat0r-0p3rat0r", TLS: &tls.Config{RootCAs: pki.Pool}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			srv := dlocktest.Start(t, dlocktest.Options{Auth: c.auth})
			r, err := OpenSessions(context.Background(), srv.URL(), c.d, 40)
			if err != nil || r.Ops != 40 {
				t.Fatalf("open sessions: %+v %v", r, err)
			}
			if c.d.TLS != nil {
				return
			}
			// The opener's own requests carry the token: without it, 401.
			if _, err := (rawhttp.Dialer{}).OpenIdle(context.Background(), srv.URL(), 1, 1, func(int) string { return "x" }); err == nil || !strings.Contains(err.Error(), "401") {
				t.Fatalf("a stream opened without the token: %v, want 401", err)
			}
		})
	}
}

// TestCompare runs the Redis and etcd sides of --compare. `make test`
// installs redis-server and etcd-server when run as root.
func TestCompare(t *testing.T) {
	for _, bin := range []string{"redis-server", "etcd"} {
		if _, err := exec.LookPath(bin); err != nil {
			if os.Geteuid() != 0 {
				t.Skipf("SKIPPED LOUDLY: %s is not installed and installing it needs root; run `make test` as root", bin)
			}
			t.Fatalf("%s is not installed: `make test` installs it", bin)
		}
	}
	ctx := context.Background()
	// etcd sessions take a while to set up, more so under the race detector.
	opts := Options{Duration: 2 * time.Second, Concurrency: 4}
	addr, stop, err := StartRedis()
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	ep, stopEtcd, err := StartEtcd("")
	if err != nil {
		t.Fatal(err)
	}
	defer stopEtcd()
	// Each server's CPU as dlock bench reads it: Redis's INFO cpu, etcd's
	// /metrics.
	ropts, eopts := opts, opts
	ropts.ServerCPU = RedisCPU(addr)
	eopts.ServerCPU = MetricsCPU(ep, Options{}.Dialer)
	for name, run := range map[string]func() (Result, error){
		"redis pairs":   func() (Result, error) { return RedisPairs(ctx, addr, ropts) },
		"redis handoff": func() (Result, error) { return RedisHandoff(ctx, addr, ropts) },
		"etcd pairs":    func() (Result, error) { return EtcdPairs(ctx, ep, eopts) },
		"etcd handoff":  func() (Result, error) { return EtcdHandoff(ctx, ep, eopts) },
	} {
		r, err := run()
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if r.Ops == 0 {
			t.Fatalf("%s: no operations", name)
		}
		if r.ServerCPUPerOp <= 0 {
			t.Fatalf("%s: no server CPU read: %+v", name, r)
		}
	}
}
