package deploy

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

// securityDoc is the page whose walk TestSecurityWalk runs, and the
// section that holds it.
const (
	securityDoc     = "../docs/SECURITY.md"
	securitySection = "Turning identities on"
	// securityAddr is the server's address in the walk, which the test
	// replaces with a loopback address of its own, as TestREADME does.
	securityAddr = "10.0.0.1"
)

// securitySteps are how the sh blocks of the walk begin, in order: a block
// added, removed or moved fails the test until the checks follow it.
var securitySteps = []string{
	"go build -o /usr/local/bin/ ./cmd/dlock\n",    // dlock, and the certificates in the operator's directory
	"install -d -m 0700 /etc/dlock /etc/dlock/pki", // the server's files
	"dlock serve ",                                  // the server, in a terminal of its own
	"install -d -m 0700 /etc/dlock/node-1\n",        // node-1's files
	"export DLOCK_SERVER=https://dlock:7380 ",       // node-1 takes a lock
	"dlock token new node-1 >> /etc/dlock/tokens\n", // node-1's token rotated
	"DLOCK_SERVER_SANS=DNS:dlock,IP:",               // the certificates rotated
}

// securityBlocks are the sh blocks of the walk, each preceded by the
// marker that says this test runs it.
func securityBlocks(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile(securityDoc)
	if err != nil {
		t.Fatal(err)
	}
	_, sec, ok := strings.Cut(string(b), "\n## "+securitySection+"\n")
	if !ok {
		t.Fatalf("docs/SECURITY.md has no section %q", "## "+securitySection)
	}
	sec, _, _ = strings.Cut(sec, "\n## ")
	var blocks []string
	for _, m := range regexp.MustCompile("(?m)^([^\n]*)\n```sh\n((?s:.*?))^```$").FindAllStringSubmatch(sec, -1) {
		if m[1] != "<!-- run: deploy TestSecurityWalk -->" {
			t.Errorf("docs/SECURITY.md, %q: the line before sh block %d is %q, want the marker <!-- run: deploy TestSecurityWalk -->", securitySection, len(blocks)+1, m[1])
		}
		blocks = append(blocks, m[2])
	}
	if len(blocks) != len(securitySteps) {
		t.Fatalf("docs/SECURITY.md, %q: %d sh blocks, want %d", securitySection, len(blocks), len(securitySteps))
	}
	for i, want := range securitySteps {
		if !strings.HasPrefix(blocks[i], want) {
			t.Fatalf("docs/SECURITY.md, %q: sh block %d starts %q, want %q", securitySection, i+1, blocks[i], want)
		}
	}
	return blocks
}

// TestSecurityDocBlocksAreRun: every sh block of docs/SECURITY.md is in
// the walk TestSecurityWalk runs, and says so with its marker.
func TestSecurityDocBlocksAreRun(t *testing.T) {
	b, err := os.ReadFile(securityDoc)
	if err != nil {
		t.Fatal(err)
	}
	all := regexp.MustCompile("(?m)^```(sh|console)$").FindAllString(string(b), -1)
	if walk := securityBlocks(t); len(all) != len(walk) {
		t.Errorf("docs/SECURITY.md has %d sh or console blocks, and its walk %q %d: TestSecurityWalk runs the walk's only", len(all), securitySection, len(walk))
	}
}

// watchModes is put after every command of a block: from the first write
// on, every directory under /etc/dlock and the operator's /root/dlock-pki
// is mode 0700 and every file 0600. A file made 0644 and then chmod'ed
// fails here, on the line that made it.
const watchModes = `walk_watch() {
	bad=$(find /etc/dlock /root/dlock-pki \( -type d ! -perm 700 \) -o \( -type f ! -perm 600 \) 2>/dev/null) || true
	if [ -n "$bad" ]; then
		echo "WRONG MODES after $1:"
		ls -ld $bad
		exit 97
	fi
}
`

// watched is block with walk_watch after each of its commands (a line that
// does not go on on the next).
func watched(block string, n int) string {
	var b strings.Builder
	b.WriteString(watchModes)
	for i, line := range strings.Split(strings.TrimRight(block, "\n"), "\n") {
		b.WriteString(line + "\n")
		if l := strings.TrimSpace(line); !strings.HasSuffix(l, "\\") && !strings.HasSuffix(l, "&&") && !strings.HasSuffix(l, "|") {
			fmt.Fprintf(&b, "walk_watch 'block %d, line %d'\n", n, i+1)
		}
	}
	return b.String()
}

