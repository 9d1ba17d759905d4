package client

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"
)

var (
	// ErrBadCredentials is a credential file that cannot be used:
	// missing, unreadable, empty, or not what it should hold. The error
	// names the file and why, never a token.
	ErrBadCredentials = errors.New("dlock: bad credentials")
	// ErrNotHTTPS is a TLS configuration, a CA, a certificate or a key
	// for a plain http:// server: it would not be used, and the token
	// would cross the network in clear.
	ErrNotHTTPS = errors.New("dlock: TLS settings need an https:// server")
)

// CredentialFiles name the files a node's credentials are read from (docs/SECURITY.md):
// what the dlock commands and dlock-content take as --ca, --cert, --key and
// --token-file. A token is only ever read from a file, so that it never
// shows in a process's arguments.
type CredentialFiles struct {
	// CA is the PEM file of the CA that signed the server's certificate
	// ("": the system's roots).
	CA string
	// Cert and Key are the PEM files of this node's client certificate,
	// for a server that requires one; both or neither.
	Cert, Key string
	// TokenFile holds this node's bearer token (see ReadTokenFile).
	TokenFile string
}

// Load reads the files for a client of servers (http:// or https:// URLs,
// the Client's Server or Servers; all of one scheme): the TLS
// configuration, nil for http:// servers, and the token, "" without a
// TokenFile. Every file is read now: a missing, unreadable or unusable one
// is an error naming it, so that a command stops before its first request.
func (f CredentialFiles) Load(servers ...string) (*tls.Config, string, error) {
	if len(servers) == 0 {
		return nil, "", errors.New("dlock: no server given")
	}
	bases, err := parseServers(servers)
	if err != nil {
		return nil, "", err
	}
	var cfg *tls.Config
	switch {
	case bases[0].Scheme == "https":
		if cfg, err = TLSConfigFromFiles(f.CA, f.Cert, f.Key); err != nil {
			return nil, "", err
		}
	case f.CA != "" || f.Cert != "" || f.Key != "":
		return nil, "", fmt.Errorf("%w: a CA, certificate or key given for %s", ErrNotHTTPS, strings.Join(servers, ","))
	}
	var token string
	if f.TokenFile != "" {
		if token, err = ReadTokenFile(f.TokenFile); err != nil {
			return nil, "", err
		}
	}
	return cfg, token, nil
}

// ReadTokenFile reads a node's bearer token from a file (docs/SECURITY.md):
// the file holds one token, alone or as a server's token-file line
// "TOKEN NODE_ID", so that the line an operator adds to the server's file
// can be handed to the node as it is. Blank lines and lines starting with
// "#" are skipped; only the first field of the one remaining line is the
// token. The token is kept out of every error.
func ReadTokenFile(path string) (string, error) {
	token, _, err := ReadTokenLine(path)
	return token, err
}

// ReadTokenLine is ReadTokenFile that also returns the node id the line
// names after its token, as the server's token file reads it (the rest
// of the line, white space around it dropped): "" for a file that holds
// the token alone, "*" for an operator's line. A client whose node id
// was not set can take it from there, since the server accepts the
// token for that node only.
func ReadTokenLine(path string) (token, node string, err error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", "", fmt.Errorf("%w: token file: %w", ErrBadCredentials, err)
	}
	lines := 0
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		lines++
		token, node = line, ""
		if i := strings.IndexAny(line, " \t"); i >= 0 {
			token, node = line[:i], strings.TrimLeft(line[i+1:], " \t")
		}
	}
	if err := sc.Err(); err != nil {
		return "", "", fmt.Errorf("%w: token file %s: %w", ErrBadCredentials, path, err)
	}
	switch {
	case lines == 0:
		return "", "", fmt.Errorf("%w: token file %s holds no token", ErrBadCredentials, path)
	case lines > 1:
		return "", "", fmt.Errorf("%w: token file %s holds %d lines, a node's token file holds one token (is it the server's token file?)", ErrBadCredentials, path, lines)
	}
	if err := validToken(token); err != nil {
		return "", "", fmt.Errorf("%w: token file %s: %v", ErrBadCredentials, path, err)
	}
	return token, node, nil
}

