// Package credflag is the credentials every dlock client command takes
// (dlock lock, unlock, status, refcount, run, bench and dlock-content):
// --ca, --cert, --key and --token-file, with the command's environment
// fallbacks (docs/SECURITY.md). A token is only ever read from a file, so
// that it never shows in a process's arguments.
package credflag

import (
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"net/url"

	"github.com/dlock/dlock/client"
)

// Flags are the credential flags of one command.
type Flags struct {
	CA, Cert, Key, TokenFile string
}

// Register adds the flags to fs.
func (f *Flags) Register(fs *flag.FlagSet) {
	fs.StringVar(&f.CA, "ca", "", "PEM file of the CA that signed the server's certificate, for an https:// server (default: the system's roots)")
	fs.StringVar(&f.Cert, "cert", "", "PEM file of this node's client certificate, for a server that requires one (with --key)")
	fs.StringVar(&f.Key, "key", "", "PEM file of the client certificate's private key (with --cert)")
	fs.StringVar(&f.TokenFile, "token-file", "", "file holding this node's bearer token (the token alone, or the server's \"TOKEN NODE_ID\" line)")
}

// ErrNeedHTTPS is a TLS flag given for a plain http:// server: the
// credentials would not be used, and the token would cross in clear.
var ErrNeedHTTPS = errors.New("--ca, --cert and --key need an https:// server")

// Load reads the files for a client of server: the TLS configuration (nil
// for a plain http:// server) and the token ("" without --token-file). A
// missing, unreadable or unusable file is an error naming it, so that a
// command stops before its first request.
func (f *Flags) Load(server string) (*tls.Config, string, error) {
	u, err := url.Parse(server)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, "", fmt.Errorf("server %q is not an http:// or https:// URL", server)
	}
	var cfg *tls.Config
	switch {
	case u.Scheme == "https":
		if cfg, err = client.TLSConfigFromFiles(f.CA, f.Cert, f.Key); err != nil {
			return nil, "", err
		}
	case f.CA != "" || f.Cert != "" || f.Key != "":
		return nil, "", fmt.Errorf("%w (server %s)", ErrNeedHTTPS, server)
	}
	var token string
	if f.TokenFile != "" {
		if token, err = client.ReadTokenFile(f.TokenFile); err != nil {
			return nil, "", err
		}
	}
	return cfg, token, nil
}

// Apply loads the credentials into c, for its Server.
func (f *Flags) Apply(c *client.Client) error {
	cfg, token, err := f.Load(c.Server)
	if err != nil {
		return err
	}
	c.TLSConfig, c.Token = cfg, token
	return nil
}
