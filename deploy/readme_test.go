package deploy

import (
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// The sections of deploy/README.md whose commands TestREADME runs, with
// the test hosts each needs, and what their output must show besides
// every command succeeding (sh -e).
var readmeWalks = []struct {
	section   string
	hosts     []string
	want      []string
	sameEpoch bool // every epoch shown is one: the servers are one lock service
}{
	{
		section: "systemd: one server",
		hosts:   []string{"dlock1", "node-1"},
		want: []string{
			`"status":"ok"`,
			"tls=true", "token_file=/run/credentials/dlock.service/tokens",
			`address = "/run/dlock-content/content.sock"`,
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
}

// Blocks that TestREADME does not run, and why: everything else fenced as
// sh in deploy/README.md must be in a walk above.
var readmeNotRun = map[string]string{
	"Kubernetes": "there is no Kubernetes cluster here: the manifests are checked by TestKustomizations and TestNetworkPolicyFlows, the Secrets its commands make by TestREADMESecrets",
	"The image":  "building and pushing an image needs a container engine and a registry, which the walks here do not use",
}

type readmeBlock struct {
	section string
	on      string // "every host" or a host name
	text    string
}

var (
	epochShown = regexp.MustCompile(`"epoch":"([0-9a-f]+)"`)
	fence      = regexp.MustCompile("(?ms)^```sh\\n(.*?)^```$")
	onLine     = regexp.MustCompile(`^# on (every host|[a-z0-9-]+)\n`)
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
				blk.on = on[1]
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
		if _, ok := readmeNotRun[b.section]; ok {
			continue
		}
		found := false
		for _, w := range readmeWalks {
			if w.section != b.section {
				continue
			}
			found = true
			if b.on != "every host" && !slices.Contains(w.hosts, b.on) {
				t.Errorf("%s: a block does not start with `# on HOST` (every host or one of %v):\n%s", b.section, w.hosts, b.text)
			}
		}
		if !found {
			t.Errorf("section %q: its sh blocks are run by no test (add it to readmeWalks or readmeNotRun):\n%s", b.section, b.text)
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
				if b.section != w.section {
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
