package auth

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/pem"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/dlock/dlock/internal/auth/authtest"
)

type certFiles struct{ cert, key, ca string }

func writeCerts(t *testing.T, dir string, ca *authtest.CA) certFiles {
	t.Helper()
	cert, key := ca.Server(t).Write(t, dir, "server")
	caFile := filepath.Join(dir, "ca.crt")
	authtest.WriteFile(t, caFile, ca.PEM)
	return certFiles{cert, key, caFile}
}

// loadMTLS writes a server certificate and ca's certificate into a
// temporary folder and loads them, with ca as the client CA.
func loadMTLS(t *testing.T, ca *authtest.CA) (*Certs, certFiles) {
	t.Helper()
	f := writeCerts(t, t.TempDir(), ca)
	c, err := LoadCerts(f.cert, f.key, f.ca)
	if err != nil {
		t.Fatal(err)
	}
	return c, f
}

// handshake runs a TLS handshake over a pipe: the server side with c, the
// client with cfg. It returns the server's Peer and the client's view; the
// error is the server's, else the client's (in TLS 1.3 a refused client
// certificate reaches the client after its side of the handshake is done:
// it reads until the server closes).
func handshake(t *testing.T, c *Certs, cfg *tls.Config) (*Peer, tls.ConnectionState, error) {
	t.Helper()
	sc, cc := net.Pipe()
	defer cc.Close()
	client := tls.Client(cc, cfg)
	type result struct {
		st  tls.ConnectionState
		err error
	}
	done := make(chan result, 1)
	go func() {
		err := client.HandshakeContext(context.Background())
		st := client.ConnectionState()
		if err == nil {
			var b [1]byte
			if _, err = client.Read(b[:]); errors.Is(err, io.EOF) {
				err = nil
			}
		}
		cc.Close()
		done <- result{st, err}
	}()
	server := tls.Server(sc, c.Config())
	p, err := c.Handshake(context.Background(), server)
	server.Close()
	r := <-done
	if err == nil {
		err = r.err
	}
	return p, r.st, err
}

// clientConfig trusts ca for the server and sends the first of certs,
// whoever signed it (Go's client would otherwise send only a certificate
// of a CA the server names).
func clientConfig(ca *authtest.CA, certs ...tls.Certificate) *tls.Config {
	return &tls.Config{
		RootCAs: ca.Pool(), ServerName: "localhost", NextProtos: []string{"h2", "http/1.1"},
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			if len(certs) == 0 {
				return &tls.Certificate{}, nil
			}
			return &certs[0], nil
		},
	}
}

func TestNames(t *testing.T) {
	ca := authtest.NewCA(t, "ca")
	for _, tc := range []struct {
		cn   string
		dns  []string
		want []string
	}{
		{"node-a", []string{"node-a"}, []string{"node-a"}},
		{"node-a", []string{"node-b", "node-c"}, []string{"node-a", "node-b", "node-c"}},
		{"", []string{"node-b"}, []string{"node-b"}},
		{"*", nil, []string{"*"}},
		{"a", []string{"b", "a", "c", "b", "c", "d"}, []string{"a", "b", "c", "d"}},
	} {
		c := ca.Node(t, tc.cn, tc.dns...).TLS(t)
		if got := Names(c.Leaf); !slices.Equal(got, tc.want) {
			t.Errorf("CN %q DNS %v: names %v, want %v", tc.cn, tc.dns, got, tc.want)
		}
	}
	id := &CertIdentity{Names: []string{"node-a", "node-b"}}
	if !id.MayActAs("node-a") || !id.MayActAs("node-b") || id.MayActAs("Node-A") || id.MayActAs("node") || id.MayActAs("*") || id.Operator() {
		t.Error("MayActAs must match names exactly")
	}
	if op := (&CertIdentity{Names: []string{"*"}}); !op.Operator() || !op.MayActAs("anyone") {
		t.Error("a certificate named * is an operator")
	}
}

