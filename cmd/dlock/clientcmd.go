package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/internal/envflag"
	"github.com/dlock/dlock/lock"
)

// usageError is a bad command line: exit status 2.
type usageError struct{ error }

// exitStatus ends the process with a status and no further message.
type exitStatus int

func (e exitStatus) Error() string { return fmt.Sprintf("exit status %d", int(e)) }

// applyEnv sets every flag not given on the command line from DLOCK_<FLAG>.
func applyEnv(fs *flag.FlagSet, getenv func(string) string) error {
	return envflag.Apply(fs, "DLOCK", getenv)
}

// clientFlags are the flags every client subcommand takes.
type clientFlags struct {
	fs       *flag.FlagSet
	server   string
	node     string
	typ      string
	resource string
	human    bool
	source   string // --source-addr
	cred     *client.CredentialFiles
}

func newClientFlags(name, defaultNode string, stderr io.Writer) *clientFlags {
	f := &clientFlags{fs: flag.NewFlagSet("dlock "+name, flag.ContinueOnError)}
	f.fs.SetOutput(stderr)
	f.fs.StringVar(&f.server, "server", "http://127.0.0.1:7380", "dlock server URL; or the servers of one lock service, comma-separated (URL1,URL2,…): a request or stream that fails for its server moves to the next")
	f.fs.StringVar(&f.node, "node", defaultNode, "this node's id")
	f.fs.StringVar(&f.typ, "type", "pull", "operation type: pull, update, delete, or another name (with pull's rules and no reference rules)")
	f.fs.StringVar(&f.resource, "resource", "", "resource id, e.g. a blob digest")
	f.fs.BoolVar(&f.human, "human", false, "print a short line instead of JSON")
	f.fs.StringVar(&f.source, "source-addr", "", "local IP address every connection to the servers is dialed from (default: the system's choice)")
	f.cred = credentialFlags(f.fs)
	return f
}

// parse parses args with DLOCK_… fallbacks and returns the positional rest.
func (f *clientFlags) parse(args []string, getenv func(string) string, needResource bool) (client.Request, error) {
	if err := f.fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return client.Request{}, err
		}
		return client.Request{}, usageError{err}
	}
	if err := applyEnv(f.fs, getenv); err != nil {
		return client.Request{}, usageError{err}
	}
	t, err := lock.ParseType(f.typ)
	if err != nil {
		return client.Request{}, usageError{fmt.Errorf("--type: %w", err)}
	}
	if needResource && f.resource == "" {
		return client.Request{}, usageError{errors.New("--resource is required")}
	}
	if f.source != "" && net.ParseIP(f.source) == nil {
		return client.Request{}, usageError{fmt.Errorf("--source-addr %q: not an IP address", f.source)}
	}
	return client.Request{Type: t, Resource: f.resource}, nil
}

// client is the command's Client of the --server list, its credentials
// read: a missing or unusable credential file stops the command before
// any request.
func (f *clientFlags) client() (*client.Client, error) {
	servers := client.SplitServers(f.server)
	tlsConfig, token, err := loadCredentials(f.cred, servers...)
	if err != nil {
		return nil, err
	}
	c := &client.Client{Servers: servers, Node: f.node, TLSConfig: tlsConfig, Token: token}
	if f.source != "" {
		c.LocalAddr = &net.TCPAddr{IP: net.ParseIP(f.source)}
	}
	return c, nil
}

// credentialFlags adds --ca, --cert, --key and --token-file to fs.
func credentialFlags(fs *flag.FlagSet) *client.CredentialFiles {
	var f client.CredentialFiles
	fs.StringVar(&f.CA, "ca", "", "PEM file of the CA that signed the server's certificate, for an https:// server (default: the system's roots)")
	fs.StringVar(&f.Cert, "cert", "", "PEM file of this node's client certificate, for a server that requires one (with --key)")
	fs.StringVar(&f.Key, "key", "", "PEM file of the client certificate's private key (with --cert)")
	fs.StringVar(&f.TokenFile, "token-file", "", "file holding this node's bearer token: the token alone, or the server's \"TOKEN NODE_ID\" line")
	return &f
}

// loadCredentials reads the credential files for servers; TLS flags for
// plain http:// servers are a bad command line.
func loadCredentials(f *client.CredentialFiles, servers ...string) (*tls.Config, string, error) {
	tlsConfig, token, err := f.Load(servers...)
	if errors.Is(err, client.ErrNotHTTPS) {
		return nil, "", usageError{err}
	}
	return tlsConfig, token, err
}

func hostname() string {
	h, err := os.Hostname()
	if err != nil || h == "" {
		return "localhost"
	}
	return h
}

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	return enc.Encode(v)
}

func requestContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, time.Minute)
}

