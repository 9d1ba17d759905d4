package etcd_test

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/internal/etcdtest"
	"github.com/dlock/dlock/lock/etcd"
)

func TestBefore35(t *testing.T) {
	for v, want := range map[string]bool{
		"3.4.23": true, "3.4.0": true, "3.3.27": true, "2.3.8": true,
		"3.5.0": false, "3.6.16": false, "3.7.3": false, "3.10.1": false, "4.0.0": false,
		"": false, "3": false, "x.y.z": false, "3.x": false, "3.4-rc.1": false,
	} {
		if got := etcd.Before35ForTest(v); got != want {
			t.Errorf("before35(%q) = %v, want %v", v, got, want)
		}
	}
}

// warnings is a slog handler that keeps the messages of warnings.
type warnings struct {
	mu   sync.Mutex
	msgs []string
}

func (w *warnings) Enabled(context.Context, slog.Level) bool { return true }
func (w *warnings) Handle(_ context.Context, r slog.Record) error {
	if r.Level >= slog.LevelWarn {
		w.mu.Lock()
		w.msgs = append(w.msgs, r.Message)
		w.mu.Unlock()
	}
	return nil
}
func (w *warnings) WithAttrs([]slog.Attr) slog.Handler { return w }
func (w *warnings) WithGroup(string) slog.Handler      { return w }

func (w *warnings) versionWarned() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, m := range w.msgs {
		if strings.Contains(m, "version before 3.5") {
			return true
		}
	}
	return false
}

// TestVersionWarning opens a backend on the embedded etcd (go.mod's, 3.5 or
// later: no warning) and on the etcd binary the cluster tests run
// (Debian's 3.4 in make test: a warning), and checks the warning against
// the version the member reports.
func TestVersionWarning(t *testing.T) {
	for _, c := range []struct {
		name string
		cli  func(t *testing.T) (version string, b *etcd.Backend, w *warnings)
	}{
		{"embedded", func(t *testing.T) (string, *etcd.Backend, *warnings) {
			return openWarned(t, etcdtest.Shared(t).Client(t))
		}},
		{"binary", func(t *testing.T) (string, *etcd.Backend, *warnings) {
			return openWarned(t, etcdtest.StartCluster(t, 1).Client(t))
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			version, b, w := c.cli(t)
			select {
			case <-etcd.VersionsCheckedForTest(b):
			case <-time.After(time.Minute): // bounds a broken check only
				t.Fatal("the version check did not end within a minute")
			}
			if err := b.Close(); err != nil {
				t.Fatal(err)
			}
			want := etcd.Before35ForTest(version)
			if got := w.versionWarned(); got != want {
				t.Fatalf("etcd %s: warned %v, want %v (warnings: %q)", version, got, want, w.msgs)
			}
			t.Logf("etcd %s: warned %v", version, want)
		})
	}
}

// openWarned opens a backend on a fresh data set of cli's etcd, with its
// warnings kept, and reads the version of the member cli reaches first.
func openWarned(t *testing.T, cli *clientv3.Client) (string, *etcd.Backend, *warnings) {
	t.Helper()
	st, err := cli.Status(t.Context(), cli.Endpoints()[0])
	if err != nil {
		t.Fatal(err)
	}
	w := &warnings{}
	cfg := etcd.DefaultConfig()
	cfg.Logger = slog.New(w)
	b := newBackend(t, cli, etcdtest.Prefix(t), cfg)
	return st.Version, b, w
}
