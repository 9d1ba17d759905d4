package deploy

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
)

var tmpRoot string

func TestMain(m *testing.M) {
	// The same binary is the test hosts' init and their systemctl,
	// journalctl and ssh (hosts_test.go, sysemu_test.go).
	if code, ok := emulated(os.Args); ok {
		os.Exit(code)
	}
	if os.Getenv(hostNameEnv) != "" {
		os.Exit(hostInit())
	}
	var err error
	tmpRoot, err = os.MkdirTemp("", "dlock-deploy-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(tmpRoot)
	os.Exit(code)
}

// binaries builds dlock and dlock-content from the repository once per test
// run, into a directory that TestMain removes.
var binaries = sync.OnceValues(func() (string, error) {
	dir := filepath.Join(tmpRoot, "bin")
	cmd := exec.Command("go", "build", "-o", dir+"/", "./cmd/dlock", "./cmd/dlock-content")
	cmd.Dir = ".."
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build: %v\n%s", err, out)
	}
	return dir, nil
})

func binDir(t *testing.T) string {
	t.Helper()
	dir, err := binaries()
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

// knownEnv is, per binary, the environment variables it reads: one per flag
// (internal/envflag), taken from the real binaries' -h.
type knownEnv map[string]map[string]bool

// flagLine is a flag's line in -h: "  -name" (the flag package's,
// dlock-content) or "      --name", "  -h, --help" (pflag's, dlock).
var flagLine = regexp.MustCompile(`(?m)^\s+(?:-[a-z], )?--?([a-z0-9][a-z0-9-]*)`)

func helpOf(t *testing.T) knownEnv {
	t.Helper()
	dir := binDir(t)
	env := knownEnv{}
	for _, b := range []struct {
		name, prefix string
		args         []string
	}{{"dlock", "DLOCK", []string{"serve", "-h"}}, {"dlock-content", "DLOCK_CONTENT", []string{"-h"}}} {
		out, _ := exec.Command(filepath.Join(dir, b.name), b.args...).CombinedOutput()
		env[b.name] = map[string]bool{}
		for _, m := range flagLine.FindAllStringSubmatch(string(out), -1) {
			env[b.name][envName(b.prefix, m[1])] = true
		}
		if len(env[b.name]) < 5 {
			t.Fatalf("%s %s: found only %d flags in:\n%s", b.name, strings.Join(b.args, " "), len(env[b.name]), out)
		}
	}
	// etcd's own variables, from Debian's etcd (make deps installs it):
	// the StatefulSet of kubernetes/ha is checked against them.
	if _, err := exec.LookPath("etcd"); err != nil {
		if os.Geteuid() == 0 {
			t.Fatal("etcd is not installed: `make deps` installs Debian's etcd-server")
		}
		t.Log("NOTE: etcd is not installed: the etcd StatefulSet's ETCD_ variables are NOT checked; run `make deps` as root")
		return env
	}
	out, _ := exec.Command("etcd", "--help").CombinedOutput()
	env["etcd"] = map[string]bool{}
	for _, m := range etcdFlagLine.FindAllStringSubmatch(string(out), -1) {
		env["etcd"][envName("ETCD", m[1])] = true
	}
	if len(env["etcd"]) < 20 {
		t.Fatalf("etcd --help: found only %d flags in:\n%s", len(env["etcd"]), out)
	}
	return env
}

var etcdFlagLine = regexp.MustCompile(`(?m)^\s+--([a-z0-9-]+)`)

func envName(prefix, flag string) string {
	return prefix + "_" + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
}

// check reports every DLOCK_… variable that the binary does not read: it
// ignores them silently, so a misspelt one is a setting lost.
func (k knownEnv) check(fail func(string, ...any), where, binary string, vars map[string]corev1.EnvVar) {
	for name := range vars {
		if strings.HasPrefix(name, "DLOCK_") && !k[binary][name] {
			fail("%s: %s reads no variable %s", where, binary, name)
		}
	}
}

func envOf(c corev1.Container) map[string]corev1.EnvVar {
	m := map[string]corev1.EnvVar{}
	for _, e := range c.Env {
		m[e.Name] = e
	}
	return m
}

// flagsOf is the value of each flag as the binary sees it: --name=value in
// args wins over PREFIX_NAME in the environment. Only literal values.
func flagsOf(args []string, vars map[string]corev1.EnvVar, prefix string) map[string]string {
	f := map[string]string{}
	for name, v := range vars {
		if rest, ok := strings.CutPrefix(name, prefix+"_"); ok && v.ValueFrom == nil {
			f[strings.ToLower(strings.ReplaceAll(rest, "_", "-"))] = v.Value
		}
	}
	for _, a := range args {
		if name, val, ok := strings.Cut(strings.TrimLeft(a, "-"), "="); ok && strings.HasPrefix(a, "-") {
			f[name] = val
		}
	}
	return f
}

type metav1LabelSelector = metav1.LabelSelector

func metav1Selector(s *metav1.LabelSelector) (labels.Selector, error) {
	return metav1.LabelSelectorAsSelector(s)
}

func kindOf(o runtime.Object) string { return o.GetObjectKind().GroupVersionKind().Kind }

func metaOf(o runtime.Object) metav1.Object {
	m, err := meta.Accessor(o)
	if err != nil {
		panic(err)
	}
	return m
}

func containerPort(c corev1.Container, port string) *corev1.ContainerPort {
	n, err := strconv.Atoi(port)
	if err != nil {
		return nil
	}
	for i, p := range c.Ports {
		if int(p.ContainerPort) == n {
			return &c.Ports[i]
		}
	}
	return nil
}

func portIs(v intstr.IntOrString, p *corev1.ContainerPort) bool {
	if v.Type == intstr.String {
		return v.StrVal != "" && v.StrVal == p.Name
	}
	return v.IntVal == p.ContainerPort
}

func hasPort(spec *corev1.PodSpec, v intstr.IntOrString) bool {
	for _, c := range spec.Containers {
		for i := range c.Ports {
			if portIs(v, &c.Ports[i]) {
				return true
			}
		}
	}
	return false
}

// volumeAt is the volume mounted at the longest mount path holding p.
func volumeAt(spec *corev1.PodSpec, c corev1.Container, p string) *corev1.Volume {
	best := ""
	var name string
	for _, m := range c.VolumeMounts {
		rel, err := filepath.Rel(m.MountPath, p)
		if p == "" || err != nil || strings.HasPrefix(rel, "..") || len(m.MountPath) <= len(best) {
			continue
		}
		best, name = m.MountPath, m.Name
	}
	for i, v := range spec.Volumes {
		if name != "" && v.Name == name {
			return &spec.Volumes[i]
		}
	}
	return nil
}
