package main

import (
	"context"
	"io"
	"net"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/dlock/dlock/internal/dlocktest"
)

// TestSocketMode: the socket is 0660 and owned by --socket-group even
// under umask 0, and is removed at shutdown.
func TestSocketMode(t *testing.T) {
	srv := dlocktest.Start(t, dlocktest.Options{RefCount: true})
	dir, err := os.MkdirTemp("", "dlcs") // short: unix socket paths are limited
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "run", "content.sock")
	gid := os.Getgid()
	if os.Geteuid() == 0 {
		gid = 1 // root may give the socket any group: show that it does
	}

	old := syscall.Umask(0)
	defer syscall.Umask(old)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	ready := make(chan struct{})
	errc := make(chan error, 1)
	go func() {
		errc <- run(ctx, []string{"--root", filepath.Join(dir, "shared"), "--socket", sock, "--socket-group", strconv.Itoa(gid), "--server", srv.URL(), "--node", "n"},
			func(string) string { return "" }, io.Discard, func() { close(ready) })
	}()
	select {
	case <-ready:
	case err := <-errc:
		t.Fatalf("run: %v", err)
	}
	fi, err := os.Lstat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o660 {
		t.Errorf("socket mode %v under umask 0, want a socket with 0660", fi.Mode())
	}
	if st := fi.Sys().(*syscall.Stat_t); int(st.Gid) != gid {
		t.Errorf("socket group %d, want %d (--socket-group)", st.Gid, gid)
	}
	entries, _ := os.ReadDir(filepath.Dir(sock))
	if len(entries) != 1 {
		t.Errorf("the socket's folder holds %v, want the socket alone", entries)
	}
	conn, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatalf("connecting: %v", err)
	}
	conn.Close()
	cancel()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(sock); !os.IsNotExist(err) {
		t.Errorf("socket left behind after shutdown: %v", err)
	}
}

func TestParseSocketGroup(t *testing.T) {
	g, err := user.LookupGroupId(strconv.Itoa(os.Getgid()))
	if err != nil {
		t.Skipf("no name for this process's group: %v", err)
	}
	env := map[string]string{"DLOCK_CONTENT_ROOT": "/r", "DLOCK_CONTENT_SOCKET_GROUP": g.Name}
	c, err := parse(nil, func(k string) string { return env[k] }, io.Discard)
	if err != nil || c.socketGroup != g.Name {
		t.Fatalf("DLOCK_CONTENT_SOCKET_GROUP=%s: %+v %v", g.Name, c, err)
	}
	if gid, err := lookupGroup(g.Name); err != nil || gid != os.Getgid() {
		t.Fatalf("group %s: %d %v, want %d", g.Name, gid, err, os.Getgid())
	}
	if _, err := parse([]string{"--root", "/r", "--socket-group", "no-such-group-here"}, func(string) string { return "" }, io.Discard); err == nil || !strings.Contains(err.Error(), "--socket-group") {
		t.Fatalf("unknown group: %v", err)
	}
}
