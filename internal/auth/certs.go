package auth

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// ErrCertificate is a certificate, key or CA file that cannot be used.
var ErrCertificate = errors.New("certificate")

// Errors of Certs.Identify.
var (
	// ErrNoCertificate is a connection without a client certificate.
	ErrNoCertificate = errors.New("no client certificate")
	// ErrUntrusted is a client certificate that the current client CA
	// does not sign (it did when the connection began).
	ErrUntrusted = errors.New("the client certificate is not signed by the current client CA")
	// ErrTooManyNames is a client certificate with more than MaxCertNames
	// names; errors.Is(err, ErrUntrusted) holds too.
	ErrTooManyNames = errors.New("the client certificate has too many names")
	// ErrExpired is a client certificate, or a CA certificate of its
	// chain, past its NotAfter: the handshake checked it once, and a
	// connection may outlive it. errors.Is(err, ErrUntrusted) holds too.
	ErrExpired = errors.New("the client certificate expired")
)

// MaxCertNames is the most names (Subject CN and DNS SANs, as written) a
// client certificate may have: a certificate names its node, or a few
// (docs/SECURITY.md), and one with thousands of names would cost every
// request's check of them.
const MaxCertNames = 64

// refusal is an error of Identify that errors.Is ErrUntrusted and kind,
// with a message of its own.
type refusal struct {
	kind error
	msg  string
}

func (e *refusal) Error() string { return e.msg }

func (e *refusal) Is(target error) bool { return target == ErrUntrusted || target == e.kind }

// Certs is the server's TLS configuration read from files: its
// certificate and key, and optionally the CA that signs client
// certificates (mTLS). Reload reads them again; connections made after it
// use the new files.
type Certs struct {
	certFile, keyFile, caFile string
	mu                        sync.Mutex // serialises Reload
	cur                       atomic.Pointer[certState]
	outer                     *tls.Config
}

// certState is one reading of the files.
type certState struct {
	config *tls.Config
	leaf   *x509.Certificate
	// roots is the client CA pool, nil without mTLS.
	roots *x509.CertPool
}

// LoadCerts reads the server's certificate chain and key (PEM) and, when
// caFile is not empty, the CA certificates (PEM) that client certificates
// must chain to.
func LoadCerts(certFile, keyFile, caFile string) (*Certs, error) {
	c := &Certs{certFile: certFile, keyFile: keyFile, caFile: caFile}
	st, err := c.read()
	if err != nil {
		return nil, err
	}
	c.cur.Store(st)
	// The listener's configuration only picks the current one: a
	// handshake reads the files' latest good reading.
	c.outer = &tls.Config{
		MinVersion: tls.VersionTLS12,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			return c.cur.Load().config, nil
		},
	}
	return c, nil
}

// Reload reads the files again. On an error the old certificates stay.
func (c *Certs) Reload() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	st, err := c.read()
	if err != nil {
		return err
	}
	c.cur.Store(st)
	return nil
}

// Config is the configuration to serve TLS with. A client certificate is
// asked for and verified when one is sent, but not required by the
// handshake: the HTTP layer answers its absence with 401 (so GET /healthz
// stays open to probes that have no certificate).
func (c *Certs) Config() *tls.Config { return c.outer }

// ClientAuth reports whether client certificates are checked (mTLS).
func (c *Certs) ClientAuth() bool { return c.caFile != "" }

// Leaf is the server's current certificate.
func (c *Certs) Leaf() *x509.Certificate { return c.cur.Load().leaf }

func (c *Certs) read() (*certState, error) {
	pairErr := func(err error) error {
		return fmt.Errorf("%w: --tls-cert %s, --tls-key %s: %w", ErrCertificate, c.certFile, c.keyFile, err)
	}
	certPEM, err := os.ReadFile(c.certFile)
	if err != nil {
		return nil, pairErr(err)
	}
	// tls.X509KeyPair skips what follows the last whole PEM block, so a
	// chain cut in its intermediate would serve the leaf alone.
	if _, err := pemCerts(certPEM, true); err != nil {
		return nil, fmt.Errorf("%w: --tls-cert %s: %w", ErrCertificate, c.certFile, err)
	}
	keyPEM, err := os.ReadFile(c.keyFile)
	if err != nil {
		return nil, pairErr(err)
	}
	kp, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, pairErr(err)
	}
	leaf := kp.Leaf
	if now := time.Now(); now.After(leaf.NotAfter) {
		return nil, fmt.Errorf("%w: --tls-cert %s expired at %s", ErrCertificate, c.certFile, leaf.NotAfter.UTC().Format(time.RFC3339))
	}
	st := &certState{leaf: leaf}
	st.config = &tls.Config{
		MinVersion:   tls.VersionTLS12,
		Certificates: []tls.Certificate{kp},
		// The lean loop serves HTTP/1.1; net/http serves h2.
		NextProtos: []string{"h2", "http/1.1"},
	}
	if c.caFile != "" {
		caPEM, err := os.ReadFile(c.caFile)
		if err != nil {
			return nil, fmt.Errorf("%w: --client-ca: %w", ErrCertificate, err)
		}
		cas, err := pemCerts(caPEM, false)
		if err != nil {
			return nil, fmt.Errorf("%w: --client-ca %s: %w", ErrCertificate, c.caFile, err)
		}
		if len(cas) == 0 {
			return nil, fmt.Errorf("%w: --client-ca %s holds no PEM certificate", ErrCertificate, c.caFile)
		}
		st.roots = x509.NewCertPool()
		for _, ca := range cas {
			st.roots.AddCert(ca)
		}
		st.config.ClientCAs = st.roots
		st.config.ClientAuth = tls.VerifyClientCertIfGiven
	}
	return st, nil
}