// TestSecurityWalk runs docs/SECURITY.md's "Turning identities on", as
// written, as root, on a fresh test host (hosts_test.go), where the name
// dlock is the server's loopback address (the host's own /etc/hosts), and
// checks after each step what the page promises: the modes of every
// credential from its first write, no CA key beside the server's, both
// credentials needed and the node's own id only, and a SIGHUP that
// rotates tokens and certificates.
func TestSecurityWalk(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: test hosts (namespaces and overlay mounts) need root: docs/SECURITY.md's walk \"Turning identities on\" is NOT run")
	}
	requireHosts(t)
	for _, b := range []string{"openssl", "curl", "pidof"} {
		if _, err := os.Stat("/usr/bin/" + b); err != nil {
			t.Fatalf("%s is missing: `make deps` installs it", b)
		}
	}
	blocks := securityBlocks(t)
	addr := freeLoopback(t)
	h := newHost(t, "dlock")
	file := func(p string) string { return filepath.Join(h.dir, "fs", strings.TrimPrefix(p, "/")) }
	h.mustSh(t, `[ ! -e /etc/dlock ] && [ ! -e /root/dlock-pki ] || { echo "the host is not fresh"; exit 1; }
echo '`+addr+` dlock' >> /etc/hosts
getent hosts dlock`)
	var out strings.Builder
	run := func(i int) string {
		t.Helper()
		script := strings.ReplaceAll(blocks[i], securityAddr, addr)
		o := h.mustSh(t, watched(script, i+1))
		fmt.Fprintf(&out, "--- block %d:\n%s", i+1, o)
		return o
	}
	defer func() {
		if t.Failed() || testing.Verbose() {
			log, _ := os.ReadFile(file("/var/log/dlock-serve.log"))
			t.Logf("output:\n%s--- the server's log:\n%s", out.String(), log)
		}
	}()

	// dlock, and the certificates, made in the operator's directory.
	run(0)
	serverCert := readCert(t, file("/root/dlock-pki/server.crt"))
	roots := x509.NewCertPool()
	roots.AddCert(readCert(t, file("/root/dlock-pki/ca.crt")))
	for _, name := range []string{"dlock", addr} {
		if _, err := serverCert.Verify(x509.VerifyOptions{Roots: roots, DNSName: name}); err != nil {
			t.Errorf("the server's certificate is not for %s: %v", name, err)
		}
	}

	// The server's files: what it needs, and not the CA's key.
	run(1)
	entries, err := os.ReadDir(file("/etc/dlock/pki"))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	if !slices.Equal(names, []string{"ca.crt", "server.crt", "server.key"}) {
		t.Errorf("the server's /etc/dlock/pki holds %v, want ca.crt, server.crt, server.key (and never ca.key)", names)
	}
	tokens := readLines(t, file("/etc/dlock/tokens"))
	if len(tokens) != 2 || !strings.HasSuffix(tokens[0], " node-1") || !strings.HasSuffix(tokens[1], " *") {
		t.Fatalf("/etc/dlock/tokens: %q, want node-1's line and an operator's", tokens)
	}

	// The server, in the background as in a terminal of its own.
	serveScript := filepath.Join(h.dir, "serve.sh")
	if err := os.WriteFile(serveScript, []byte(strings.ReplaceAll(blocks[2], securityAddr, addr)), 0o644); err != nil {
		t.Fatal(err)
	}
	h.mustSh(t, "sh -e "+serveScript+" > /var/log/dlock-serve.log 2>&1 &")
	serveLog := func() string {
		b, _ := os.ReadFile(file("/var/log/dlock-serve.log"))
		return string(b)
	}
	waitFor(t, "dlock serving", func() bool { return strings.Contains(serveLog(), "dlock serving") })
	for _, want := range []string{"tls=true client_ca=true token_file=/etc/dlock/tokens", "addr=" + addr + ":7380"} {
		if !strings.Contains(serveLog(), want) {
			t.Errorf("the server's log does not show %q, which the page says it shows", want)
		}
	}
	if strings.Contains(serveLog(), "WARN") {
		t.Errorf("the server warned:\n%s", serveLog())
	}

	// node-1's files: its own line of the server's file.
	run(3)
	if got := readLines(t, file("/etc/dlock/node-1/token")); !slices.Equal(got, tokens[:1]) {
		t.Errorf("node-1's token file holds %q, want its line %q", got, tokens[0])
	}

	// node-1 takes a lock with both credentials.
	o := run(4)
	for _, want := range []string{"pull:image-1 free", "pulled"} {
		if !strings.Contains(o, want) {
			t.Errorf("node-1's commands do not show %q, which the page says they show", want)
		}
	}
	const (
		node1 = "--server https://dlock:7380 --ca /etc/dlock/node-1/ca.crt --resource image-1 "
		cert1 = "--cert /etc/dlock/node-1/node-1.crt --key /etc/dlock/node-1/node-1.key "
	)
	refused := func(what, cmd, want string) {
		t.Helper()
		o, err := h.sh(t, cmd)
		if err == nil || !strings.Contains(o, want) {
			t.Errorf("%s: %v, want a refusal with %q:\n%s", what, err, want, o)
		}
	}
	refused("node-1's credentials as node-2", "dlock status "+node1+cert1+"--token-file /etc/dlock/node-1/token --node node-2", "403")
	h.mustSh(t, "(umask 077 && dlock token new node-1 > /root/unknown.token)")
	refused("a token the server does not have", "dlock status "+node1+cert1+"--token-file /root/unknown.token --node node-1", "401")
	refused("node-1's token without its certificate", "dlock status "+node1+"--token-file /etc/dlock/node-1/token --node node-1", "401")
	const opCurl = "curl -sS -o /dev/null -w '%{http_code}\\n' --cacert /etc/dlock/pki/ca.crt --cert /root/dlock-pki/op.crt --key /root/dlock-pki/op.key "
	o = h.mustSh(t, `
op=$(awk '$2 == "*" { print $1 }' /etc/dlock/tokens)
node=$(cut -d' ' -f1 /etc/dlock/node-1/token)
echo "metrics operator $(`+opCurl+` -H "Authorization: Bearer $op" https://dlock:7380/metrics)"
echo "ui basic $(`+opCurl+` -u "anyone:$op" https://dlock:7380/ui)"
echo "ui node $(`+opCurl+` -u "anyone:$node" https://dlock:7380/ui)"
echo "ui none $(`+opCurl+` https://dlock:7380/ui)"
`)
	for _, want := range []string{"metrics operator 200", "ui basic 200", "ui node 403", "ui none 401"} {
		if !strings.Contains(o, want) {
			t.Errorf("the operator's routes: want %q in:\n%s", want, o)
		}
	}

	// node-1's token rotated: the old one is refused once the server has
	// read the file again, the next one works.
	h.mustSh(t, "cp -p /etc/dlock/node-1/token /root/old.token")
	run(5)
	next := readLines(t, file("/etc/dlock/node-1/token"))
	tokens = readLines(t, file("/etc/dlock/tokens"))
	if len(next) != 1 || next[0] == tokens[0] || !slices.Contains(tokens, next[0]) || len(tokens) != 2 {
		t.Fatalf("after the rotation: node-1 holds %q, the server %q; want node-1's next line, the old one gone", next, tokens)
	}
	status := func(tokenFile string) (string, error) {
		return h.sh(t, "dlock status "+node1+cert1+"--token-file "+tokenFile+" --node node-1")
	}
	waitFor(t, "the old token refused after the SIGHUP", func() bool {
		o, err := status("/root/old.token")
		return err != nil && strings.Contains(o, "401")
	})
	if o, err := status("/etc/dlock/node-1/token"); err != nil {
		t.Errorf("node-1's next token after the rotation: %v\n%s", err, o)
	}
	if n := strings.Count(serveLog(), "token file reloaded"); n != 2 {
		t.Errorf("the server logged %d token file reloads, want 2 (one per SIGHUP)", n)
	}

	// The certificates rotated: new handshakes get the new server
	// certificate, node-1's new one works, and the CA's key stays apart.
	old := serverSerial(t, addr, roots)
	run(6)
	waitFor(t, "the new server certificate served after the SIGHUP", func() bool {
		return serverSerial(t, addr, roots) != old
	})
	if _, err := os.Stat(file("/etc/dlock/pki/ca.key")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("/etc/dlock/pki/ca.key: %v, want none", err)
	}
	if serial := readCert(t, file("/etc/dlock/node-1/node-1.crt")).SerialNumber; serial.Cmp(readCert(t, file("/root/dlock-pki/node-1.crt")).SerialNumber) != 0 {
		t.Error("node-1's certificate was not replaced")
	}
	if o, err := status("/etc/dlock/node-1/token"); err != nil {
		t.Errorf("node-1's new certificate: %v\n%s", err, o)
	}
}

