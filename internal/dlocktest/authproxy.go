package dlocktest

import (
	"bytes"
	"crypto/tls"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/dlock/dlock/api"
)

// AuthProxy stands in front of a Server for the rules of docs/SECURITY.md,
// so that clients can be tested with credentials against the real lock
// server: HTTPS with a client certificate of its PKI required at the
// handshake, every request but GET /healthz with "Authorization: Bearer
// TOKEN" of a known token (else 401 unauthorized), and a node named in the
// request (body or query node_id) that both the token and the certificate
// (Subject CN or a DNS SAN) allow (else 403 forbidden). What passes is
// proxied to the Server.
type AuthProxy struct {
	// URL is the proxy's https:// base URL.
	URL string

	hs     *httptest.Server
	tokens map[string]string // token → node; node "*" may act as any
	rp     *httputil.ReverseProxy
	tr     *http.Transport

	mu         sync.Mutex
	statuses   map[int]int    // answers given, by status
	auths      []string       // Authorization headers seen, for leak checks
	paths      map[string]int // requests received, by path
	handshakes int            // TLS handshakes begun
}

// StartAuthProxy runs a proxy in front of backend until the test ends.
// tokens maps each token to its node ("*": an operator token).
func StartAuthProxy(t testing.TB, backend *Server, pki *PKI, tokens map[string]string) *AuthProxy {
	t.Helper()
	target, err := url.Parse(backend.URL())
	if err != nil {
		t.Fatal(err)
	}
	p := &AuthProxy{tokens: tokens, statuses: map[int]int{}, paths: map[string]int{}}
	p.tr = &http.Transport{}
	p.rp = &httputil.ReverseProxy{
		Rewrite:       func(r *httputil.ProxyRequest) { r.SetURL(target) },
		Transport:     p.tr,
		FlushInterval: -1, // session streams go through at once
	}
	p.hs = httptest.NewUnstartedServer(p)
	p.hs.TLS = pki.ServerTLS()
	p.hs.TLS.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) {
		p.mu.Lock()
		p.handshakes++
		p.mu.Unlock()
		return nil, nil
	}
	p.hs.StartTLS()
	p.URL = p.hs.URL
	t.Cleanup(func() {
		p.hs.CloseClientConnections()
		p.hs.Close()
		p.tr.CloseIdleConnections()
	})
	return p
}

// Answered is how many requests the proxy refused with status.
func (p *AuthProxy) Answered(status int) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.statuses[status]
}

// Handshakes is how many TLS handshakes clients began.
func (p *AuthProxy) Handshakes() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.handshakes
}

// Requests is how many requests for path reached the proxy.
func (p *AuthProxy) Requests(path string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.paths[path]
}

// Authorizations are the Authorization headers received so far.
func (p *AuthProxy) Authorizations() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.auths)
}

func (p *AuthProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	p.paths[r.URL.Path]++
	p.auths = append(p.auths, r.Header.Get("Authorization"))
	p.mu.Unlock()
	if r.Method == http.MethodGet && r.URL.Path == "/healthz" {
		p.rp.ServeHTTP(w, r)
		return
	}
	token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	tokenNode, known := p.tokens[token]
	if !ok || !known {
		p.refuse(w, http.StatusUnauthorized, "unauthorized", "a known bearer token is required")
		return
	}
	node := r.URL.Query().Get("node_id")
	if r.Body != nil && r.Method == http.MethodPost {
		body, err := io.ReadAll(io.LimitReader(r.Body, api.MaxBody+1))
		if err != nil {
			p.refuse(w, http.StatusBadRequest, api.CodeInvalid, err.Error())
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		var named struct {
			NodeID string `json:"node_id"`
		}
		if json.Unmarshal(body, &named) == nil && named.NodeID != "" {
			node = named.NodeID
		}
	}
	if node == "" {
		p.rp.ServeHTTP(w, r)
		return
	}
	if tokenNode != "*" && tokenNode != node {
		p.refuse(w, http.StatusForbidden, "forbidden", "the token may not act as node "+node)
		return
	}
	cert := r.TLS.PeerCertificates[0]
	if cert.Subject.CommonName != node && !slices.Contains(cert.DNSNames, node) {
		p.refuse(w, http.StatusForbidden, "forbidden", "the client certificate does not name node "+node)
		return
	}
	p.rp.ServeHTTP(w, r)
}

func (p *AuthProxy) refuse(w http.ResponseWriter, status int, code, msg string) {
	p.mu.Lock()
	p.statuses[status]++
	p.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(api.ErrorBody{Error: msg, Code: code, Message: msg})
}