// pemCerts reads a file of PEM certificates: every PEM block must be a
// certificate that parses (or, with keys, a private key, for a certificate
// file that holds its key too), and nothing but white space may lie
// outside the blocks. A file caught half-written (written in place, not
// renamed into place; docs/SECURITY.md) ends in a cut block, which
// x509.CertPool.AppendCertsFromPEM and tls.X509KeyPair skip: the
// certificates cut off would be dropped without a word. Errors name the
// line. A file with no PEM block at all, not PEM or not a certificate
// file, is no certificates and no error: the caller says so.
func pemCerts(data []byte, keys bool) ([]*x509.Certificate, error) {
	if !bytes.Contains(data, pemBegin) {
		return nil, nil
	}
	var certs []*x509.Certificate
	for i := 0; ; {
		for i < len(data) && asciiSpace(data[i]) {
			i++
		}
		if i == len(data) {
			return certs, nil
		}
		line := 1 + bytes.Count(data[:i], []byte("\n"))
		// pem.Decode skips anything that is not a whole block, a cut one
		// included: the block decoded must be the one at i.
		block, rest := pem.Decode(data[i:])
		end := len(data) - len(rest)
		if block == nil || !bytes.HasPrefix(data[i:], pemBegin) || bytes.LastIndex(data[i:end], pemBegin) != 0 {
			return nil, fmt.Errorf("line %d: not a whole PEM block: the file was cut short (written in place, or caught half-written? write it whole and rename it into place), or holds text outside its PEM blocks", line)
		}
		i = end
		switch {
		case block.Type == "CERTIFICATE":
			cert, err := x509.ParseCertificate(block.Bytes)
			if err != nil {
				return nil, fmt.Errorf("line %d: %w", line, err)
			}
			certs = append(certs, cert)
		case keys && strings.HasSuffix(block.Type, "PRIVATE KEY"):
		default:
			return nil, fmt.Errorf("line %d: a PEM block of type %q, want CERTIFICATE", line, block.Type)
		}
	}
}

var pemBegin = []byte("-----BEGIN ")

func asciiSpace(b byte) bool {
	return b == ' ' || b == '\t' || b == '\n' || b == '\r' || b == '\v' || b == '\f'
}

// CertIdentity is who a verified client certificate says a client is.
type CertIdentity struct {
	// Names are the certificate's Subject common name and DNS SANs.
	Names []string
	// Expires is when the certificate, or a CA certificate of its
	// verified chain, stops being valid: Identify refuses it after that
	// (docs/SECURITY.md), and what the certificate opened, an event
	// stream, should end then.
	Expires time.Time
}

// Operator reports whether the certificate names the operator, "*".
func (id *CertIdentity) Operator() bool { return slices.Contains(id.Names, Operator) }

// MayActAs reports whether the certificate names node (exactly: no
// wildcard matching, no case folding; node ids are byte strings).
func (id *CertIdentity) MayActAs(node string) bool {
	return id.Operator() || slices.Contains(id.Names, node)
}

// Names returns the node names of a certificate: its Subject common name
// and its DNS SANs, each once, in that order.
func Names(cert *x509.Certificate) []string {
	names := make([]string, 0, 1+len(cert.DNSNames))
	seen := make(map[string]bool, 1+len(cert.DNSNames))
	add := func(n string) {
		if !seen[n] {
			seen[n] = true
			names = append(names, n)
		}
	}
	if cert.Subject.CommonName != "" {
		add(cert.Subject.CommonName)
	}
	for _, n := range cert.DNSNames {
		add(n)
	}
	return names
}

// nameCount is the number of names of a certificate as written, the same
// name twice counted twice.
func nameCount(cert *x509.Certificate) int {
	n := len(cert.DNSNames)
	if cert.Subject.CommonName != "" {
		n++
	}
	return n
}

// Peer is one connection's client certificate. Its identity is worked out
// once per client CA: when a reload changes the CA, the next request on
// the connection checks the certificate against the new one, so a
// keep-alive connection does not outlive its CA's trust.
type Peer struct {
	leaf          *x509.Certificate
	intermediates *x509.CertPool
	// roots verified the certificate in the handshake; nil when unknown.
	roots *x509.CertPool
	// ends is the certificate of the handshake's verified chains whose
	// NotAfter ends their validity (see chainEnd).
	ends    *x509.Certificate
	checked atomic.Pointer[peerCheck]
}

