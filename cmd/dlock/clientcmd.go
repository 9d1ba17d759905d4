package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/internal/auth"
	"github.com/dlock/dlock/internal/envflag"
	"github.com/dlock/dlock/lock"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// applyEnv sets every flag not given on the command line from DLOCK_<FLAG>.
func applyEnv(fs *pflag.FlagSet, getenv func(string) string) error {
	return envflag.ApplyPFlags(fs, "DLOCK", getenv)
}

// clientFlags are the flags every client subcommand takes.
type clientFlags struct {
	fs       *pflag.FlagSet
	server   string
	node     string
	typ      string
	resource string
	human    bool
	source   string // --source-addr
	cred     *client.CredentialFiles
	// defaultNode is the node id without --node, DLOCK_NODE or a token
	// file that names one.
	defaultNode string
}

func addClientFlags(fs *pflag.FlagSet, defaultNode string) *clientFlags {
	f := &clientFlags{fs: fs, defaultNode: defaultNode}
	fs.StringVar(&f.resource, "resource", "", "resource id, e.g. a blob digest")
	fs.StringVar(&f.server, "server", "http://127.0.0.1:7380", "dlock server URL; or the servers of one lock service, comma-separated (URL1,URL2,…): a request or stream that fails for its server moves to the next")
	fs.StringVar(&f.node, "node", "", "this node's id (default: the node that the --token-file line names, else "+nodeDefaultText(defaultNode)+")")
	fs.StringVar(&f.typ, "type", "pull", "operation type: pull, update, delete, or another name (with pull's rules and no reference rules)")
	fs.BoolVar(&f.human, "human", false, "print a short line instead of JSON")
	fs.StringVar(&f.source, "source-addr", "", "local IP address every connection to the servers is dialed from (default: the system's choice)")
	f.cred = credentialFlags(fs)
	return f
}

// nodeDefaultText names a default node id in --node's help: the host
// name, or HOST:PID for dlock run.
func nodeDefaultText(defaultNode string) string {
	if strings.HasSuffix(defaultNode, fmt.Sprintf(":%d", os.Getpid())) {
		return "HOST:PID"
	}
	return "the host name"
}

// check validates the parsed flags (the environment applied) and returns
// the request they name. Every fault is a bad command line.
func (f *clientFlags) check(needResource bool) (client.Request, error) {
	t, err := lock.ParseType(f.typ)
	if err != nil {
		return client.Request{}, usageError{fmt.Errorf("--type: %w", err)}
	}
	if needResource && f.resource == "" {
		return client.Request{}, usageError{errors.New("--resource is required (or DLOCK_RESOURCE)")}
	}
	if err := checkServers(f.server); err != nil {
		return client.Request{}, err
	}
	if f.fs.Changed("node") {
		if f.node == "" {
			return client.Request{}, usageError{errors.New("--node is empty: give this node's id, or leave --node out for the default")}
		}
		if err := lock.ValidateNode(f.node); err != nil {
			return client.Request{}, usageError{fmt.Errorf("--node: %w", err)}
		}
	}
	if f.source != "" && net.ParseIP(f.source) == nil {
		return client.Request{}, usageError{fmt.Errorf("--source-addr %q: not an IP address", f.source)}
	}
	return client.Request{Type: t, Resource: f.resource}, nil
}

// checkServers checks --server: a URL, or a comma-separated list of them.
// A host:port without a scheme is the likely mistake.
func checkServers(list string) error {
	for _, s := range client.SplitServers(list) {
		u, err := url.Parse(s)
		if err == nil && (u.Scheme == "http" || u.Scheme == "https") && u.Host != "" {
			continue
		}
		return usageError{fmt.Errorf("--server wants a URL like http://127.0.0.1:7380, not %q", s)}
	}
	return nil
}

// client is the command's Client of the --server list, its credentials
// read: a missing or unusable credential file stops the command before
// any request. Without --node (or DLOCK_NODE) the node is the one its
// token file's line names, as the server accepts the token for no other.
func (f *clientFlags) client() (*client.Client, error) {
	servers := client.SplitServers(f.server)
	if !f.fs.Changed("node") {
		f.node = f.defaultNode
		if f.cred.TokenFile != "" {
			_, node, err := client.ReadTokenLine(f.cred.TokenFile)
			if err != nil {
				return nil, err
			}
			if node != "" && node != auth.Operator {
				f.node = node
			}
		}
	}
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

// explain shapes a failed request's error (errors.go).
func (f *clientFlags) explain(err error) error {
	return explain(err, client.SplitServers(f.server))
}

// credentialFlags adds --ca, --cert, --key and --token-file to fs.
func credentialFlags(fs *pflag.FlagSet) *client.CredentialFiles {
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

// lockCommand: one /lock with a ttl lease; run it again to renew.
func (e *cli) lockCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "lock --resource R [flags]",
		Short: "Take a lock, or join its queue, with a ttl lease (repeat to renew)",
		Long: `lock sends one /lock for --resource with a ttl lease and prints the answer: acquired
(with its fencing token), queued (with the position and the holder), or skip
(with --skip-recent, when the key was just completed successfully). It does
not wait: run it again to renew the lease (the server's --lock-ttl) or to
learn the queue position. dlock run is the command that waits.`,
		Example: `  dlock lock --resource sha256:aaa --human
  DLOCK_SERVER=https://dlock.example:7380 DLOCK_TOKEN_FILE=/etc/dlock/token dlock lock --resource sha256:aaa`,
		Args: noArgs,
	}
	f := addClientFlags(cmd.Flags(), hostname())
	skipRecent := cmd.Flags().Bool("skip-recent", false, "answer skip when the key was just completed successfully")
	cmd.RunE = e.action(func(cmd *cobra.Command, _ []string) error {
		return f.lock(e.ctx, *skipRecent, e.stdout)
	})
	return cmd
}

