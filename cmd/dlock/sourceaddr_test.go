package main

import (
	"errors"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/dlock/dlock/internal/dlocktest"
	"github.com/dlock/dlock/internal/netfault"
)

// TestSourceAddrFlag: --source-addr, or DLOCK_SOURCE_ADDR, is the local
// address the client dials from; the flag wins; anything but an IP address
// is a bad command line.
func TestSourceAddrFlag(t *testing.T) {
	for _, tc := range []struct {
		name  string
		args  []string
		env   map[string]string
		want  string // the client's LocalAddr IP, "" for none
		usage bool
	}{
		{name: "none"},
		{name: "flag", args: []string{"--source-addr", "127.0.0.5"}, want: "127.0.0.5"},
		{name: "env", env: map[string]string{"DLOCK_SOURCE_ADDR": "127.0.0.6"}, want: "127.0.0.6"},
		{name: "flag wins", args: []string{"--source-addr", "127.0.0.5"}, env: map[string]string{"DLOCK_SOURCE_ADDR": "127.0.0.6"}, want: "127.0.0.5"},
		{name: "IPv6", args: []string{"--source-addr", "::1"}, want: "::1"},
		{name: "a name", args: []string{"--source-addr", "localhost"}, usage: true},
		{name: "with a port", args: []string{"--source-addr", "127.0.0.5:80"}, usage: true},
		{name: "bad env", env: map[string]string{"DLOCK_SOURCE_ADDR": "nope"}, usage: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newClientFlags("status", "n", io.Discard)
			_, err := f.parse(append(tc.args, "--resource", "r"), func(k string) string { return tc.env[k] }, true)
			if tc.usage {
				var ue usageError
				if !errors.As(err, &ue) {
					t.Fatalf("parse: %v, want a usage error", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			c, err := f.client()
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			got := ""
			if c.LocalAddr != nil {
				got = c.LocalAddr.(*net.TCPAddr).IP.String()
			}
			if got != tc.want {
				t.Fatalf("LocalAddr %q, want %q", got, tc.want)
			}
		})
	}
}

// TestSourceAddrDials: the commands' requests and `dlock run`'s session
// stream come from the --source-addr address (an address of the test's
// own on loopback, which any process may bind).
func TestSourceAddrDials(t *testing.T) {
	local := netfault.LoopbackAddr(t)
	var mu sync.Mutex
	from := map[string]bool{}
	srv := dlocktest.Start(t, dlocktest.Options{Wrap: func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			host, _, _ := net.SplitHostPort(r.RemoteAddr)
			mu.Lock()
			from[r.URL.Path+" "+host] = true
			mu.Unlock()
			next.ServeHTTP(w, r)
		})
	}})
	if _, errOut, st := dlock(t, srv.URL(), "status", "--resource", "r", "--source-addr", local); st != 0 {
		t.Fatalf("status: %d %s", st, errOut)
	}
	ran := filepath.Join(t.TempDir(), "ran")
	if _, errOut, st := dlockWith(t, map[string]string{"DLOCK_SERVER": srv.URL(), "DLOCK_SOURCE_ADDR": local}, "run", "--resource", "r", "--", "touch", ran); st != 0 {
		t.Fatalf("run: %d %s", st, errOut)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, p := range []string{"/status", "/subscribe", "/lock", "/unlock"} {
		if !from[p+" "+local] {
			t.Errorf("no %s from %s: %v", p, local, from)
		}
	}
	for k := range from {
		if _, host, _ := strings.Cut(k, " "); host != local {
			t.Errorf("a request from another address: %s", k)
		}
	}
}