func TestLoadCertsErrors(t *testing.T) {
	dir := t.TempDir()
	ca := authtest.NewCA(t, "ca")
	f := writeCerts(t, dir, ca)
	other, _ := authtest.NewCA(t, "other").Server(t).Write(t, dir, "other")
	empty := filepath.Join(dir, "empty")
	authtest.WriteFile(t, empty, []byte("no PEM here\n"))
	for _, tc := range []struct {
		name           string
		cert, key, cas string
		notExist       bool
	}{
		{"missing cert", filepath.Join(dir, "nope"), f.key, "", true},
		{"missing key", f.cert, filepath.Join(dir, "nope"), "", true},
		{"key of another cert", other, f.key, "", false},
		{"missing CA", f.cert, f.key, filepath.Join(dir, "nope"), true},
		{"CA without a certificate", f.cert, f.key, empty, false},
	} {
		_, err := LoadCerts(tc.cert, tc.key, tc.cas)
		if !errors.Is(err, ErrCertificate) || tc.notExist != errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
	if c, err := LoadCerts(f.cert, f.key, ""); err != nil || c.ClientAuth() {
		t.Fatalf("TLS without mTLS: %v", err)
	}
}

// TestCertsMTLS: the node's names come from a verified certificate; no
// certificate is no peer; another CA's certificate fails the handshake;
// a reload that replaces the CA makes a connection's certificate
// untrusted on its next request, and one that brings the CA back trusts
// it again.
func TestCertsMTLS(t *testing.T) {
	ca := authtest.NewCA(t, "ca")
	c, f := loadMTLS(t, ca)
	nodeA := ca.Node(t, "node-a", "node-a", "alias-a").TLS(t)
	p, st, err := handshake(t, c, clientConfig(ca, nodeA))
	if err != nil {
		t.Fatal(err)
	}
	if st.NegotiatedProtocol != "h2" {
		t.Errorf("ALPN %q: the server offers h2 and http/1.1", st.NegotiatedProtocol)
	}
	id, err := c.Identify(p)
	if err != nil || !slices.Equal(id.Names, []string{"node-a", "alias-a"}) {
		t.Fatalf("identity %+v %v", id, err)
	}
	if p.roots == nil {
		t.Error("a handshake without a reload meanwhile knows the CA that verified it")
	}

	p0, _, err := handshake(t, c, clientConfig(ca))
	if err != nil || p0 != nil {
		t.Fatalf("no certificate: peer %v, %v", p0, err)
	}
	if _, err := c.Identify(p0); !errors.Is(err, ErrNoCertificate) {
		t.Fatalf("no certificate: %v", err)
	}

	stranger := authtest.NewCA(t, "stranger")
	if _, _, err := handshake(t, c, clientConfig(ca, stranger.Node(t, "node-a").TLS(t))); err == nil {
		t.Fatal("a certificate of another CA passed the handshake")
	}
	serverOnly := ca.Server(t).TLS(t) // no clientAuth key usage
	if _, _, err := handshake(t, c, clientConfig(ca, serverOnly)); err == nil {
		t.Fatal("a certificate without the clientAuth usage passed the handshake")
	}

	ca2 := authtest.NewCA(t, "ca2")
	authtest.WriteFile(t, f.ca, ca2.PEM)
	if err := c.Reload(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Identify(p); !errors.Is(err, ErrUntrusted) {
		t.Fatalf("after the CA was replaced: %v", err)
	}
	if _, _, err := handshake(t, c, clientConfig(ca, nodeA)); err == nil {
		t.Fatal("a new connection with the old CA's certificate passed the handshake")
	}
	p2, _, err := handshake(t, c, clientConfig(ca, ca2.Node(t, "node-b").TLS(t)))
	if err != nil {
		t.Fatal(err)
	}
	if id, err := c.Identify(p2); err != nil || !id.MayActAs("node-b") {
		t.Fatalf("new CA's certificate: %+v %v", id, err)
	}

	authtest.WriteFile(t, f.ca, append(append([]byte{}, ca.PEM...), ca2.PEM...))
	if err := c.Reload(); err != nil {
		t.Fatal(err)
	}
	if id, err := c.Identify(p); err != nil || !id.MayActAs("node-a") {
		t.Fatalf("the old CA back in the bundle: %+v %v", id, err)
	}
}

// TestCertsRotate: a reload serves the new server certificate to the next
// handshake; a reload of broken files keeps the last good ones.
func TestCertsRotate(t *testing.T) {
	dir := t.TempDir()
	ca := authtest.NewCA(t, "ca")
	f := writeCerts(t, dir, ca)
	c, err := LoadCerts(f.cert, f.key, "")
	if err != nil {
		t.Fatal(err)
	}
	_, st, err := handshake(t, c, clientConfig(ca))
	if err != nil {
		t.Fatal(err)
	}
	first := st.PeerCertificates[0].SerialNumber
	ca.Server(t).Write(t, dir, "server")
	if err := c.Reload(); err != nil {
		t.Fatal(err)
	}
	_, st, err = handshake(t, c, clientConfig(ca))
	if err != nil {
		t.Fatal(err)
	}
	second := st.PeerCertificates[0].SerialNumber
	if second.Cmp(first) == 0 || c.Leaf().SerialNumber.Cmp(second) != 0 {
		t.Fatalf("after a reload the server still shows serial %v", first)
	}
	// Half a rotation: a new certificate whose key is not there yet.
	cert2 := ca.Server(t)
	authtest.WriteFile(t, f.cert, cert2.CertPEM)
	if err := c.Reload(); !errors.Is(err, ErrCertificate) {
		t.Fatalf("a certificate without its key reloaded: %v", err)
	}
	if _, st, err = handshake(t, c, clientConfig(ca)); err != nil || st.PeerCertificates[0].SerialNumber.Cmp(second) != 0 {
		t.Fatalf("a failed reload changed what the server shows: %v", err)
	}
}

// TestCertsReloadCutCABundle: a client CA bundle caught half-written —
// during a rotation that appends the new CA — is refused, and the last
// good one stays. x509.CertPool.AppendCertsFromPEM skips a cut PEM block
// and succeeds as long as one certificate parsed: the CAs cut off would be
// dropped without a word in the log or in
// dlock_credential_reloads_total{result="error"}, and their nodes refused.
func TestCertsReloadCutCABundle(t *testing.T) {
	dir := t.TempDir()
	ca1, ca2 := authtest.NewCA(t, "ca1"), authtest.NewCA(t, "ca2")
	f := writeCerts(t, dir, ca1)
	authtest.WriteFile(t, f.ca, append(append([]byte{}, ca1.PEM...), ca2.PEM...))
	c, err := LoadCerts(f.cert, f.key, f.ca)
	if err != nil {
		t.Fatal(err)
	}
	node2 := ca2.Node(t, "node-2", "node-2").TLS(t)
	if _, _, err := handshake(t, c, clientConfig(ca1, node2)); err != nil {
		t.Fatalf("ca2's node before: %v", err)
	}
	// The rotation tool is rewriting the bundle in place.
	if err := os.WriteFile(f.ca, append(append([]byte{}, ca1.PEM...), ca2.PEM[:len(ca2.PEM)/2]...), 0o600); err != nil {
		t.Fatal(err)
	}
	err = c.Reload()
	if want := f.ca + ": line " + strconv.Itoa(1+bytes.Count(ca1.PEM, []byte("\n"))) + ": not a whole PEM block: the file was cut short"; !errors.Is(err, ErrCertificate) || err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("a CA bundle cut in its second certificate: %v, want %q", err, want)
	}
	if _, _, err := handshake(t, c, clientConfig(ca1, node2)); err != nil {
		t.Errorf("ca2's node after a reload of a half-written bundle: %v", err)
	}
}

// TestCertFilesStrict: every PEM block of the client CA file and of the
// certificate file must parse, and only white space may lie outside the
// blocks, at start and on reload: a file cut short is refused. Without
// this, a server certificate chain cut in its intermediate loaded (the
// leaf alone matches the key) and clients that need the intermediate
// could no longer verify the server.
func TestCertFilesStrict(t *testing.T) {
	dir := t.TempDir()
	ca, inter := authtest.NewCA(t, "ca"), authtest.NewCA(t, "intermediate")
	f := writeCerts(t, dir, ca)
	server := ca.Server(t)
	chain := append(append([]byte{}, server.CertPEM...), inter.PEM...)
	combined := append(append([]byte{}, server.CertPEM...), server.KeyPEM...)
	two := append(append([]byte{}, ca.PEM...), inter.PEM...)
	leafLines := 1 + bytes.Count(server.CertPEM, []byte("\n"))
	caLines := 1 + bytes.Count(ca.PEM, []byte("\n"))
	der, _ := pem.Decode(ca.PEM)
	badDER := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der.Bytes[:len(der.Bytes)-10]})
	for _, tc := range []struct {
		name           string
		cert, key, cas []byte
		want           string // "" when the files load
	}{
		{"whole chain", chain, server.KeyPEM, ca.PEM, ""},
		{"white space around the blocks", append(append([]byte("\n \n"), chain...), "\r\n\t\n"...), server.KeyPEM, append([]byte("\n"), two...), ""},
		{"certificate file holding its key", combined, server.KeyPEM, ca.PEM, ""},
		{"chain cut in its intermediate", chain[:len(chain)-100], server.KeyPEM, ca.PEM, "--tls-cert " + f.cert + ": line " + strconv.Itoa(leafLines) + ": not a whole PEM block"},
		{"chain cut after a dash", chain[:len(server.CertPEM)+3], server.KeyPEM, ca.PEM, "--tls-cert " + f.cert + ": line " + strconv.Itoa(leafLines) + ": not a whole PEM block"},
		{"leaf cut", server.CertPEM[:100], server.KeyPEM, ca.PEM, "--tls-cert " + f.cert + ": line 1: not a whole PEM block"},
		{"key cut", server.CertPEM, server.KeyPEM[:len(server.KeyPEM)-30], ca.PEM, "--tls-key " + f.key + ": tls: failed to find any PEM data in key input"},
		{"text after the chain", append(append([]byte{}, chain...), "subject=CN=x\n"...), server.KeyPEM, ca.PEM, "not a whole PEM block"},
		{"CA bundle cut in its BEGIN line", server.CertPEM, server.KeyPEM, two[:len(ca.PEM)+7], "--client-ca " + f.ca + ": line " + strconv.Itoa(caLines) + ": not a whole PEM block"},
		{"CA bundle cut in its first certificate", server.CertPEM, server.KeyPEM, ca.PEM[:len(ca.PEM)-40], "--client-ca " + f.ca + ": line 1: not a whole PEM block"},
		{"CA bundle with a broken block before a whole one", server.CertPEM, server.KeyPEM, append(append([]byte{}, ca.PEM[:len(ca.PEM)-40]...), inter.PEM...), "--client-ca " + f.ca + ": line 1: not a whole PEM block"},
		{"CA bundle with text before", server.CertPEM, server.KeyPEM, append([]byte("# our CAs\n"), two...), "--client-ca " + f.ca + ": line 1: not a whole PEM block"},
		{"CA bundle with a key", server.CertPEM, server.KeyPEM, append(append([]byte{}, ca.PEM...), server.KeyPEM...), "--client-ca " + f.ca + ": line " + strconv.Itoa(caLines) + ": a PEM block of type \"PRIVATE KEY\", want CERTIFICATE"},
		{"CA bundle with a certificate that does not parse", server.CertPEM, server.KeyPEM, append(append([]byte{}, ca.PEM...), badDER...), "--client-ca " + f.ca + ": line " + strconv.Itoa(caLines) + ": x509: "},
		{"CA bundle of white space", server.CertPEM, server.KeyPEM, []byte("\n\n"), "--client-ca " + f.ca + " holds no PEM certificate"},
		{"CA file that is not PEM", server.CertPEM, server.KeyPEM, der.Bytes, "--client-ca " + f.ca + " holds no PEM certificate"},
		{"certificate file that is not PEM", []byte("junk\n"), server.KeyPEM, ca.PEM, "--tls-cert " + f.cert + ", --tls-key " + f.key + ": tls: failed to find any PEM data in certificate input"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			write := func() {
				authtest.WriteFile(t, f.cert, tc.cert)
				authtest.WriteFile(t, f.key, tc.key)
				authtest.WriteFile(t, f.ca, tc.cas)
			}
			write()
			_, err := LoadCerts(f.cert, f.key, f.ca)
			check := func(when string, err error) {
				t.Helper()
				if tc.want == "" && err != nil {
					t.Errorf("%s: %v", when, err)
				}
				if tc.want != "" && (!errors.Is(err, ErrCertificate) || !strings.Contains(err.Error(), tc.want)) {
					t.Errorf("%s: %v, want %q", when, err, tc.want)
				}
			}
			check("at start", err)

			authtest.WriteFile(t, f.cert, server.CertPEM)
			authtest.WriteFile(t, f.key, server.KeyPEM)
			authtest.WriteFile(t, f.ca, ca.PEM)
			c, err := LoadCerts(f.cert, f.key, f.ca)
			if err != nil {
				t.Fatal(err)
			}
			write()
			check("on reload", c.Reload())
			if tc.want != "" && c.Leaf().SerialNumber.Cmp(server.TLS(t).Leaf.SerialNumber) != 0 {
				t.Error("a refused reload changed the server certificate")
			}
		})
	}
}