// cmdLock: one /lock with a ttl lease; run it again to renew.
func cmdLock(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	f := newClientFlags("lock", hostname(), stderr)
	skipRecent := f.fs.Bool("skip-recent", false, "answer skip when the key was just completed successfully")
	req, err := f.parse(args, getenv, true)
	if err != nil {
		return err
	}
	req.Lease, req.SkipRecent = lock.LeaseTTL, *skipRecent
	c, err := f.client()
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, cancel := requestContext(ctx)
	defer cancel()
	res, err := c.TryLock(ctx, req)
	if err != nil {
		return err
	}
	if !f.human {
		return printJSON(stdout, res)
	}
	k := lock.Key{Type: req.Type, Resource: req.Resource}
	switch {
	case res.Acquired:
		fmt.Fprintf(stdout, "acquired %s, token %d\n", k, res.Token)
	case res.Queued:
		fmt.Fprintf(stdout, "queued for %s at position %d behind %s\n", k, res.Position, res.Holder)
	default:
		fmt.Fprintf(stdout, "skip %s: just completed successfully\n", k)
	}
	return nil
}

func cmdUnlock(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	f := newClientFlags("unlock", hostname(), stderr)
	fail := f.fs.String("fail", "", "unlock as a failure with this message (the lock passes to the next waiter)")
	token := f.fs.Uint64("token", 0, "the grant's fencing token (0: not checked)")
	req, err := f.parse(args, getenv, true)
	if err != nil {
		return err
	}
	var opErr error
	if *fail != "" {
		opErr = errors.New(*fail)
	}
	c, err := f.client()
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, cancel := requestContext(ctx)
	defer cancel()
	res, err := c.Release(ctx, req, *token, opErr)
	if err != nil {
		return err
	}
	if !f.human {
		return printJSON(stdout, res)
	}
	k := lock.Key{Type: req.Type, Resource: req.Resource}
	if res.NextHolder != "" {
		fmt.Fprintf(stdout, "released %s; next holder %s\n", k, res.NextHolder)
	} else {
		fmt.Fprintf(stdout, "released %s; now free\n", k)
	}
	return nil
}

func cmdStatus(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	f := newClientFlags("status", hostname(), stderr)
	req, err := f.parse(args, getenv, true)
	if err != nil {
		return err
	}
	c, err := f.client()
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, cancel := requestContext(ctx)
	defer cancel()
	st, err := c.Status(ctx, req.Type, req.Resource)
	if err != nil {
		return err
	}
	if !f.human {
		return printJSON(stdout, st)
	}
	k := lock.Key{Type: req.Type, Resource: req.Resource}
	if st.State == "held" {
		fmt.Fprintf(stdout, "%s held by %s (token %d since %s), %d waiting", k, st.Holder, st.Token, st.AcquiredAt, st.QueueLength)
		if st.Position > 0 {
			fmt.Fprintf(stdout, ", %s at position %d", f.node, st.Position)
		}
	} else {
		fmt.Fprintf(stdout, "%s free", k)
	}
	if lc := st.LastCompleted; lc != nil {
		outcome := "succeeded"
		if !lc.Success {
			outcome = "failed: " + lc.Error
		}
		fmt.Fprintf(stdout, "; last %s by %s at %s", outcome, lc.NodeID, lc.CompletedAt.Format(time.RFC3339))
	}
	fmt.Fprintln(stdout)
	return nil
}

func cmdRefcount(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	f := newClientFlags("refcount", hostname(), stderr)
	add := f.fs.Bool("add", false, "record that this node uses the resource")
	release := f.fs.Bool("release", false, "record that this node no longer uses the resource (without --resource: every resource)")
	if _, err := f.parse(args, getenv, false); err != nil {
		return err
	}
	if *add && *release {
		return usageError{errors.New("--add and --release exclude each other")}
	}
	if f.resource == "" && !*release {
		return usageError{errors.New("--resource is required")}
	}
	c, err := f.client()
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, cancel := requestContext(ctx)
	defer cancel()
	if *release && f.resource == "" {
		n, err := c.ReleaseAllRefs(ctx)
		if err != nil {
			return err
		}
		if f.human {
			fmt.Fprintf(stdout, "released %d reference(s) of %s\n", n, f.node)
			return nil
		}
		return printJSON(stdout, map[string]any{"node_id": f.node, "released": n})
	}
	var rc api.RefCountResponse
	switch {
	case *add:
		rc, err = c.AddRef(ctx, f.resource)
	case *release:
		rc, err = c.ReleaseRef(ctx, f.resource)
	default:
		rc, err = c.RefCount(ctx, f.resource)
	}
	if err != nil {
		return err
	}
	if f.human {
		fmt.Fprintf(stdout, "%s: %d node(s) %s\n", rc.ResourceID, rc.Count, strings.Join(rc.Nodes, ", "))
		return nil
	}
	return printJSON(stdout, rc)
}