// freeLoopback is a 127.0.0.x address on which port 7380, the walk's, is
// free: other tests and other people's servers use 127.0.0.1.
func freeLoopback(t *testing.T) string {
	t.Helper()
	for x := 60; x < 120; x++ {
		a := fmt.Sprintf("127.0.0.%d", x)
		if ln, err := net.Listen("tcp", a+":7380"); err == nil {
			ln.Close()
			return a
		}
	}
	t.Fatal("no 127.0.0.x address with port 7380 free")
	return ""
}

func readCert(t *testing.T, p string) *x509.Certificate {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	blk, _ := pem.Decode(b)
	if blk == nil {
		t.Fatalf("%s: no PEM block", p)
	}
	c, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		t.Fatalf("%s: %v", p, err)
	}
	return c
}

func readLines(t *testing.T, p string) []string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSuffix(string(b), "\n"), "\n")
}

// serverSerial is the serial number of the certificate the server at addr
// answers a new handshake with, as the name dlock.
func serverSerial(t *testing.T, addr string, roots *x509.CertPool) string {
	t.Helper()
	d := &net.Dialer{Timeout: 10 * time.Second}
	c, err := tls.DialWithDialer(d, "tcp", addr+":7380", &tls.Config{RootCAs: roots, ServerName: "dlock"})
	if err != nil {
		t.Fatalf("TLS handshake with the server: %v", err)
	}
	defer c.Close()
	return c.ConnectionState().PeerCertificates[0].SerialNumber.String()
}