// peerCheck is a verification of a Peer under one client CA, kept until
// a reload replaces the CA.
type peerCheck struct {
	roots *x509.CertPool
	id    *CertIdentity
	// ends is the certificate whose NotAfter ends the verified chain's
	// validity; nil with err.
	ends *x509.Certificate
	err  error
}

// NewPeer takes the client certificate of a finished handshake; nil when
// the client sent none or the handshake did not verify it. Which CA
// verified it is not known: Identify verifies it again, once.
func NewPeer(st *tls.ConnectionState) *Peer {
	if st == nil || len(st.PeerCertificates) == 0 || len(st.VerifiedChains) == 0 {
		return nil
	}
	p := &Peer{leaf: st.PeerCertificates[0], ends: chainEnd(st.VerifiedChains)}
	if len(st.PeerCertificates) > 1 {
		p.intermediates = x509.NewCertPool()
		for _, c := range st.PeerCertificates[1:] {
			p.intermediates.AddCert(c)
		}
	}
	return p
}

// Handshake runs the server side of tc's handshake and returns the
// client certificate's Peer, nil when the client sent none. When no
// reload ran meanwhile, the CA that verified the certificate is known and
// Identify need not verify it again.
func (c *Certs) Handshake(ctx context.Context, tc *tls.Conn) (*Peer, error) {
	before := c.cur.Load()
	if err := tc.HandshakeContext(ctx); err != nil {
		return nil, err
	}
	st := tc.ConnectionState()
	p := NewPeer(&st)
	// GetConfigForClient read c.cur between the two loads, and every
	// reload stores a new pointer: the same pointer means its roots.
	if p != nil && c.cur.Load() == before {
		p.roots = before.roots
	}
	return p, nil
}

// Identify returns the identity of p's certificate under the current
// client CA: ErrNoCertificate for a nil p, ErrUntrusted when the current
// CA does not sign it (a reload replaced the CA since the handshake), an
// error that is ErrTooManyNames and ErrUntrusted when it has more than
// MaxCertNames names, one that is ErrExpired and ErrUntrusted once it or
// a CA certificate of its chain expired. The certificate is verified once
// per client CA; its expiry is checked on every call.
func (c *Certs) Identify(p *Peer) (*CertIdentity, error) {
	if p == nil {
		return nil, ErrNoCertificate
	}
	roots := c.cur.Load().roots
	ch := p.checked.Load()
	if ch == nil || ch.roots != roots {
		ch = p.check(roots)
		p.checked.Store(ch)
	}
	if ch.err != nil {
		return nil, ch.err
	}
	// The handshake checked the validity once; a connection that is kept
	// busy outlives it (docs/SECURITY.md).
	if time.Now().After(ch.ends.NotAfter) {
		return nil, expired(p.leaf, ch.ends)
	}
	return ch.id, nil
}

// check verifies p under roots.
func (p *Peer) check(roots *x509.CertPool) *peerCheck {
	ch := &peerCheck{roots: roots}
	if n := nameCount(p.leaf); n > MaxCertNames {
		ch.err = &refusal{ErrTooManyNames, fmt.Sprintf("the client certificate has %d names (Subject CN and DNS SANs), more than the %d a certificate may have", n, MaxCertNames)}
		return ch
	}
	ch.ends = p.ends
	if p.roots != roots {
		chains, err := p.leaf.Verify(x509.VerifyOptions{
			Roots:         roots,
			Intermediates: p.intermediates,
			KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		})
		var invalid x509.CertificateInvalidError
		switch {
		case errors.As(err, &invalid) && invalid.Reason == x509.Expired && invalid.Cert != nil && time.Now().After(invalid.Cert.NotAfter):
			ch.err = expired(p.leaf, invalid.Cert)
			return ch
		case err != nil:
			ch.err = ErrUntrusted
			return ch
		}
		ch.ends = chainEnd(chains)
	}
	if ch.ends == nil { // no chain, which crypto/tls does not verify
		ch.ends = p.leaf
	}
	ch.id = &CertIdentity{Names: Names(p.leaf), Expires: ch.ends.NotAfter}
	return ch
}

// chainEnd returns the certificate whose NotAfter ends the validity of
// chains: each chain is valid until its first certificate expires, and
// the certificate is valid as long as one of its chains is.
func chainEnd(chains [][]*x509.Certificate) *x509.Certificate {
	var end *x509.Certificate
	for _, chain := range chains {
		var first *x509.Certificate
		for _, c := range chain {
			if first == nil || c.NotAfter.Before(first.NotAfter) {
				first = c
			}
		}
		if end == nil || first != nil && first.NotAfter.After(end.NotAfter) {
			end = first
		}
	}
	return end
}

// expired is the ErrExpired refusal of leaf, whose chain ended when cert
// expired.
func expired(leaf, cert *x509.Certificate) error {
	at := cert.NotAfter.UTC().Format(time.RFC3339)
	if cert == leaf || cert.Equal(leaf) {
		return &refusal{ErrExpired, fmt.Sprintf("the client certificate expired at %s", at)}
	}
	name := cert.Subject.CommonName
	if name == "" {
		name = cert.Subject.String()
	}
	return &refusal{ErrExpired, fmt.Sprintf("the client certificate's CA certificate %q expired at %s", name, at)}
}