func (f *clientFlags) lock(ctx context.Context, skipRecent bool, stdout io.Writer) error {
	req, err := f.check(true)
	if err != nil {
		return err
	}
	req.Lease, req.SkipRecent = lock.LeaseTTL, skipRecent
	c, err := f.client()
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, cancel := requestContext(ctx)
	defer cancel()
	res, err := c.TryLock(ctx, req)
	if err != nil {
		return f.explain(err)
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

func (e *cli) unlockCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "unlock --resource R [--fail MESSAGE] [--token N] [flags]",
		Short: "Release a lock: as a success, or with --fail MESSAGE as a failure",
		Long: `unlock releases this node's hold of --resource and prints the answer. A success
records the key as completed: the waiters are told the work is done. --fail
MESSAGE records a failure, and the lock passes to the next waiter, which
does the work itself. --token N makes the server check the grant's fencing
token first.`,
		Example: `  dlock unlock --resource sha256:aaa --human
  dlock unlock --resource sha256:aaa --fail "disk full" --token 42`,
		Args: noArgs,
	}
	f := addClientFlags(cmd.Flags(), hostname())
	fail := cmd.Flags().String("fail", "", "unlock as a failure with this message (the lock passes to the next waiter)")
	token := cmd.Flags().Uint64("token", 0, "the grant's fencing token (0: not checked)")
	cmd.RunE = e.action(func(cmd *cobra.Command, _ []string) error {
		return f.unlock(e.ctx, *fail, *token, e.stdout)
	})
	return cmd
}

func (f *clientFlags) unlock(ctx context.Context, fail string, token uint64, stdout io.Writer) error {
	req, err := f.check(true)
	if err != nil {
		return err
	}
	var opErr error
	if fail != "" {
		opErr = errors.New(fail)
	}
	c, err := f.client()
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, cancel := requestContext(ctx)
	defer cancel()
	res, err := c.Release(ctx, req, token, opErr)
	if err != nil {
		return f.explain(err)
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

func (e *cli) statusCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "status --resource R [flags]",
		Short: "Show a lock's holder, queue and last completion",
		Long: `status prints the state of --resource's lock: free or held, the holder and its
fencing token, how many nodes wait (and this node's place among them), and
the last completion, success or failure, with the node that did it.`,
		Example: `  dlock status --resource sha256:aaa --human
  dlock status --resource sha256:aaa --type update --server http://10.0.0.1:7380,http://10.0.0.2:7380`,
		Args: noArgs,
	}
	f := addClientFlags(cmd.Flags(), hostname())
	cmd.RunE = e.action(func(cmd *cobra.Command, _ []string) error {
		return f.status(e.ctx, e.stdout)
	})
	return cmd
}

func (f *clientFlags) status(ctx context.Context, stdout io.Writer) error {
	req, err := f.check(true)
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
		return f.explain(err)
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

func (e *cli) refcountCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "refcount [--resource R] [--add | --release] [flags]",
		Short: "Show, --add or --release a resource's references",
		Long: `refcount shows which nodes use --resource (a server with --refcount server keeps
the count), or changes this node's reference: --add records that it uses
the resource, --release that it no longer does. --release without
--resource releases every reference of the node.`,
		Example: `  dlock refcount --resource sha256:aaa --add --human
  dlock refcount --release`,
		Args: noArgs,
	}
	f := addClientFlags(cmd.Flags(), hostname())
	add := cmd.Flags().Bool("add", false, "record that this node uses the resource")
	release := cmd.Flags().Bool("release", false, "record that this node no longer uses the resource (without --resource: every resource)")
	cmd.RunE = e.action(func(cmd *cobra.Command, _ []string) error {
		return f.refcount(e.ctx, *add, *release, e.stdout)
	})
	return cmd
}

func (f *clientFlags) refcount(ctx context.Context, add, release bool, stdout io.Writer) error {
	if _, err := f.check(false); err != nil {
		return err
	}
	if add && release {
		return usageError{errors.New("--add and --release exclude each other")}
	}
	if f.resource == "" && !release {
		return usageError{errors.New("--resource is required (or DLOCK_RESOURCE), but for --release")}
	}
	c, err := f.client()
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, cancel := requestContext(ctx)
	defer cancel()
	if release && f.resource == "" {
		n, err := c.ReleaseAllRefs(ctx)
		if err != nil {
			return f.explain(err)
		}
		if f.human {
			fmt.Fprintf(stdout, "released %d reference(s) of %s\n", n, f.node)
			return nil
		}
		return printJSON(stdout, map[string]any{"node_id": f.node, "released": n})
	}
	var rc api.RefCountResponse
	switch {
	case add:
		rc, err = c.AddRef(ctx, f.resource)
	case release:
		rc, err = c.ReleaseRef(ctx, f.resource)
	default:
		rc, err = c.RefCount(ctx, f.resource)
	}
	if err != nil {
		return f.explain(err)
	}
	if f.human {
		fmt.Fprintf(stdout, "%s: %d node(s) %s\n", rc.ResourceID, rc.Count, strings.Join(rc.Nodes, ", "))
		return nil
	}
	return printJSON(stdout, rc)
}