// TestCertsTooManyNames: a client certificate with more than MaxCertNames
// names is refused, before its names are worked out. Names drops
// duplicates with a map: it once did with slices.Contains, quadratic in
// the names, and a certificate with 20,000 DNS SANs (150 KB, within what
// crypto/tls takes) cost about a second of CPU on every new connection.
func TestCertsTooManyNames(t *testing.T) {
	ca := authtest.NewCA(t, "ca")
	c, _ := loadMTLS(t, ca)
	dns := func(n int) []string {
		names := make([]string, n)
		for i := range names {
			names[i] = "n" + strconv.Itoa(i)
		}
		return names
	}
	for _, tc := range []struct {
		name string
		cn   string
		dns  []string
		want int // names; 0 when refused
	}{
		{"the most names", "n0", dns(MaxCertNames - 1), MaxCertNames - 1},
		{"the most names, no CN", "", dns(MaxCertNames), MaxCertNames},
		{"one more", "cn", dns(MaxCertNames), 0},
		{"one more, counted as written", "n0", append(dns(MaxCertNames-1), "n1"), 0},
		{"many", "n0", dns(3000), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, _, err := handshake(t, c, clientConfig(ca, ca.Node(t, tc.cn, tc.dns...).TLS(t)))
			if err != nil {
				t.Fatal(err)
			}
			id, err := c.Identify(p)
			if tc.want > 0 {
				if err != nil || len(id.Names) != tc.want {
					t.Fatalf("identity %v, %v; want %d names", id, err, tc.want)
				}
				return
			}
			n := len(tc.dns)
			if tc.cn != "" {
				n++
			}
			want := "the client certificate has " + strconv.Itoa(n) + " names (Subject CN and DNS SANs), more than the 64 a certificate may have"
			if id != nil || !errors.Is(err, ErrTooManyNames) || !errors.Is(err, ErrUntrusted) || err.Error() != want {
				t.Fatalf("identity %v, %v; want %q", id, err, want)
			}
			if _, err2 := c.Identify(p); err2 != err {
				t.Errorf("the refusal is not kept: %v", err2)
			}
		})
	}
	// Names still takes any certificate (a map drops the duplicates).
	cert := ca.Node(t, "n0", dns(20000)...).TLS(t).Leaf
	if names := Names(cert); len(names) != 20000 || names[0] != "n0" || names[19999] != "n19999" {
		t.Errorf("Names of 20,000 names: %d names", len(names))
	}
}

