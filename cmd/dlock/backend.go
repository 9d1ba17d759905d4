package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/spf13/pflag"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/etcd"
	"github.com/dlock/dlock/lock/memory"
)

// etcdConfig is how `dlock serve --backend etcd` reaches its etcd cluster
// (docs/HA.md).
type etcdConfig struct {
	endpoints     string
	prefix        string
	ca, cert, key string
	dialTimeout   time.Duration
}

func (e *etcdConfig) flags(fs *pflag.FlagSet) {
	fs.StringVar(&e.endpoints, "etcd-endpoints", "", "with --backend etcd: the etcd cluster's client URLs, comma-separated (http://HOST:2379,…; https:// with --etcd-ca)")
	fs.StringVar(&e.prefix, "etcd-prefix", etcd.DefaultPrefix, "with --backend etcd: the key prefix of this lock service's data set; servers that share it are one lock service")
	fs.StringVar(&e.ca, "etcd-ca", "", "with --backend etcd: CA certificates (PEM) that sign the etcd servers' certificates")
	fs.StringVar(&e.cert, "etcd-cert", "", "with --backend etcd: client certificate (PEM) for etcd")
	fs.StringVar(&e.key, "etcd-key", "", "with --backend etcd: the private key (PEM) of --etcd-cert")
	fs.DurationVar(&e.dialTimeout, "etcd-dial-timeout", 5*time.Second, "with --backend etcd: how long the first connection to etcd may take")
}

func (e *etcdConfig) set() bool {
	return e.endpoints != "" || e.ca != "" || e.cert != "" || e.key != "" || (e.prefix != "" && e.prefix != etcd.DefaultPrefix)
}

func (e *etcdConfig) list() []string {
	var out []string
	for _, s := range strings.Split(e.endpoints, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}

func (e *etcdConfig) validate() error {
	eps := e.list()
	if len(eps) == 0 {
		return errors.New("--backend etcd needs --etcd-endpoints")
	}
	for _, ep := range eps {
		u, err := url.Parse(ep)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("--etcd-endpoints: %q is not an http:// or https:// URL", ep)
		}
		if u.Scheme == "https" && e.ca == "" {
			return fmt.Errorf("--etcd-endpoints: %s needs --etcd-ca", ep)
		}
	}
	if (e.cert == "") != (e.key == "") {
		return errors.New("--etcd-cert and --etcd-key go together")
	}
	if e.prefix == "" || !strings.HasPrefix(e.prefix, "/") {
		return fmt.Errorf("--etcd-prefix must begin with /, not %q", e.prefix)
	}
	if e.dialTimeout <= 0 {
		return errors.New("--etcd-dial-timeout must be positive")
	}
	return nil
}

func (e *etcdConfig) tls() (*tls.Config, error) {
	if e.ca == "" && e.cert == "" {
		return nil, nil
	}
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if e.ca != "" {
		pem, err := os.ReadFile(e.ca)
		if err != nil {
			return nil, fmt.Errorf("--etcd-ca: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--etcd-ca: %s has no PEM certificate", e.ca)
		}
		tc.RootCAs = pool
	}
	if e.cert != "" {
		c, err := tls.LoadX509KeyPair(e.cert, e.key)
		if err != nil {
			return nil, fmt.Errorf("--etcd-cert/--etcd-key: %w", err)
		}
		tc.Certificates = []tls.Certificate{c}
	}
	return tc, nil
}

// openBackend opens the lock state the configuration names.
// mem is the memory engine's configuration, with its stores opened.
func openBackend(ctx context.Context, c serveConfig, mem memory.Config, log *slog.Logger) (lock.Backend, func(), error) {
	if c.backend != "etcd" {
		m, err := memory.New(ctx, mem)
		if err != nil {
			return nil, nil, err
		}
		return m, func() { m.Close() }, nil
	}
	tc, err := c.etcd.tls()
	if err != nil {
		return nil, nil, err
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   c.etcd.list(),
		DialTimeout: c.etcd.dialTimeout,
		TLS:         tc,
		Logger:      zap.NewNop(), // its failures reach dlock's log as errors of the calls
		Context:     ctx,
	})
	if err != nil {
		return nil, nil, fmt.Errorf("etcd: %w", err)
	}
	// etcd without quorum for a moment (a leader's failure, an election)
	// answers "request timed out" or "no leader": a server started then,
	// by its supervisor say, waits for the cluster within the bound rather
	// than exiting.
	octx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cfg := etcd.Config{Rules: c.rules, Prefix: c.etcd.prefix, RefCounting: c.refcount == "server", Logger: log}
	var b *etcd.Backend
	for {
		b, err = etcd.New(octx, cli, cfg)
		if err == nil || !errors.Is(err, lock.ErrUnavailable) || octx.Err() != nil {
			break
		}
		log.Warn("etcd not ready; trying again", "err", err)
		select {
		case <-octx.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
	if err != nil {
		cli.Close()
		return nil, nil, fmt.Errorf("opening the lock state in etcd (%s): %w", c.etcd.endpoints, err)
	}
	log.Info("lock state in etcd", "endpoints", c.etcd.endpoints, "prefix", c.etcd.prefix, "epoch", b.Info().Epoch)
	return b, func() { b.Close(); cli.Close() }, nil
}
