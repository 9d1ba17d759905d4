package client

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dlock/dlock/api"
)

// TestNotDlockError: a web page where a dlock server should be is a
// *NotDlockError naming the server, whatever its status; a refusal in
// JSON or in net/http's plain text is not one.
func TestNotDlockError(t *testing.T) {
	const page = "<!DOCTYPE html>\n<html><body><h1>Welcome to nginx!</h1></body></html>\n"
	for _, tc := range []struct {
		name     string
		status   int
		ctype    string
		body     string
		notDlock bool
		apiError bool // errors.As finds an *api.Error, as before
	}{
		{"a 200 page", 200, "text/html; charset=utf-8", page, true, false},
		{"a 404 page", 404, "text/html", page, true, true},
		{"a page without its content type", 200, "", "\n  <html><p>hi</p></html>", true, false},
		{"a 502 page of a proxy", 502, "text/html", "<html><body>Bad Gateway</body></html>", true, true},
		{"dlock's JSON refusal", 409, "application/json", `{"error":"held","code":"lock_held","message":"lock held by b","holder":"b"}`, false, true},
		{"net/http's plain text", 400, "text/plain; charset=utf-8", "Client sent an HTTP request to an HTTPS server.\n", false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if tc.ctype != "" {
					w.Header().Set("Content-Type", tc.ctype)
				} else {
					w.Header()["Content-Type"] = nil // not sniffed
				}
				w.WriteHeader(tc.status)
				w.Write([]byte(tc.body))
			}))
			defer srv.Close()
			c := &Client{Server: srv.URL, Node: "a", MaxRetries: -1}
			defer c.Close()
			_, err := c.TryLock(t.Context(), pull)
			if err == nil {
				t.Fatal("no error")
			}
			nd, ok := errors.AsType[*NotDlockError](err)
			if ok != tc.notDlock {
				t.Fatalf("%v: a *NotDlockError: %v, want %v", err, ok, tc.notDlock)
			}
			if _, isAPI := errors.AsType[*api.Error](err); isAPI != tc.apiError {
				t.Errorf("%v: an *api.Error: %v, want %v", err, isAPI, tc.apiError)
			}
			if !ok {
				return
			}
			if nd.Server != srv.URL || nd.Status != tc.status || nd.Got != "HTML" || !strings.HasSuffix(nd.URL, "/lock") {
				t.Errorf("%+v, want server %s, status %d, got HTML", nd, srv.URL, tc.status)
			}
			if strings.Contains(err.Error(), "Welcome") || strings.Contains(err.Error(), "<") {
				t.Errorf("the error quotes the page: %v", err)
			}
		})
	}
}

func TestReadTokenLine(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct{ name, content, token, node string }{
		{"alone", "s3cret\n", "s3cret", ""},
		{"server line", "# node-1's line\ns3cret node-1\n", "s3cret", "node-1"},
		{"tab and spaces", "  s3cret \t node 1  \n", "s3cret", "node 1"},
		{"operator", "s3cret *\n", "s3cret", "*"},
	} {
		p := filepath.Join(dir, tc.name)
		if err := os.WriteFile(p, []byte(tc.content), 0o600); err != nil {
			t.Fatal(err)
		}
		token, node, err := ReadTokenLine(p)
		if err != nil || token != tc.token || node != tc.node {
			t.Errorf("%s: %q %q %v, want %q %q", tc.name, token, node, err, tc.token, tc.node)
		}
	}
}
