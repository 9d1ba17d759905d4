package dlocktest

import (
	"crypto/tls"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"testing/synctest"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/lock"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestInMemoryRestart: in a bubble, a restart is a new epoch that forgot
// the holds, reached by the same HTTP client.
func TestInMemoryRestart(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := Start(t, Options{InMemory: true})
		hc := s.HTTPClient()
		post := func() string {
			t.Helper()
			resp, err := hc.Post(s.URL()+"/lock", "application/json", strings.NewReader(`{"type":"pull","resource_id":"r","node_id":"a"}`))
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("lock: %d", resp.StatusCode)
			}
			return resp.Header.Get(api.EpochHeader)
		}
		before := post()
		s.Restart()
		if st, err := s.Backend.Status(t.Context(), lock.Pull, "r", ""); err != nil || st.Held {
			t.Fatalf("after the restart: %+v %v, want the key forgotten", st, err)
		}
		if after := post(); after == before || after == "" {
			t.Fatalf("epoch %q before the restart, %q after", before, after)
		}
		s.WaitQueued(t, lock.Key{Type: lock.Pull, Resource: "r"}, 0)
	})
}

const (
	tokA  = "token-of-node-a-0123456789"
	tokOp = "token-of-the-operator-0123"
)

// request sends method path as node a with token over hc; it returns the
// status and the body's error code.
func request(t *testing.T, s *Server, hc *http.Client, method, path, token string) (int, string) {
	t.Helper()
	var body io.Reader
	if method == http.MethodPost {
		body = strings.NewReader(`{"type":"pull","resource_id":"r","node_id":"a"}`)
	}
	req, err := http.NewRequest(method, s.URL()+path, body)
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var e api.ErrorBody
	json.NewDecoder(resp.Body).Decode(&e)
	return resp.StatusCode, e.Code
}

