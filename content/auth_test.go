package content

import (
	"context"
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/internal/dlocktest"
)

// TestSharedPullWithCredentials: three nodes, each with its own client
// certificate and token, share one store through a dlock server that
// checks identities (HTTPS, client certificates, bearer tokens;
// docs/SECURITY.md): every blob is
// downloaded once, every node reads every blob, and once every node
// removed the image its blobs are gone.
func TestSharedPullWithCredentials(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pki := dlocktest.NewPKI(t)
	tokens := map[string]string{}
	for i := range 3 {
		tokens[token(i)] = fmt.Sprint("node-", i)
	}
	srv := dlocktest.Start(t, dlocktest.Options{RefCount: true, Auth: &dlocktest.Auth{PKI: pki, ClientCA: true, Tokens: tokens}})
	reg := newRegistry()
	rs := httptest.NewServer(reg)
	defer rs.Close()
	host := strings.TrimPrefix(rs.URL, "http://")
	root := t.TempDir()
	var nodes []*node
	for i := range 3 {
		name := fmt.Sprint("node-", i)
		cert, key := pki.ClientCert(name)
		cfg, err := client.TLSConfigFromFiles(pki.CAFile, cert, key)
		if err != nil {
			t.Fatal(err)
		}
		c := &client.Client{Server: srv.URL(), Node: name, TLSConfig: cfg, Token: token(i),
			MaxRetries: -1, RequestTimeout: 2 * time.Second, PollInterval: 50 * time.Millisecond}
		nodes = append(nodes, newNodeWithClient(t, root, c))
	}

	ref, blobs, _ := pushImage(t, host, "test/creds", 3, 128<<10)
	pullOnceReadEverywhere(ctx, t, reg, nodes, ref, blobs)
	for _, n := range nodes {
		if err := n.remove(ctx, ref); err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range blobs {
		if blobExists(root, d) {
			t.Errorf("blob %s of an image no node has any more is still there", d)
		}
	}
	if n := srv.Metric("dlock_auth_refusals_total"); n != 0 {
		t.Fatalf("%v requests refused", n)
	}
	for _, path := range []string{"/lock", "/refcount/add"} {
		if srv.Metric("dlock_http_request_duration_seconds", "endpoint", path) == 0 {
			t.Fatalf("no %s request reached the server", path)
		}
	}
}

// token is node-i's token.
func token(i int) string { return fmt.Sprintf("token-of-node-%d-0123456789", i) }