// validToken checks that a token can travel in an Authorization header:
// printable ASCII without spaces. The message never quotes it.
func validToken(token string) error {
	for i := 0; i < len(token); i++ {
		if c := token[i]; c <= ' ' || c >= 0x7f {
			return fmt.Errorf("the token has a space, a control or a non-ASCII character at byte %d", i)
		}
	}
	return nil
}

// TLSConfigFromFiles builds the TLS configuration of a Client from PEM
// files: ca, the certificate authority that signed the server's
// certificate ("": the system's roots), and certFile and keyFile, this
// node's certificate and key for a server that requires one (mTLS; both
// or neither). Every file is read now, so a missing, unreadable or
// mismatched one is an error at start-up. The certificate and key are
// read again at a new connection's handshake when either file changed
// since, so a rotated certificate is used without a restart (the server
// re-reads its own on SIGHUP); a pair that fails to load then keeps the
// previous one in use.
func TLSConfigFromFiles(ca, certFile, keyFile string) (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if ca != "" {
		data, err := os.ReadFile(ca)
		if err != nil {
			return nil, fmt.Errorf("%w: CA file: %w", ErrBadCredentials, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(data) {
			return nil, fmt.Errorf("%w: CA file %s holds no PEM certificate", ErrBadCredentials, ca)
		}
		cfg.RootCAs = pool
	}
	switch {
	case certFile == "" && keyFile == "":
		return cfg, nil
	case certFile == "":
		return nil, fmt.Errorf("%w: a client key (%s) needs its certificate", ErrBadCredentials, keyFile)
	case keyFile == "":
		return nil, fmt.Errorf("%w: a client certificate (%s) needs its key", ErrBadCredentials, certFile)
	}
	kp := &keyPair{certFile: certFile, keyFile: keyFile}
	if err := kp.load(); err != nil {
		return nil, err
	}
	cfg.GetClientCertificate = kp.get
	return cfg, nil
}

// keyPair is a client certificate read from files, read again when they change.
type keyPair struct {
	certFile, keyFile string

	mu        sync.Mutex
	cert      *tls.Certificate
	certStamp fileStamp
	keyStamp  fileStamp
}

// fileStamp tells whether a file changed since it was read.
type fileStamp struct {
	mod  time.Time
	size int64
}

func stamp(path string) (fileStamp, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return fileStamp{}, err
	}
	return fileStamp{mod: fi.ModTime(), size: fi.Size()}, nil
}

// load reads the pair if either file changed since the last load.
func (kp *keyPair) load() error {
	cs, err := stamp(kp.certFile)
	if err != nil {
		return fmt.Errorf("%w: client certificate: %w", ErrBadCredentials, err)
	}
	ks, err := stamp(kp.keyFile)
	if err != nil {
		return fmt.Errorf("%w: client key: %w", ErrBadCredentials, err)
	}
	kp.mu.Lock()
	defer kp.mu.Unlock()
	if kp.cert != nil && cs == kp.certStamp && ks == kp.keyStamp {
		return nil
	}
	cert, err := tls.LoadX509KeyPair(kp.certFile, kp.keyFile)
	if err != nil {
		// tls says which of the two is wrong ("private key does not
		// match public key", "failed to find any PEM data in key input").
		return fmt.Errorf("%w: client certificate %s and key %s: %w", ErrBadCredentials, kp.certFile, kp.keyFile, err)
	}
	kp.cert, kp.certStamp, kp.keyStamp = &cert, cs, ks
	return nil
}

// get is the handshake's GetClientCertificate: the current pair, reloaded
// if it changed; the previous one if the new files do not load (a rotation
// caught half-written is read again at the next handshake).
func (kp *keyPair) get(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	_ = kp.load()
	kp.mu.Lock()
	defer kp.mu.Unlock()
	return kp.cert, nil
}