// withCert is hc's transport showing node's client certificate.
func withCert(t *testing.T, s *Server, pki *PKI, node string) *http.Client {
	t.Helper()
	cf, kf := pki.ClientCert(node)
	cert, err := tls.LoadX509KeyPair(cf, kf)
	if err != nil {
		t.Fatal(err)
	}
	tr := &http.Transport{DialContext: s.Dial, TLSClientConfig: &tls.Config{RootCAs: pki.Pool, Certificates: []tls.Certificate{cert}}}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

// checkAuth: the server speaks HTTPS with the PKI's certificate, checks
// tokens and client certificates, and says so in its metrics.
func checkAuth(t *testing.T, s *Server, pki *PKI) {
	t.Helper()
	if !strings.HasPrefix(s.URL(), "https://") {
		t.Fatalf("URL %s, want https://", s.URL())
	}
	anon, asA := s.HTTPClient(), withCert(t, s, pki, "a")
	for _, tc := range []struct {
		hc            *http.Client
		method, path  string
		token         string
		status        int
		code, refusal string
	}{
		{anon, http.MethodGet, "/healthz", "", http.StatusOK, "", ""},
		{anon, http.MethodPost, "/lock", tokA, http.StatusUnauthorized, "unauthorized", "no_certificate"},
		{asA, http.MethodPost, "/lock", "", http.StatusUnauthorized, "unauthorized", "no_token"},
		{asA, http.MethodPost, "/lock", "token-nobody-has-0123", http.StatusUnauthorized, "unauthorized", "unknown_token"},
		{withCert(t, s, pki, "b"), http.MethodPost, "/lock", tokA, http.StatusForbidden, "forbidden", "other_node"},
		{asA, http.MethodGet, "/metrics", tokA, http.StatusForbidden, "forbidden", "operator_only"},
		{asA, http.MethodPost, "/lock", tokA, http.StatusOK, "", ""},
		{withCert(t, s, pki, "*"), http.MethodPost, "/lock", tokOp, http.StatusOK, "", ""},
	} {
		refused := s.Metric("dlock_auth_refusals_total")
		status, code := request(t, s, tc.hc, tc.method, tc.path, tc.token)
		if status != tc.status || code != tc.code {
			t.Fatalf("%s %s with token %q: %d %q, want %d %q", tc.method, tc.path, tc.token, status, code, tc.status, tc.code)
		}
		if tc.refusal != "" && s.Metric("dlock_auth_refusals_total", "reason", tc.refusal) != 1 {
			t.Fatalf("%s %s: dlock_auth_refusals_total{reason=%q} is not 1", tc.method, tc.path, tc.refusal)
		}
		if tc.refusal == "" && s.Metric("dlock_auth_refusals_total") != refused {
			t.Fatalf("%s %s: counted as refused", tc.method, tc.path)
		}
	}
	if n := s.Metric("dlock_http_request_duration_seconds", "endpoint", "/lock"); n != 6 {
		t.Fatalf("%v /lock requests counted, want 6", n)
	}
}

// TestAuth: with Options.Auth the server checks identities, over TCP and
// in memory, and keeps them across a restart; Metric reads its counters,
// Connections its connections.
func TestAuth(t *testing.T) {
	auth := func(pki *PKI) *Auth {
		return &Auth{PKI: pki, ClientCA: true, Tokens: map[string]string{tokA: "a", tokOp: "*"}}
	}
	t.Run("tcp", func(t *testing.T) {
		pki := NewPKI(t)
		s := Start(t, Options{Auth: auth(pki)})
		checkAuth(t, s, pki)
		// anon, a, b, the operator: one connection each (keep-alive).
		if n := s.Connections(); n != 4 {
			t.Fatalf("%d connections, want 4", n)
		}
		// A connection that sent nothing yet is counted all the same.
		c, err := net.Dial("tcp", s.Addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if n := s.Connections(); n != 5 {
			t.Fatalf("%d connections, want 5", n)
		}
		s.Restart()
		checkAuth(t, s, pki)
		if n := s.Connections(); n != 9 {
			t.Fatalf("%d connections, want 9", n)
		}
	})
	t.Run("in memory", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			pki := NewPKI(t)
			s := Start(t, Options{InMemory: true, Auth: auth(pki)})
			checkAuth(t, s, pki)
			s.Restart()
			checkAuth(t, s, pki)
		})
	})
	t.Run("wrapped", func(t *testing.T) {
		pki := NewPKI(t)
		s := Start(t, Options{Auth: auth(pki), Wrap: func(h http.Handler) http.Handler { return h }})
		checkAuth(t, s, pki)
	})
	t.Run("tokens only", func(t *testing.T) {
		s := Start(t, Options{Auth: &Auth{Tokens: map[string]string{tokA: "a"}}})
		if !strings.HasPrefix(s.URL(), "http://") {
			t.Fatalf("URL %s, want http://", s.URL())
		}
		if st, code := request(t, s, s.HTTPClient(), http.MethodPost, "/lock", ""); st != http.StatusUnauthorized || code != "unauthorized" {
			t.Fatalf("no token: %d %q", st, code)
		}
		if st, _ := request(t, s, s.HTTPClient(), http.MethodPost, "/lock", tokA); st != http.StatusOK {
			t.Fatalf("a's token: %d", st)
		}
	})
}

// fakeT records a Fatalf and stops the caller, so that a test can see
// a helper fail.
type fakeT struct {
	testing.TB
	failed bool
}

type fatal struct{}

func (f *fakeT) Fatalf(string, ...any) {
	f.failed = true
	panic(fatal{})
}

// TestMetricTypo: a metric, or a label, the server has no series of fails
// the test rather than reading 0.
func TestMetricTypo(t *testing.T) {
	s := Start(t, Options{Auth: &Auth{Tokens: map[string]string{tokA: "a"}}})
	for _, m := range [][]string{
		{"dlock_no_such_metric"},
		{"dlock_auth_refusals_total", "reason", "no-token"},
		{"dlock_auth_refusals_total", "reason"},
	} {
		ft := &fakeT{TB: t}
		s.t = ft
		func() {
			defer func() {
				if p := recover(); p != nil && p != (fatal{}) {
					panic(p)
				}
			}()
			s.Metric(m[0], m[1:]...)
		}()
		s.t = t
		if !ft.failed {
			t.Errorf("Metric%q did not fail", m)
		}
	}
	if n := s.Metric("dlock_auth_refusals_total", "reason", "no_token"); n != 0 {
		t.Fatalf("no_token refusals %v, want 0", n)
	}
}
