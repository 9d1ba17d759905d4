package main

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"syscall"

	"github.com/dlock/dlock/internal/auth"
	"github.com/dlock/dlock/server"
)

// credConfig is where dlock serve reads its credentials (docs/SECURITY.md).
type credConfig struct {
	tokenFile string
	tlsCert   string
	tlsKey    string
	clientCA  string
}

func (c credConfig) validate() error {
	if (c.tlsCert == "") != (c.tlsKey == "") {
		return errors.New("--tls-cert and --tls-key go together")
	}
	if c.clientCA != "" && c.tlsCert == "" {
		return errors.New("--client-ca needs --tls-cert and --tls-key: client certificates are checked in the TLS handshake")
	}
	return nil
}

// load reads the credentials; a missing or unusable file stops start-up.
// A token never reaches the log: errors name the file and the line.
func (c credConfig) load(log *slog.Logger) (*auth.Tokens, *auth.Certs, error) {
	var tokens *auth.Tokens
	var certs *auth.Certs
	if c.tokenFile != "" {
		var err error
		if tokens, err = auth.LoadTokens(c.tokenFile); err != nil {
			return nil, nil, fmt.Errorf("--token-file: %w", err)
		}
		if tokens.Len() == 0 {
			log.Warn("the token file has no tokens: every request but /healthz is answered 401", "path", c.tokenFile)
		}
		if fi, err := os.Stat(c.tokenFile); err == nil && fi.Mode().Perm()&0o077 != 0 {
			log.Warn("the token file can be read by other users; chmod 600 it", "path", c.tokenFile, "mode", fi.Mode().Perm().String())
		}
		if c.tlsCert == "" {
			log.Warn("bearer tokens travel in clear text without --tls-cert: anyone on the path can read and reuse them")
		}
	}
	if c.tlsCert != "" {
		var err error
		if certs, err = auth.LoadCerts(c.tlsCert, c.tlsKey, c.clientCA); err != nil {
			return nil, nil, err
		}
	}
	return tokens, certs, nil
}

// reloadOn re-reads the server's credentials on every SIGHUP (or on
// reload, when set) until the returned function is called. Without
// credentials a SIGHUP does nothing, instead of ending the process.
func reloadOn(reload <-chan os.Signal, srv *server.Server, log *slog.Logger) (stop func()) {
	unnotify := func() {}
	if reload == nil {
		ch := make(chan os.Signal, 1)
		signal.Notify(ch, syscall.SIGHUP)
		unnotify = func() { signal.Stop(ch) }
		reload = ch
	}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-reload:
				if err := srv.Reload(); err != nil {
					log.Error("reload failed; the last good credentials stay in use", "err", err)
				}
			case <-done:
				return
			}
		}
	})
	return func() {
		close(done)
		wg.Wait()
		unnotify()
	}
}
