// Command dlock-content serves a content store shared by several nodes and
// coordinated by dlock to containerd, as a content proxy plugin over a unix
// socket (containerd's content gRPC API, the same in containerd 1.6 and 2.x).
package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	contentapi "github.com/containerd/containerd/api/services/content/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/experimental"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/mem"

	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/content"
	"github.com/dlock/dlock/internal/envflag"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Getenv, os.Stderr, nil)
	stop()
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "dlock-content:", err)
		os.Exit(1)
	}
}

type config struct {
	socket, socketGroup, root, ingest, node, server string
	logLevel                                        slog.Level
	cred                                            client.CredentialFiles
	// Read by parse: server's list, and what cred's files hold.
	servers []string
	tls     *tls.Config
	token   string
}

func parse(args []string, getenv func(string) string, stderr io.Writer) (config, error) {
	var c config
	host, _ := os.Hostname()
	fs := flag.NewFlagSet("dlock-content", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.socket, "socket", "/run/dlock-content/content.sock", "unix socket containerd connects to (created with mode 0660)")
	fs.StringVar(&c.socketGroup, "socket-group", "", "group (name or gid) that owns the socket (default: the process's group)")
	fs.StringVar(&c.root, "root", "", "shared content directory (required)")
	fs.StringVar(&c.ingest, "ingest", "", "this node's ingest folder, inside the root (default ROOT/nodes/NODE)")
	fs.StringVar(&c.node, "node", host, "this node's id")
	fs.StringVar(&c.server, "server", "http://127.0.0.1:7380", "dlock server URL (it must run with --refcount=server); or the servers of one lock service, comma-separated (URL1,URL2,…): the client moves to the next when one fails")
	fs.TextVar(&c.logLevel, "log-level", slog.LevelInfo, "log level")
	fs.StringVar(&c.cred.CA, "ca", "", "PEM file of the CA that signed the dlock server's certificate, for an https:// server (default: the system's roots)")
	fs.StringVar(&c.cred.Cert, "cert", "", "PEM file of this node's client certificate, for a server that requires one (with --key)")
	fs.StringVar(&c.cred.Key, "key", "", "PEM file of the client certificate's private key (with --cert)")
	fs.StringVar(&c.cred.TokenFile, "token-file", "", "file holding this node's bearer token: the token alone, or the server's \"TOKEN NODE_ID\" line")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if err := envflag.Apply(fs, "DLOCK_CONTENT", getenv); err != nil {
		return c, err
	}
	if c.root == "" {
		return c, errors.New("--root is required")
	}
	if c.socketGroup != "" {
		if _, err := lookupGroup(c.socketGroup); err != nil {
			return c, fmt.Errorf("--socket-group: %w", err)
		}
	}
	c.servers = client.SplitServers(c.server)
	var err error
	if c.tls, c.token, err = c.cred.Load(c.servers...); err != nil {
		return c, err
	}
	return c, nil
}

// lookupGroup resolves a group name or a numeric gid.
func lookupGroup(g string) (int, error) {
	if gid, err := strconv.Atoi(g); err == nil && gid >= 0 {
		return gid, nil
	}
	grp, err := user.LookupGroup(g)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(grp.Gid)
}

// listenSocket listens on a unix socket with mode 0660, owned by group
// when one is given, whatever the umask: the socket is made in a fresh
// folder only this process can enter, its mode and group set there, and
// only then renamed to its place, so that it is never reachable with
// looser permissions (anyone who can connect can read and write every
// blob of the shared store).
func listenSocket(socket, group string) (net.Listener, error) {
	dir := filepath.Dir(socket)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	if err := os.Remove(socket); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	tmp, err := os.MkdirTemp(dir, ".dlc") // short: socket paths are limited to 108 bytes
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	private := filepath.Join(tmp, "s")
	ln, err := net.Listen("unix", private)
	if err != nil {
		return nil, err
	}
	// Closing must not unlink the private name (gone by then); run removes
	// the socket when it stops.
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	err = os.Chmod(private, 0o660)
	if err == nil && group != "" {
		var gid int
		if gid, err = lookupGroup(group); err == nil {
			err = os.Chown(private, -1, gid)
		}
	}
	if err == nil {
		err = os.Rename(private, socket)
	}
	if err != nil {
		ln.Close()
		return nil, fmt.Errorf("socket %s: %w", socket, err)
	}
	return ln, nil
}

// bufferPool is gRPC's default pool with a 64 KiB size between its 32 KiB
// and 1 MiB ones. containerd reads a blob through the content proxy 32 KiB
// at a time while it unpacks, one Read call each; a reply of 32 KiB and
// its few bytes of framing is just too big for the 32 KiB buffers, and the
// default pool clears a whole 1 MiB buffer for each (docs/CONTAINERD.md,
// "Unpacking through the plugin").
// gRPC's codec takes its buffers from the process's default pool, whatever
// the server's options say.
var bufferPool = func() mem.BufferPool {
	p, err := mem.NewBinaryTieredBufferPool(8, 12, 14, 15, 16, 20)
	if err != nil {
		panic(err)
	}
	return p
}()

func init() { experimental.SetDefaultBufferPool(bufferPool) }

// run serves until ctx ends. ready, when set, is called once the socket
// accepts connections.
func run(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer, ready func()) error {
	c, err := parse(args, getenv, stderr)
	if err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: c.logLevel}))
	cl := &client.Client{
		Servers: c.servers, Node: c.node, Logger: log,
		TLSConfig: c.tls, Token: c.token,
		// Every call is one attempt of at most 500 ms: the store answers
		// containerd's calls inside its metadata transaction. With
		// several servers, the call after one that failed for its server
		// goes to the next, as the session stream does.
		MaxRetries: -1, RequestTimeout: 500 * time.Millisecond,
	}
	defer cl.Close()
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	// The session stream first: it tries the servers in turn until one
	// answers, and the store's single-attempt calls then go there. Its
	// failure is content.New's to report, which asks the server first.
	_ = cl.Connect(sctx)
	store, err := content.New(sctx, content.Config{Root: c.root, Ingest: c.ingest, Client: cl, Logger: log})
	cancel()
	if err != nil {
		return err
	}
	defer store.Close()

	ln, err := listenSocket(c.socket, c.socketGroup)
	if err != nil {
		return err
	}
	defer os.Remove(c.socket)
	srv := grpc.NewServer()
	contentapi.RegisterContentServer(srv, newService(store.Proxied()))
	hs := health.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	hs.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	log.Info("dlock-content serving", "socket", c.socket, "root", c.root, "node", c.node, "server", c.server)
	if ready != nil {
		ready()
	}
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	hs.Shutdown()
	stopped := make(chan struct{})
	go func() { srv.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		srv.Stop()
	}
	log.Info("dlock-content stopped")
	return nil
}
