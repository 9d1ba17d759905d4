package dlocktest

import (
	"crypto/x509"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/dlock/dlock/internal/auth/authtest"
)

// PKI is a certificate authority made for one test (authtest.CA), writing
// its certificates and keys as PEM files into a temporary folder: what an
// operator hands to `dlock serve --tls-cert --tls-key --client-ca` and to
// a client's --ca, --cert and --key. Start serves HTTPS with it given
// Options.Auth. Its certificates are valid from an hour before they are
// made to a day after: inside a testing/synctest bubble, make it in the
// bubble.
type PKI struct {
	t   testing.TB
	dir string
	// CAFile is the CA's certificate.
	CAFile string
	// Pool holds the CA's certificate.
	Pool *x509.CertPool

	ca     *authtest.CA
	issued int // server certificates issued, for names of their own
}

// NewPKI makes a new CA.
func NewPKI(t testing.TB) *PKI {
	t.Helper()
	ca := authtest.NewCA(t, "dlock test CA")
	p := &PKI{t: t, dir: t.TempDir(), ca: ca, Pool: ca.Pool()}
	p.CAFile = filepath.Join(p.dir, "ca.crt")
	authtest.WriteFile(t, p.CAFile, ca.PEM)
	return p
}

// ServerCert issues a server certificate for 127.0.0.1, localhost and
// dlock.test (the host of an InMemory Server), in files of its own.
func (p *PKI) ServerCert() (certFile, keyFile string) {
	p.t.Helper()
	p.issued++
	return p.ca.Server(p.t, inMemoryHost).Write(p.t, p.dir, fmt.Sprint("server-", p.issued))
}

// ClientCert issues node's client certificate: Subject CN node, and the
// other nodes it may act as, if any, as DNS SANs.
func (p *PKI) ClientCert(node string, others ...string) (certFile, keyFile string) {
	p.t.Helper()
	return p.ca.Node(p.t, node, others...).Write(p.t, p.dir, "client-"+node)
}
