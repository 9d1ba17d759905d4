package dlocktest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// PKI is a certificate authority made for one test, writing its
// certificates and keys as PEM files into a temporary folder: what an
// operator hands to `dlock serve --tls-cert --tls-key --client-ca` and to
// a client's --ca, --cert and --key. Start serves HTTPS with it given
// Options.Auth. Its certificates are valid from an hour before NewPKI to a
// day after: inside a testing/synctest bubble, make it in the bubble.
type PKI struct {
	t   testing.TB
	dir string
	// CAFile is the CA's certificate.
	CAFile string
	// Pool holds the CA's certificate.
	Pool *x509.CertPool

	ca     *x509.Certificate
	caKey  *ecdsa.PrivateKey
	serial int64
}

// NewPKI makes a new CA.
func NewPKI(t testing.TB) *PKI {
	t.Helper()
	key := newKey(t)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "dlock test CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	p := &PKI{t: t, dir: t.TempDir(), ca: ca, caKey: key, serial: 1, Pool: x509.NewCertPool()}
	p.Pool.AddCert(ca)
	p.CAFile = p.write("ca.pem", "CERTIFICATE", der)
	return p
}

func newKey(t testing.TB) *ecdsa.PrivateKey {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return key
}

func (p *PKI) write(name, typ string, der []byte) string {
	path := filepath.Join(p.dir, name)
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		p.t.Fatal(err)
	}
	return path
}

// issue signs a certificate and writes it and its key as name.pem and
// name-key.pem.
func (p *PKI) issue(name string, tmpl *x509.Certificate) (certFile, keyFile string) {
	p.t.Helper()
	key := newKey(p.t)
	p.serial++
	tmpl.SerialNumber = big.NewInt(p.serial)
	tmpl.NotBefore = time.Now().Add(-time.Hour)
	tmpl.NotAfter = time.Now().Add(24 * time.Hour)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.ca, &key.PublicKey, p.caKey)
	if err != nil {
		p.t.Fatal(err)
	}
	kder, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		p.t.Fatal(err)
	}
	return p.write(name+".pem", "CERTIFICATE", der), p.write(name+"-key.pem", "PRIVATE KEY", kder)
}

// ServerCert issues a server certificate for 127.0.0.1, localhost and
// dlock.test (the host of an InMemory Server).
func (p *PKI) ServerCert() (certFile, keyFile string) { return p.serverCert("server") }

func (p *PKI) serverCert(name string) (certFile, keyFile string) {
	return p.issue(name, &x509.Certificate{
		Subject:     pkix.Name{CommonName: "dlock server"},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		DNSNames:    []string{"localhost", inMemoryHost},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	})
}

// ClientCert issues node's client certificate: Subject CN node, and the
// other nodes it may act as, if any, as DNS SANs.
func (p *PKI) ClientCert(node string, others ...string) (certFile, keyFile string) {
	return p.issue("client-"+node, &x509.Certificate{
		Subject:     pkix.Name{CommonName: node},
		DNSNames:    others,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
}
