package deploy

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	srvconfig "github.com/containerd/containerd/v2/cmd/containerd/server/config"
	"github.com/pelletier/go-toml/v2"
)

// The files of deploy/systemd, as deploy/README.md installs them: units,
// their drop-ins, env files.
var systemdFiles = []string{
	"dlock.service", "dlock.service.d/etcd.conf", "dlock.service.d/mtls.conf", "dlock.env", "dlock-ha.env",
	"dlock-content.service", "dlock-content.service.d/mtls.conf", "dlock-content.env",
}

const installedBin = "/usr/local/bin/"

func readSystemd(t *testing.T) map[string]string {
	t.Helper()
	files := map[string]string{}
	for _, f := range systemdFiles {
		b, err := os.ReadFile(filepath.Join("systemd", f))
		if err != nil {
			t.Fatal(err)
		}
		files[f] = string(b)
	}
	err := filepath.WalkDir("systemd", func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && !slices.Contains(systemdFiles, strings.TrimPrefix(p, "systemd/")) {
			t.Errorf("%s is not checked: add it to systemdFiles", p)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// withDropIns is a unit as systemd reads it: the file, then its drop-ins
// among files in the order of their names.
func withDropIns(files map[string]string, name string) unit {
	u := parseUnit(files[name])
	var dropIns []string
	for f := range files {
		if strings.HasPrefix(f, name+".d/") {
			dropIns = append(dropIns, f)
		}
	}
	slices.Sort(dropIns)
	for _, f := range dropIns {
		parseUnitInto(u, files[f])
	}
	return u
}

func systemdAnalyze(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("systemd-analyze")
	if err != nil {
		if os.Geteuid() == 0 {
			t.Fatal("systemd-analyze is missing: `make deps` installs Debian's systemd package")
		}
		t.Skip("SKIPPED: systemd-analyze is missing and we are not root: the systemd units are NOT checked; run `make deps` as root")
	}
	return p
}

// unit is a unit file's settings: section → key → values, in order.
type unit map[string]map[string][]string

func parseUnit(s string) unit {
	u := unit{}
	parseUnitInto(u, s)
	return u
}

// parseUnitInto adds a unit file's or a drop-in's settings to u as systemd
// does: a line that ends in a backslash goes on, and an empty assignment
// (ExecStart=) drops the values before it.
func parseUnitInto(u unit, s string) {
	sec := ""
	cont := ""
	for line := range strings.Lines(s) {
		line = strings.TrimSpace(line)
		if cont != "" {
			line, cont = cont+" "+line, ""
		}
		if strings.HasSuffix(line, "\\") && line[0] != '#' && line[0] != ';' {
			cont = strings.TrimSuffix(line, "\\")
			continue
		}
		switch {
		case line == "" || line[0] == '#' || line[0] == ';':
		case line[0] == '[':
			sec = strings.Trim(line, "[]")
			if u[sec] == nil {
				u[sec] = map[string][]string{}
			}
		default:
			k, v, _ := strings.Cut(line, "=")
			k, v = strings.TrimSpace(k), strings.TrimSpace(v)
			switch {
			case u[sec] == nil:
			case v == "":
				delete(u[sec], k)
			default:
				u[sec][k] = append(u[sec][k], v)
			}
		}
	}
}

func (u unit) get(sec, key string) string {
	v := u[sec][key]
	if len(v) == 0 {
		return ""
	}
	return v[len(v)-1]
}

// all is every word of every value of a list setting.
func (u unit) all(sec, key string) []string {
	var out []string
	for _, v := range u[sec][key] {
		out = append(out, strings.Fields(v)...)
	}
	return out
}

var envLine = regexp.MustCompile(`^#?\s*([A-Z][A-Z0-9_]*)=(.*)$`)

// parseEnv reads an EnvironmentFile: its settings, and the names of every
// setting shown, commented out or not.
func parseEnv(s string) (set map[string]string, named []string) {
	set = map[string]string{}
	for line := range strings.Lines(s) {
		line = strings.TrimSpace(line)
		m := envLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		named = append(named, m[1])
		if line[0] != '#' {
			set[m[1]] = m[2]
		}
	}
	return set, named
}

// checkSystemd runs systemd-analyze verify on the units and their
// drop-ins, installed as deploy/README.md says but with ExecStart pointing
// at freshly built binaries, and checks what the units, drop-ins and env
// files must agree on.
func checkSystemd(analyze, bin string, files map[string]string, env knownEnv) error {
	var errs []error
	fail := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }

	dir, err := os.MkdirTemp(tmpRoot, "units-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	var paths []string
	for _, f := range systemdFiles {
		if strings.HasSuffix(f, ".env") {
			continue
		}
		p := filepath.Join(dir, f)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(p, []byte(strings.ReplaceAll(files[f], installedBin, bin+"/")), 0o644); err != nil {
			return err
		}
		if !strings.Contains(f, "/") {
			paths = append(paths, p)
		}
	}
	// verify reads the drop-ins beside each unit (NAME.d/*.conf).
	cmd := exec.Command(analyze, append([]string{"verify", "--man=no"}, paths...)...)
	out, err := cmd.CombinedOutput()
	// verify exits 0 on unknown keys and bad values ("…, ignoring"), so
	// every line about these units is a failure.
	reported := false
	for line := range strings.Lines(string(out)) {
		if strings.Contains(line, "dlock.service") || strings.Contains(line, "dlock-content.service") {
			fail("systemd-analyze verify: %s", strings.TrimSpace(line))
			reported = true
		}
	}
	if err != nil && !reported {
		fail("systemd-analyze verify: %v\n%s", err, out)
	}

	for _, f := range []struct{ file, binary string }{{"dlock.env", "dlock"}, {"dlock-ha.env", "dlock"}, {"dlock-content.env", "dlock-content"}} {
		_, named := parseEnv(files[f.file])
		for _, n := range named {
			if !env[f.binary][n] {
				fail("%s: %s reads no variable %s", f.file, f.binary, n)
			}
		}
	}

	d := withDropIns(files, "dlock.service")
	c := withDropIns(files, "dlock-content.service")
	for name, u := range map[string]unit{"dlock.service": d, "dlock-content.service": c} {
		binary := strings.TrimSuffix(name, ".service")
		for key, want := range map[string]string{"ProtectSystem": "strict", "NoNewPrivileges": "yes", "Type": "exec"} {
			if got := u.get("Service", key); got != want {
				fail("%s: %s=%s, want %s", name, key, got, want)
			}
		}
		if u.get("Service", "LimitNOFILE") == "" {
			fail("%s: no LimitNOFILE", name)
		}
		if u.get("Service", "User") == "" && u.get("Service", "DynamicUser") != "yes" {
			fail("%s: runs as root: set DynamicUser=yes or User=", name)
		}
		vars := map[string]string{}
		for _, line := range u["Service"]["Environment"] {
			words, err := splitWords(line)
			if err != nil {
				fail("%s: Environment=%s: %v", name, line, err)
			}
			for _, w := range words {
				k, v, _ := strings.Cut(w, "=")
				vars[k] = v
				if !env[binary][k] {
					fail("%s: Environment=: %s reads no variable %s", name, binary, k)
				}
			}
		}
		checkCredentials(fail, name, u, vars)
	}
	if ef := d.get("Service", "EnvironmentFile"); ef != "/etc/dlock/dlock.env" {
		fail("dlock.service: EnvironmentFile=%s, want /etc/dlock/dlock.env", ef)
	}
	if ef := c.get("Service", "EnvironmentFile"); ef != "/etc/dlock/dlock-content.env" {
		fail("dlock-content.service: EnvironmentFile=%s, want /etc/dlock/dlock-content.env", ef)
	}
	// dlock's durable state in the unit's StateDirectory, whatever the
	// env file says; identities on, from the credentials.
	start := d.get("Service", "ExecStart")
	if d.get("Service", "StateDirectory") != "dlock" || !strings.Contains(start, "--data-dir=${STATE_DIRECTORY}") {
		fail("dlock.service: --data-dir must be ${STATE_DIRECTORY} of StateDirectory=dlock")
	}
	for _, f := range []string{"--token-file=%d/", "--tls-cert=%d/", "--tls-key=%d/"} {
		if !strings.Contains(start, f) {
			fail("dlock.service: ExecStart has no %s…: the server must take its token file and TLS files from its credentials", f)
		}
	}
	cstart := c.get("Service", "ExecStart")
	for _, f := range []string{"--ca=%d/", "--token-file=%d/"} {
		if !strings.Contains(cstart, f) {
			fail("dlock-content.service: ExecStart has no %s…", f)
		}
	}
	dEnv, _ := parseEnv(files["dlock.env"])
	haEnv, _ := parseEnv(files["dlock-ha.env"])
	cEnv, _ := parseEnv(files["dlock-content.env"])
	for f, e := range map[string]map[string]string{"dlock.env": dEnv, "dlock-ha.env": haEnv} {
		if e["DLOCK_REFCOUNT"] != "server" {
			fail("%s: DLOCK_REFCOUNT=%q: dlock-content refuses to start without server", f, e["DLOCK_REFCOUNT"])
		}
	}
	if b := dEnv["DLOCK_BACKEND"]; b != "" && b != "memory" {
		fail("dlock.env: DLOCK_BACKEND=%s: this file is the memory backend's", b)
	}
	// The etcd variant: dlock-ha.env names an etcd over TLS, whose CA
	// and client certificate the drop-in gives.
	if haEnv["DLOCK_BACKEND"] != "etcd" {
		fail("dlock-ha.env: DLOCK_BACKEND=%q, want etcd", haEnv["DLOCK_BACKEND"])
	}
	eps := strings.Split(haEnv["DLOCK_ETCD_ENDPOINTS"], ",")
	for _, ep := range eps {
		if !strings.HasPrefix(ep, "https://") {
			fail("dlock-ha.env: DLOCK_ETCD_ENDPOINTS: %q is not https://", ep)
		}
	}
	if len(eps) < 3 {
		fail("dlock-ha.env: DLOCK_ETCD_ENDPOINTS names %d members, want the 3 of deploy/README.md", len(eps))
	}
	etcdConf := parseUnit(files["dlock.service.d/etcd.conf"])
	etcdVars := map[string]bool{}
	for _, line := range etcdConf["Service"]["Environment"] {
		words, _ := splitWords(line)
		for _, w := range words {
			k, _, _ := strings.Cut(w, "=")
			etcdVars[k] = true
		}
	}
	for _, v := range []string{"DLOCK_ETCD_CA", "DLOCK_ETCD_CERT", "DLOCK_ETCD_KEY"} {
		if !etcdVars[v] {
			fail("dlock.service.d/etcd.conf: does not set %s", v)
		}
	}
	if !slices.Contains(etcdConf.all("Unit", "After"), "etcd.service") {
		fail("dlock.service.d/etcd.conf: not After=etcd.service")
	}
	if !strings.HasPrefix(cEnv["DLOCK_CONTENT_SERVER"], "https://") {
		fail("dlock-content.env: DLOCK_CONTENT_SERVER=%s: the server speaks https", cEnv["DLOCK_CONTENT_SERVER"])
	}

	// dlock-content: before containerd, started with it, writing only to
	// its socket's directory and the shared root.
	if !slices.Contains(c.all("Unit", "Before"), "containerd.service") {
		fail("dlock-content.service: not Before=containerd.service")
	}
	if !slices.Contains(c.all("Install", "WantedBy"), "containerd.service") {
		fail("dlock-content.service: not WantedBy=containerd.service")
	}
	// dlock.service's dynamic user is named after it: a static user of
	// that name would be taken instead, and own the server's state.
	if u := c.get("Service", "User"); u == "" || u == "dlock" {
		fail("dlock-content.service: User=%q: want a user of its own (the shared root's files are its)", u)
	}
	sock := cEnv["DLOCK_CONTENT_SOCKET"]
	if rd := c.get("Service", "RuntimeDirectory"); rd == "" || path.Dir(sock) != path.Join("/run", rd) {
		fail("dlock-content.env: DLOCK_CONTENT_SOCKET=%s is not in the unit's RuntimeDirectory=%s", sock, rd)
	}
	root := cEnv["DLOCK_CONTENT_ROOT"]
	if root == "" || !slices.Contains(c.all("Service", "ReadWritePaths"), root) || !slices.Contains(c.all("Unit", "RequiresMountsFor"), root) {
		fail("dlock-content.env: DLOCK_CONTENT_ROOT=%s must be in the unit's ReadWritePaths= and RequiresMountsFor=", root)
	}
	if b, err := os.ReadFile(dropInFile); err != nil {
		fail("%v", err)
	} else {
		var cfg srvconfig.Config
		if err := toml.Unmarshal(b, &cfg); err != nil {
			fail("%s: %v", dropInFile, err)
		} else if err := checkContentProxy(&cfg, sock); err != nil {
			fail("%s against dlock-content.env: %v", dropInFile, err)
		}
	}
	return errors.Join(errs...)
}

var credentialRef = regexp.MustCompile(`%d/([^ "']+)`)

// checkCredentials: every credential a unit loads is used (%d/ID on its
// command line or in Environment=), every one used is loaded, and each
// comes from a root-only file under /etc/dlock.
func checkCredentials(fail func(string, ...any), name string, u unit, vars map[string]string) {
	loaded := map[string]bool{}
	for _, c := range u.all("Service", "LoadCredential") {
		id, src, _ := strings.Cut(c, ":")
		loaded[id] = true
		if !strings.HasPrefix(src, "/etc/dlock/") {
			fail("%s: LoadCredential=%s: want a file under /etc/dlock/ (deploy/README.md installs them there)", name, c)
		}
	}
	used := map[string]bool{}
	refs := []string{u.get("Service", "ExecStart")}
	for _, v := range vars {
		refs = append(refs, v)
	}
	for _, r := range refs {
		for _, m := range credentialRef.FindAllStringSubmatch(r, -1) {
			used[m[1]] = true
			if !loaded[m[1]] {
				fail("%s: %%d/%s names no LoadCredential= of the unit", name, m[1])
			}
		}
	}
	for id := range loaded {
		if !used[id] {
			fail("%s: the credential %s is loaded and never used", name, id)
		}
	}
}

func TestSystemdUnits(t *testing.T) {
	analyze := systemdAnalyze(t)
	if err := checkSystemd(analyze, binDir(t), readSystemd(t), helpOf(t)); err != nil {
		t.Fatal(err)
	}
}

// TestSystemdTypos: each case changes one thing in a copy of the files and
// expects checkSystemd to fail.
func TestSystemdTypos(t *testing.T) {
	analyze := systemdAnalyze(t)
	bin, env := binDir(t), helpOf(t)
	cases := []struct{ file, old, new, want string }{
		{"dlock.service", "ProtectSystem=strict", "ProtectSytem=strict", "Unknown key"},
		{"dlock.service", "NoNewPrivileges=yes", "NoNewPrivileges=yse", "NoNewPrivileges"},
		{"dlock.service", "ExecStart=/usr/local/bin/dlock ", "ExecStart=/usr/local/bin/dlok ", "dlok"},
		{"dlock.service", "RestrictAddressFamilies=AF_INET ", "RestrictAddressFamilies=AF_INTE ", "AF_INTE"},
		{"dlock.service", "[Service]", "[Servcie]", "Servcie"},
		{"dlock.service", "LoadCredential=tokens:", "LoadCredential=token:", "%d/tokens names no LoadCredential"},
		{"dlock.service", "--tls-key=%d/tls.key", "--tls-key=%d/tls.crt", "tls.key is loaded and never used"},
		{"dlock.service", "LoadCredential=tls.crt:/etc/dlock/pki/server.crt", "LoadCredentials=tls.crt:/etc/dlock/pki/server.crt", "Unknown key"},
		{"dlock.service.d/etcd.conf", "DLOCK_ETCD_CA=%d/etcd-ca.crt", "DLOCK_ETCD_CAS=%d/etcd-ca.crt", "DLOCK_ETCD_CAS"},
		{"dlock.service.d/etcd.conf", "LoadCredential=etcd.key:", "LoadCredential=etcd-key:", "%d/etcd.key names no LoadCredential"},
		{"dlock.service.d/etcd.conf", "[Service]", "[Servise]", "Servise"},
		{"dlock.service.d/mtls.conf", "DLOCK_CLIENT_CA=", "DLOCK_CLIENTCA=", "DLOCK_CLIENTCA"},
		{"dlock-content.service", "Before=containerd.service", "Before=containerd.socket", "Before=containerd.service"},
		{"dlock-content.service", "ReadWritePaths=/srv/dlock-content", "ReadWritePaths=/srv/dlock-contents", "ReadWritePaths"},
		{"dlock-content.service", "ExecStart=/usr/local/bin/dlock-content", "ExecStart=/usr/local/bin/dlock-contnet", "dlock-contnet"},
		{"dlock-content.service", "--ca=%d/ca.crt", "--ca=%d/ca.cert", "%d/ca.cert names no LoadCredential"},
		{"dlock-content.service.d/mtls.conf", "DLOCK_CONTENT_KEY=", "DLOCK_CONTENT_KYE=", "DLOCK_CONTENT_KYE"},
		{"dlock.env", "DLOCK_REFCOUNT=server", "DLOCK_REFCOUNTS=server", "DLOCK_REFCOUNTS"},
		{"dlock.env", "#DLOCK_SESSION_GRACE=5s", "#DLOCK_SESION_GRACE=5s", "DLOCK_SESION_GRACE"},
		{"dlock-ha.env", "DLOCK_BACKEND=etcd", "DLOCK_BACKEND=etc", "want etcd"},
		{"dlock-ha.env", "DLOCK_ETCD_ENDPOINTS=https://10.0.0.1:2379", "DLOCK_ETCD_ENDPOINTS=http://10.0.0.1:2379", "not https"},
		{"dlock-ha.env", "DLOCK_REFCOUNT=server", "DLOCK_REFCOUNT=off", "DLOCK_REFCOUNT"},
		{"dlock-content.env", "DLOCK_CONTENT_SOCKET=/run/dlock-content/content.sock", "DLOCK_CONTENT_SOCKET=/run/dlock/content.sock", "RuntimeDirectory"},
		{"dlock-content.env", "DLOCK_CONTENT_SERVER=https://", "DLOCK_CONTENT_SERVER=http://", "speaks https"},
	}
	for _, tc := range cases {
		t.Run(tc.file+":"+tc.new, func(t *testing.T) {
			files := readSystemd(t)
			if n := strings.Count(files[tc.file], tc.old); n != 1 {
				t.Fatalf("%s: %q occurs %d times; the case must change exactly one place", tc.file, tc.old, n)
			}
			files[tc.file] = strings.Replace(files[tc.file], tc.old, tc.new, 1)
			err := checkSystemd(analyze, bin, files, env)
			if err == nil {
				t.Fatalf("%s: %q → %q: every check passed", tc.file, tc.old, tc.new)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("%s: %q → %q: the error does not say %q:\n%v", tc.file, tc.old, tc.new, tc.want, err)
			}
			t.Log(err)
		})
	}
}

// TestSystemdCredentials starts both units with their mTLS drop-ins on a
// test host (hosts_test.go), installed as deploy/README.md installs them,
// with credentials from docs/mkcerts.sh and `dlock token new`: the server
// runs as its dynamic user, not root, reads the copies systemd made for it
// (mode 0400 in a directory of mode 0500, both its own), and refuses a
// client without a certificate; dlock-content, as its user, serves with
// its own certificate and token.
func TestSystemdCredentials(t *testing.T) {
	h := newHost(t, "dlock1")
	bin := binDir(t)
	out := h.mustSh(t, `
install -m 0755 `+bin+`/dlock `+bin+`/dlock-content /usr/local/bin/
install -m 0644 deploy/systemd/dlock.service deploy/systemd/dlock-content.service /etc/systemd/system/
install -D -m 0644 deploy/systemd/dlock.service.d/mtls.conf /etc/systemd/system/dlock.service.d/mtls.conf
install -D -m 0644 deploy/systemd/dlock-content.service.d/mtls.conf /etc/systemd/system/dlock-content.service.d/mtls.conf
install -d /etc/dlock/pki
install -m 0644 deploy/systemd/dlock.env deploy/systemd/dlock-content.env /etc/dlock/
sed -i 's/^DLOCK_LISTEN=.*/DLOCK_LISTEN=127.0.0.9:7380/' /etc/dlock/dlock.env
sed -i 's|^DLOCK_CONTENT_SERVER=.*|DLOCK_CONTENT_SERVER=https://127.0.0.9:7380|' /etc/dlock/dlock-content.env
echo DLOCK_CONTENT_NODE=node-1 >> /etc/dlock/dlock-content.env
DLOCK_SERVER_SANS=IP:127.0.0.9 sh docs/mkcerts.sh /root/pki node-1
(umask 077 && dlock token new '*' > /etc/dlock/tokens && dlock token new node-1 >> /etc/dlock/tokens)
install -m 0600 /root/pki/server.crt /root/pki/server.key /root/pki/ca.crt /etc/dlock/pki/
(umask 077 && grep ' node-1$' /etc/dlock/tokens > /etc/dlock/dlock-content.token)
install -m 0600 /root/pki/node-1.crt /etc/dlock/dlock-content.crt
install -m 0600 /root/pki/node-1.key /etc/dlock/dlock-content.key
useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin dlock-content
install -d -o dlock-content -g dlock-content /srv/dlock-content
systemctl start dlock.service
curl -fsS --retry 20 --retry-delay 1 --retry-all-errors --cacert /root/pki/ca.crt https://127.0.0.9:7380/healthz
echo
systemctl start dlock-content.service
i=0; until journalctl -u dlock-content.service | grep 'dlock-content serving'; do
	i=$((i + 1)); [ $i -lt 300 ]; sleep 0.2
done
pid=$(cut -d' ' -f1 /run/dlock-deploy-units/dlock.service.pid)
echo "server uid $(awk '/^Uid:/ { print $2 }' /proc/$pid/status)"
stat -c 'cred %n %u %a' /run/credentials/dlock.service /run/credentials/dlock.service/*
journalctl -u dlock.service | grep 'dlock serving'
if dlock status --server https://127.0.0.9:7380 --ca /root/pki/ca.crt --token-file /etc/dlock/dlock-content.token \
	--node node-1 --resource r >/dev/null 2>&1; then echo "answered without a certificate"; fi
dlock status --server https://127.0.0.9:7380 --ca /root/pki/ca.crt --token-file /etc/dlock/dlock-content.token \
	--cert /root/pki/node-1.crt --key /root/pki/node-1.key --node node-1 --resource r --human
systemctl stop dlock-content.service dlock.service
echo "left: $(ls /run/credentials)"
`)
	t.Log(out)
	uid := regexp.MustCompile(`server uid (\d+)`).FindStringSubmatch(out)
	if uid == nil || uid[1] == "0" {
		t.Fatalf("the server runs as root, or its uid is unknown")
	}
	creds := regexp.MustCompile(`cred (\S+) (\d+) (\d+)`).FindAllStringSubmatch(out, -1)
	if len(creds) != 5 { // the directory, client-ca.crt, tls.crt, tls.key, tokens
		t.Fatalf("credentials: %q", creds)
	}
	for _, c := range creds {
		want := "400"
		if c[1] == "/run/credentials/dlock.service" {
			want = "500"
		}
		if c[2] != uid[1] || c[3] != want {
			t.Errorf("%s: owner %s mode %s, want the server's uid %s and mode %s", c[1], c[2], c[3], uid[1], want)
		}
	}
	for _, s := range []string{`"status":"ok"`, "tls=true client_ca=true token_file=/run/credentials/dlock.service/tokens", "dlock-content serving", "pull:r free"} {
		if !strings.Contains(out, s) {
			t.Errorf("the output does not show %q", s)
		}
	}
	if strings.Contains(out, "answered without a certificate") {
		t.Error("the server answered a client without a client certificate")
	}
	if left := regexp.MustCompile(`left: (.*)`).FindStringSubmatch(out); left == nil || strings.TrimSpace(left[1]) != "" {
		t.Errorf("stopping the units left their credentials behind: %q", left)
	}
}
