// Command dlock-content serves a content store shared by several nodes and
// coordinated by dlock to containerd, as a content proxy plugin over a unix
// socket (containerd's content gRPC API, the same in containerd 1.6 and 2.x).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	contentapi "github.com/containerd/containerd/api/services/content/v1"
	"github.com/containerd/containerd/v2/plugins/services/content/contentserver"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

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
	socket, root, ingest, node, server string
	logLevel                           slog.Level
}

func parse(args []string, getenv func(string) string, stderr io.Writer) (config, error) {
	var c config
	host, _ := os.Hostname()
	fs := flag.NewFlagSet("dlock-content", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.socket, "socket", "/run/dlock-content/content.sock", "unix socket containerd connects to")
	fs.StringVar(&c.root, "root", "", "shared content directory (required)")
	fs.StringVar(&c.ingest, "ingest", "", "this node's ingest folder, on the root's filesystem (default ROOT/nodes/NODE)")
	fs.StringVar(&c.node, "node", host, "this node's id")
	fs.StringVar(&c.server, "server", "http://127.0.0.1:7380", "dlock server URL (it must run with --refcount=server)")
	fs.TextVar(&c.logLevel, "log-level", slog.LevelInfo, "log level")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if err := envflag.Apply(fs, "DLOCK_CONTENT", getenv); err != nil {
		return c, err
	}
	if c.root == "" {
		return c, errors.New("--root is required")
	}
	return c, nil
}

// run serves until ctx ends. ready, when set, is called once the socket
// accepts connections.
func run(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer, ready func()) error {
	c, err := parse(args, getenv, stderr)
	if err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: c.logLevel}))
	cl := &client.Client{
		Server: c.server, Node: c.node, Logger: log,
		// Every call is one attempt of at most 500 ms: the store answers
		// containerd's calls inside its metadata transaction.
		MaxRetries: -1, RequestTimeout: 500 * time.Millisecond,
	}
	defer cl.Close()
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	store, err := content.New(sctx, content.Config{Root: c.root, Ingest: c.ingest, Client: cl, Logger: log})
	cancel()
	if err != nil {
		return err
	}
	defer store.Close()

	if err := os.MkdirAll(filepath.Dir(c.socket), 0o755); err != nil {
		return err
	}
	if err := os.Remove(c.socket); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	ln, err := net.Listen("unix", c.socket)
	if err != nil {
		return err
	}
	srv := grpc.NewServer()
	contentapi.RegisterContentServer(srv, contentserver.New(store))
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
