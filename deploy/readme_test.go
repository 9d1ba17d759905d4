package deploy

import (
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

// The sections of deploy/README.md whose commands TestREADME runs, with
// the test hosts each needs, and what their output must show besides
// every command succeeding (sh -e).
var readmeWalks = []struct {
	section   string
	hosts     []string
	want      []string
	sameEpoch bool                                       // every epoch shown is one: the servers are one lock service
	check     func(t *testing.T, hosts map[string]*host) // more, once the commands ran
}{
	{
		section: "systemd: one server",
		hosts:   []string{"dlock1", "node-1"},
		want: []string{
			`"status":"ok"`,
			"tls=true", "token_file=/run/credentials/dlock.service/tokens",
			`address = "/run/dlock-content/content.sock"`,
			`disabled_plugins = ["io.containerd.content.v1.content"]`,
			"socket=/run/dlock-content/content.sock",
			"1 node(s) node-1",
		},
	},
	{
		section: "systemd: three servers on etcd",
		hosts:   []string{"dlock1", "dlock2", "dlock3"},
		want: []string{
			`{"health":"true"}`,
			"pulled by node-1",
			"last succeeded by node-1",
			"pulled by node-2",
			"backend=etcd",
		},
		sameEpoch: true,
	},
	{
		section: "Kubernetes",
		hosts:   []string{"workstation"},
		check:   checkKubernetesCredentials,
	},
}

// Blocks TestREADME cannot run, by their first word, and what checks them
// instead. Every other sh block of deploy/README.md is in a walk above.
var readmeNotRun = map[string]string{
	"kubectl": "there is no Kubernetes cluster here: the manifests are checked by TestKustomizations and TestNetworkPolicyFlows, the Secrets these commands make by TestREADMESecrets",
}

// readmeRunElsewhere are the sections whose blocks other tests run.
var readmeRunElsewhere = map[string]string{
	"The image": "TestImageBuild and TestImageContainerd (image_test.go) run its four blocks, as written",
}

func notRun(b readmeBlock) bool {
	if _, ok := readmeRunElsewhere[b.section]; ok {
		return true
	}
	first, _, _ := strings.Cut(strings.TrimSpace(b.text), " ")
	_, ok := readmeNotRun[first]
	return b.on == "" && ok
}

type readmeBlock struct {
	section string
	on      string // "every host" or a host name
	text    string
}

var (
	epochShown = regexp.MustCompile(`"epoch":"([0-9a-f]+)"`)
	fence      = regexp.MustCompile("(?ms)^```sh\\n(.*?)^```$")
	onLine     = regexp.MustCompile(`^# on (every host|your workstation|[a-z0-9-]+)\n`)
)

// readmeBlocks are the sh blocks of deploy/README.md, by section.
func readmeBlocks(t *testing.T) []readmeBlock {
	t.Helper()
	b, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	var out []readmeBlock
	parts := regexp.MustCompile(`(?m)^## `).Split(string(b), -1)
	for _, p := range parts[1:] {
		title, _, _ := strings.Cut(p, "\n")
		for _, m := range fence.FindAllStringSubmatch(p, -1) {
			blk := readmeBlock{section: title, text: m[1]}
			if on := onLine.FindStringSubmatch(m[1]); on != nil {
				blk.on = strings.TrimPrefix(on[1], "your ")
			}
			out = append(out, blk)
		}
	}
	return out
}

// TestREADMEBlocksAreRun: every sh block of deploy/README.md is either in
// a walk TestREADME runs, naming where it runs, or in a section that says
// why it is not.
func TestREADMEBlocksAreRun(t *testing.T) {
	for _, b := range readmeBlocks(t) {
		if notRun(b) {
			continue
		}
		found := false
		for _, w := range readmeWalks {
			if w.section != b.section {
				continue
			}
			found = true
			if b.on != "every host" && !slices.Contains(w.hosts, b.on) {
				t.Errorf("%s: a block does not start with `# on HOST` (every host or one of %v), nor with a command of %v:\n%s", b.section, w.hosts, slices.Collect(maps.Keys(readmeNotRun)), b.text)
			}
		}
		if !found {
			t.Errorf("section %q: its sh blocks are run by no test (add it to readmeWalks):\n%s", b.section, b.text)
		}
	}
}

// TestREADME runs the commands of deploy/README.md's systemd walks, as
// written, on test hosts (hosts_test.go): the one server and its node, then
// three etcd members and three servers. The one change: the example
// addresses 10.0.0.N are 127.0.0.N here.
func TestREADME(t *testing.T) {
	requireHosts(t)
	if _, err := os.Stat("/usr/bin/etcd"); err != nil {
		// apt-get install would then install it into this machine's
		// /usr, which the hosts share.
		t.Fatal("Debian's etcd-server is not installed: `make deps` installs it")
	}
	blocks := readmeBlocks(t)
	for _, w := range readmeWalks {
		t.Run(w.section, func(t *testing.T) {
			hosts := map[string]*host{}
			for _, n := range w.hosts {
				hosts[n] = newHost(t, n)
			}
			var out strings.Builder
			n := 0
			for _, b := range blocks {
				if b.section != w.section || notRun(b) {
					continue
				}
				n++
				script := strings.ReplaceAll(b.text, "10.0.0.", "127.0.0.")
				on := []string{b.on}
				if b.on == "every host" {
					on = w.hosts
				}
				for _, name := range on {
					o := hosts[name].mustSh(t, script)
					fmt.Fprintf(&out, "--- block %d on %s:\n%s", n, name, o)
				}
			}
			if n == 0 {
				t.Fatalf("deploy/README.md has no section %q with sh blocks", w.section)
			}
			for _, s := range w.want {
				if !strings.Contains(out.String(), s) {
					t.Errorf("the commands' output does not show %q", s)
				}
			}
			if w.check != nil {
				w.check(t, hosts)
			}
			if w.sameEpoch {
				epochs := map[string]bool{}
				for _, m := range epochShown.FindAllStringSubmatch(out.String(), -1) {
					epochs[m[1]] = true
				}
				if len(epochs) != 1 {
					t.Errorf("the servers answered with %d epochs, want one: %v", len(epochs), epochs)
				}
			}
			if t.Failed() || testing.Verbose() {
				t.Logf("output:\n%s", out.String())
			}
		})
	}
}

// secretCommands are the `kubectl create secret generic` commands of
// deploy/README.md: Secret → key → the file it is made from.
func secretCommands(t *testing.T) map[string]map[string]string {
	t.Helper()
	out := map[string]map[string]string{}
	for _, b := range readmeBlocks(t) {
		text := strings.ReplaceAll(b.text, "\\\n", " ")
		for line := range strings.Lines(text) {
			f := strings.Fields(line)
			i := slices.Index(f, "generic")
			if len(f) == 0 || f[0] != "kubectl" || !slices.Contains(f, "secret") || i < 0 || i+1 >= len(f) {
				continue
			}
			keys := map[string]string{}
			for _, a := range f[i+2:] {
				if kv, ok := strings.CutPrefix(a, "--from-file="); ok {
					k, p, _ := strings.Cut(kv, "=")
					keys[k] = p
				}
			}
			out[f[i+1]] = keys
		}
	}
	if len(out) == 0 {
		t.Fatal("deploy/README.md has no `kubectl create secret generic` command")
	}
	return out
}

// TestREADMESecrets: the Secrets deploy/README.md tells to create are
// exactly those the layouts mount, each with the keys whose files the pods
// read.
func TestREADMESecrets(t *testing.T) {
	made := secretCommands(t)
	used := map[string]bool{}
	for _, dir := range []string{"kubernetes", "kubernetes/ha"} {
		objs, err := build(filesys.MakeFsOnDisk(), dir)
		if err != nil {
			t.Fatal(err)
		}
		var specs []*corev1.PodSpec
		for _, d := range of[*appsv1.Deployment](objs) {
			specs = append(specs, &d.Spec.Template.Spec)
		}
		for _, s := range of[*appsv1.StatefulSet](objs) {
			specs = append(specs, &s.Spec.Template.Spec)
		}
		for _, spec := range specs {
			for _, v := range spec.Volumes {
				if v.Secret != nil {
					used[v.Secret.SecretName] = true
					if made[v.Secret.SecretName] == nil {
						t.Errorf("%s: the Secret %s is mounted, and deploy/README.md does not make it", dir, v.Secret.SecretName)
					}
				}
			}
			for _, c := range spec.Containers {
				for secret, keys := range secretKeys(spec, c, envOf(c)) {
					for _, k := range keys {
						if _, ok := made[secret][k]; !ok {
							t.Errorf("%s: container %s reads the key %s of the Secret %s, which deploy/README.md does not make", dir, c.Name, k, secret)
						}
					}
				}
			}
		}
	}
	for s := range made {
		if !used[s] {
			t.Errorf("deploy/README.md makes the Secret %s, which no layout mounts", s)
		}
	}
}

// checkKubernetesCredentials: after the workstation's block, the files the
// README's Secrets are made from exist, and the certificates name what the
// manifests connect to: the dlock Service for dlock-content and the
// members for the servers and each other (kubernetes/ha), each chained to
// its CA and for its use.
func checkKubernetesCredentials(t *testing.T, hosts map[string]*host) {
	ws := hosts["workstation"]
	read := func(p string) []byte {
		b, err := os.ReadFile(filepath.Join(ws.dir, "fs", strings.TrimPrefix(p, "/")))
		if err != nil {
			t.Fatalf("the workstation's block did not make %s: %v", p, err)
		}
		return b
	}
	for secret, keys := range secretCommands(t) {
		for k, p := range keys {
			if len(read(p)) == 0 {
				t.Errorf("Secret %s, key %s: %s is empty", secret, k, p)
			}
		}
	}
	cert := func(p string) *x509.Certificate {
		blk, _ := pem.Decode(read(p))
		if blk == nil {
			t.Fatalf("%s: no PEM block", p)
		}
		c, err := x509.ParseCertificate(blk.Bytes)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		return c
	}
	pool := func(p string) *x509.CertPool {
		cp := x509.NewCertPool()
		cp.AddCert(cert(p))
		return cp
	}
	dlockCA, etcdCA := pool("/root/dlock-pki/dlock/ca.crt"), pool("/root/dlock-pki/etcd/ca.crt")
	for _, v := range []struct {
		file  string
		roots *x509.CertPool
		name  string
		usage x509.ExtKeyUsage
	}{
		{"/root/dlock-pki/dlock/server.crt", dlockCA, "dlock", x509.ExtKeyUsageServerAuth},
		{"/root/dlock-pki/dlock/server.crt", dlockCA, "dlock.dlock.svc", x509.ExtKeyUsageServerAuth},
		{"/root/dlock-pki/etcd/server.crt", etcdCA, "etcd-0.etcd", x509.ExtKeyUsageServerAuth},
		{"/root/dlock-pki/etcd/server.crt", etcdCA, "etcd-2.etcd", x509.ExtKeyUsageServerAuth},
		{"/root/dlock-pki/etcd/server.crt", etcdCA, "etcd-1.etcd.dlock.svc.cluster.local", x509.ExtKeyUsageClientAuth},
		{"/root/dlock-pki/etcd/dlock.crt", etcdCA, "", x509.ExtKeyUsageClientAuth},
		{"/root/dlock-pki/nodes/node-a/client.crt", dlockCA, "node-a", x509.ExtKeyUsageClientAuth},
	} {
		_, err := cert(v.file).Verify(x509.VerifyOptions{Roots: v.roots, DNSName: v.name, KeyUsages: []x509.ExtKeyUsage{v.usage}})
		if err != nil {
			t.Errorf("%s for %q: %v", v.file, v.name, err)
		}
	}
	// dlock's client certificate for etcd must not pass as a node's, nor a
	// node's get into etcd: two CAs.
	if _, err := cert("/root/dlock-pki/etcd/dlock.crt").Verify(x509.VerifyOptions{Roots: dlockCA, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err == nil {
		t.Error("dlock's CA signs dlock's client certificate for etcd: use two CAs")
	}
	if tok := string(read("/root/dlock-pki/nodes/node-b/token")); !strings.HasSuffix(strings.TrimSpace(tok), " node-b") {
		t.Errorf("nodes/node-b/token is not node-b's line: %q", tok)
	}
}
