package deploy

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	srvconfig "github.com/containerd/containerd/v2/cmd/containerd/server/config"
	"github.com/pelletier/go-toml/v2"
)

// The drop-in the DaemonSet's ConfigMap carries, and the socket it must name
// (the DaemonSet's hostPath; the systemd unit's RuntimeDirectory).
const (
	dropInFile = "kubernetes/content/containerd-dlock.toml"
	pluginSock = "/run/dlock-content/content.sock"
)

// importDropIn writes a main containerd config of the given version that
// imports conf.d/*.toml, as deploy/README.md tells, and the drop-in there.
func importDropIn(t *testing.T, version string) string {
	t.Helper()
	b, err := os.ReadFile(dropInFile)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "conf.d"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "conf.d", "dlock.toml"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	main := filepath.Join(dir, "config.toml")
	cfg := "version = " + version + "\nimports = [\"" + filepath.Join(dir, "conf.d") + "/*.toml\"]\n"
	if err := os.WriteFile(main, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	return main
}

// TestDropInContainerd2 loads the drop-in through containerd 2.x's own
// config loader, imported by a version 3 main config (2.x's default).
func TestDropInContainerd2(t *testing.T) {
	var c srvconfig.Config
	if err := srvconfig.LoadConfig(context.Background(), importDropIn(t, "3"), &c); err != nil {
		t.Fatal(err)
	}
	if err := checkContentProxy(&c, pluginSock); err != nil {
		t.Fatal(err)
	}
}

// TestDropInContainerd16 has the real containerd (Debian's 1.6, which
// `make deps` installs) merge the drop-in into a version 2 main config and
// print the result.
func TestDropInContainerd16(t *testing.T) {
	if _, err := exec.LookPath("containerd"); err != nil {
		if os.Geteuid() == 0 {
			t.Fatal("containerd is not installed: `make deps` installs it")
		}
		t.Skip("SKIPPED: containerd is not installed and we are not root: run `make deps` as root")
	}
	out, err := exec.Command("containerd", "--config", importDropIn(t, "2"), "config", "dump").Output()
	if err != nil {
		t.Fatalf("containerd config dump: %v", err)
	}
	var c srvconfig.Config
	if err := toml.Unmarshal(out, &c); err != nil {
		t.Fatalf("containerd config dump: %v\n%s", err, out)
	}
	if err := checkContentProxy(&c, pluginSock); err != nil {
		t.Fatalf("%v\ncontainerd config dump:\n%s", err, out)
	}
}
