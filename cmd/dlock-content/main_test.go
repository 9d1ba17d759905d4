package main

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/internal/dlocktest"
	"go.uber.org/goleak"
)

func TestParse(t *testing.T) {
	env := map[string]string{"DLOCK_CONTENT_ROOT": "/shared", "DLOCK_CONTENT_NODE": "n7", "DLOCK_CONTENT_SERVER": "http://10.0.0.5:7380"}
	c, err := parse([]string{"--node", "n1"}, func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.root != "/shared" || c.node != "n1" || c.server != "http://10.0.0.5:7380" {
		t.Fatalf("got %+v: the environment fills unset flags, the command line wins", c)
	}
	if !slices.Equal(c.servers, []string{"http://10.0.0.5:7380"}) {
		t.Fatalf("servers %q, want the one --server", c.servers)
	}
	if _, err := parse(nil, func(string) string { return "" }, io.Discard); err == nil || !strings.Contains(err.Error(), "--root") {
		t.Fatalf("no root: %v", err)
	}
	if _, err := parse(nil, func(k string) string {
		return map[string]string{"DLOCK_CONTENT_LOG_LEVEL": "loud", "DLOCK_CONTENT_ROOT": "/r"}[k]
	}, io.Discard); err == nil || !strings.Contains(err.Error(), "DLOCK_CONTENT_LOG_LEVEL") {
		t.Fatalf("bad log level: %v", err)
	}
}

// TestParseServerList: --server and DLOCK_CONTENT_SERVER take the servers
// of one lock service, comma-separated, all http:// or all https://.
func TestParseServerList(t *testing.T) {
	env := func(server string) func(string) string {
		return func(k string) string {
			return map[string]string{"DLOCK_CONTENT_ROOT": "/shared", "DLOCK_CONTENT_SERVER": server}[k]
		}
	}
	c, err := parse(nil, env("http://10.0.0.5:7380, http://10.0.0.6:7380"), io.Discard)
	if err != nil || !slices.Equal(c.servers, []string{"http://10.0.0.5:7380", "http://10.0.0.6:7380"}) {
		t.Fatalf("DLOCK_CONTENT_SERVER list: %q %v", c.servers, err)
	}
	c, err = parse([]string{"--server", "http://a:1,http://b:2,http://c:3"}, env(""), io.Discard)
	if err != nil || !slices.Equal(c.servers, []string{"http://a:1", "http://b:2", "http://c:3"}) {
		t.Fatalf("--server list: %q %v", c.servers, err)
	}
	for _, bad := range []string{"http://a:1,https://b:2", "http://a:1,", "http://a:1,b:2"} {
		if _, err := parse([]string{"--server", bad}, env(""), io.Discard); err == nil {
			t.Errorf("--server %s: no error", bad)
		}
	}
	if _, err := parse([]string{"--server", "http://a:1,http://b:2", "--ca", "ca.pem"}, env(""), io.Discard); !errors.Is(err, client.ErrNotHTTPS) {
		t.Errorf("--ca for http:// servers: %v, want ErrNotHTTPS", err)
	}
}

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("net/http.(*conn).closeWriteAndWait"))
}

// TestRunServerList: dlock-content starts with a list whose first server
// is dead, and serves through the next one.
func TestRunServerList(t *testing.T) {
	srv := dlocktest.Start(t, dlocktest.Options{RefCount: true})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "http://" + ln.Addr().String()
	ln.Close()
	dir, err := os.MkdirTemp("", "dlcs") // short: unix socket paths are limited
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	args := []string{"--root", filepath.Join(dir, "shared"), "--socket", filepath.Join(dir, "c.sock"), "--node", "n",
		"--server", dead + "," + srv.URL()}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	ready := make(chan struct{})
	errc := make(chan error, 1)
	go func() { errc <- run(ctx, args, func(string) string { return "" }, io.Discard, func() { close(ready) }) }()
	select {
	case <-ready:
	case err := <-errc:
		t.Fatalf("run: %v", err)
	}
	if n := srv.Metric("dlock_event_streams"); n != 1 {
		t.Fatalf("%v event streams open on the live server, want n's session stream", n)
	}
	cancel()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}