// TestCertsExpiry: Identify checks a client certificate's expiry on every
// call, where the handshake checked it once: a connection made before
// the certificate's NotAfter and kept busy is refused after it, and so is
// one whose CA certificate expires first. The verification stays cached.
// The time is a testing/synctest bubble's fake clock: time.Sleep moves it
// at once.
func TestCertsExpiry(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		ca := authtest.NewCA(t, "ca") // valid for 24 hours
		c, _ := loadMTLS(t, ca)
		short := ca.NodeUntil(t, start.Add(time.Hour), "node-a").TLS(t)
		long := ca.NodeUntil(t, start.Add(48*time.Hour), "node-b").TLS(t)
		pa, _, err := handshake(t, c, clientConfig(ca, short))
		if err != nil {
			t.Fatal(err)
		}
		pb, _, err := handshake(t, c, clientConfig(ca, long))
		if err != nil {
			t.Fatal(err)
		}
		ida, err := c.Identify(pa)
		if err != nil || !ida.Expires.Equal(start.Add(time.Hour)) {
			t.Fatalf("node-a: %+v %v", ida, err)
		}
		if idb, err := c.Identify(pb); err != nil || !idb.Expires.Equal(ca.Cert.NotAfter) {
			t.Fatalf("node-b, whose CA expires first: %+v %v", idb, err)
		}
		checked := pa.checked.Load()

		time.Sleep(time.Hour) // at NotAfter: still valid
		if id, err := c.Identify(pa); err != nil || id != ida {
			t.Fatalf("at NotAfter: %+v %v", id, err)
		}
		time.Sleep(time.Second)
		wantA := "the client certificate expired at " + start.Add(time.Hour).UTC().Format(time.RFC3339)
		id, err := c.Identify(pa)
		if id != nil || !errors.Is(err, ErrExpired) || !errors.Is(err, ErrUntrusted) || err.Error() != wantA {
			t.Fatalf("a second after NotAfter: %+v %v, want %q", id, err, wantA)
		}
		if pa.checked.Load() != checked {
			t.Error("the certificate was verified again")
		}
		// A reload verifies it again, under the CA read again: refused
		// the same.
		if err := c.Reload(); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Identify(pa); !errors.Is(err, ErrExpired) || err.Error() != wantA {
			t.Fatalf("after a reload: %v, want %q", err, wantA)
		}
		if idb, err := c.Identify(pb); err != nil || !idb.Expires.Equal(ca.Cert.NotAfter) {
			t.Fatalf("node-b after a reload: %+v %v", idb, err)
		}

		time.Sleep(time.Until(ca.Cert.NotAfter) + time.Second)
		wantB := "the client certificate's CA certificate \"ca\" expired at " + ca.Cert.NotAfter.UTC().Format(time.RFC3339)
		if _, err := c.Identify(pb); !errors.Is(err, ErrExpired) || !errors.Is(err, ErrUntrusted) || err.Error() != wantB {
			t.Fatalf("after the CA expired: %v, want %q", err, wantB)
		}
	})
}
