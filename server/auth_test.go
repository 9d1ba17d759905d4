package server

import (
	"bufio"
	"crypto/tls"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/fetch"
	"github.com/chromedp/chromedp"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/internal/auth"
	"github.com/dlock/dlock/internal/auth/authtest"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/lock/memory"
	"github.com/dlock/dlock/refcount"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

const (
	tokA      = "token-of-node-a-0123456789"
	tokB      = "token-of-node-b-0123456789"
	tokC      = "token-of-node-c-0123456789"
	tokOp     = "token-of-the-operator-0123"
	tokenFile = "# test tokens\n" + tokA + " a\n" + tokB + " b\n" + tokC + " c\n" + tokOp + " *\n"
)

// authSetup is a test server's identity checks.
type authSetup struct {
	tokens   bool // the token file above
	tls      bool // HTTPS
	mtls     bool // a client CA (tls too)
	serial   bool // net/http alone, without the lean loop (plain HTTP only)
	refcount bool
}

// authEnv is a server with identities, and the credentials of nodes a, b
// and c and of the operator.
type authEnv struct {
	*env
	t          testing.TB
	dir        string
	addr       string
	tokensPath string
	ca         *authtest.CA
	caFile     string
	certFile   string
	keyFile    string
	certs      map[string]tls.Certificate // by node name; "*" is the operator's
	tls        bool
}

func newAuthEnv(t testing.TB, as authSetup) *authEnv {
	t.Helper()
	return newAuthEnvWith(t, as, nil, nil)
}

// newAuthEnvWith is newAuthEnv with a lock configuration and server
// options of the test's own.
func newAuthEnvWith(t testing.TB, as authSetup, mod func(*memory.Config), opt func(*Options)) *authEnv {
	t.Helper()
	ae := &authEnv{t: t, dir: t.TempDir(), tls: as.tls || as.mtls}
	var opts Options
	if as.tokens {
		ae.tokensPath = filepath.Join(ae.dir, "tokens")
		authtest.WriteFile(t, ae.tokensPath, []byte(tokenFile))
		tk, err := auth.LoadTokens(ae.tokensPath)
		if err != nil {
			t.Fatal(err)
		}
		opts.Tokens = tk
	}
	if ae.tls {
		ae.ca = authtest.NewCA(t, "dlock test CA")
		ae.certFile, ae.keyFile = ae.ca.Server(t).Write(t, ae.dir, "server")
		if as.mtls {
			ae.caFile = filepath.Join(ae.dir, "ca.crt")
			authtest.WriteFile(t, ae.caFile, ae.ca.PEM)
		}
		c, err := auth.LoadCerts(ae.certFile, ae.keyFile, ae.caFile)
		if err != nil {
			t.Fatal(err)
		}
		opts.TLS = c
		ae.certs = map[string]tls.Certificate{}
		for _, n := range []string{"a", "b", "c", "*"} {
			ae.certs[n] = ae.ca.Node(t, n, n).TLS(t)
		}
	}
	if opt != nil {
		opt(&opts)
	}
	var store *refcount.ServerStore
	if as.refcount {
		var err error
		if store, err = refcount.OpenServerStore(filepath.Join(ae.dir, "refs.db")); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { store.Close() })
	}
	cfg := func(c *memory.Config) {
		if store != nil {
			c.RefStore = store
		}
		if mod != nil {
			mod(c)
		}
	}
	ae.env = newEnvWith(t, envConfig{mod: cfg, serial: as.serial, opts: opts})
	ae.addr = ae.env.addr()
	return ae
}

// who is a client's credentials: a token, a certificate (a key of
// authEnv.certs), or both; the zero value has none.
type who struct{ token, cert string }

func (w who) String() string { return fmt.Sprintf("token %q cert %q", w.token, w.cert) }

// clientTLS is the client side's TLS configuration for w: the server's CA,
// w's certificate sent whoever signed it, and ALPN http/1.1 (the lean
// loop) or h2.
func (ae *authEnv) clientTLS(w who, h2 bool) *tls.Config {
	proto := "http/1.1"
	if h2 {
		proto = "h2"
	}
	return &tls.Config{
		RootCAs: ae.ca.Pool(), ServerName: "localhost", NextProtos: []string{proto},
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			if w.cert == "" {
				return &tls.Certificate{}, nil
			}
			c := ae.certs[w.cert]
			return &c, nil
		},
	}
}

// conn is one client connection that sends requests as one identity.
type conn struct {
	ae *authEnv
	c  net.Conn
	br *bufio.Reader
	w  who
}

// dial opens a connection as w (over TLS when the server has it). Reads
// and writes fail after 10 s, which bounds a broken run only.
func (ae *authEnv) dial(w who) *conn {
	ae.t.Helper()
	c, err := net.Dial("tcp", ae.addr)
	if err != nil {
		ae.t.Fatal(err)
	}
	if ae.tls {
		tc := tls.Client(c, ae.clientTLS(w, false))
		if err := tc.Handshake(); err != nil {
			c.Close()
			ae.t.Fatalf("handshake as %v: %v", w, err)
		}
		c = tc
	}
	ae.t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	return &conn{ae: ae, c: c, br: bufio.NewReader(c), w: w}
}

// send writes one request with w's token and the extra header lines, and
// reads the answer's head.
func (c *conn) send(method, path, body string, headers ...string) *http.Response {
	c.ae.t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n", method, path, len(body))
	if c.w.token != "" {
		b.WriteString("Authorization: Bearer " + c.w.token + "\r\n")
	}
	for _, h := range headers {
		b.WriteString(h + "\r\n")
	}
	b.WriteString("\r\n" + body)
	if _, err := io.WriteString(c.c, b.String()); err != nil {
		c.ae.t.Fatal(err)
	}
	resp, err := http.ReadResponse(c.br, nil)
	if err != nil {
		c.ae.t.Fatalf("%s %s as %v: %v", method, path, c.w, err)
	}
	return resp
}

// answer is an answer's status and JSON body.
type answer struct {
	status int
	body   map[string]any
	header http.Header
	raw    string
}

func (a answer) code() string { s, _ := a.body["code"].(string); return s }

func (c *conn) do(method, path, body string, headers ...string) answer {
	c.ae.t.Helper()
	resp := c.send(method, path, body, headers...)
	data, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		c.ae.t.Fatal(err)
	}
	a := answer{status: resp.StatusCode, header: resp.Header, raw: string(data)}
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "application/json") {
		if err := json.Unmarshal(data, &a.body); err != nil {
			c.ae.t.Fatalf("%s %s: %q is not JSON: %v", method, path, data, err)
		}
	}
	return a
}

// do sends one request as w on a new connection.
func (ae *authEnv) do(w who, method, path, body string, headers ...string) answer {
	ae.t.Helper()
	c := ae.dial(w)
	defer c.c.Close()
	return c.do(method, path, body, headers...)
}

// stream opens an event stream as w; the answer's status is returned, and
// the stream when it is 200.
func (ae *authEnv) stream(w who, path string, headers ...string) (*kit.Stream, int) {
	ae.t.Helper()
	c := ae.dial(w)
	_ = c.c.SetDeadline(time.Time{})
	resp := c.send("GET", path, "", headers...)
	if resp.StatusCode != 200 {
		resp.Body.Close()
		c.c.Close()
		return nil, resp.StatusCode
	}
	// Reading a stream that should go on is bounded, for a broken run.
	_ = c.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	return &kit.Stream{Resp: resp, R: bufio.NewReader(resp.Body)}, 200
}

// ended reports whether the server ends the stream: it reads, skipping
// events, until the stream ends (true) or the read deadline of a broken
// run passes (false).
func ended(s *kit.Stream) bool {
	for {
		_, err := s.R.ReadString('\n')
		if err != nil {
			te, ok := err.(interface{ Timeout() bool })
			return !ok || !te.Timeout()
		}
	}
}

// refusal checks an answer: status and code, the JSON error shape, a
// message the seeds' client does not retry on (docs/API.md), and the
// challenge on a 401.
func refusal(t testing.TB, what string, a answer, status int, code string) {
	t.Helper()
	if a.status != status || a.code() != code {
		t.Fatalf("%s: %d %s, want %d %s", what, a.status, a.raw, status, code)
	}
	msg, _ := a.body["message"].(string)
	if msg == "" || a.body["error"] != msg {
		t.Fatalf("%s: error body %s: want error and message alike", what, a.raw)
	}
	for _, word := range []string{"timeout", "connection", "network", "EOF", "refused"} {
		if strings.Contains(msg, word) {
			t.Fatalf("%s: message %q has %q: the seeds' client would retry it", what, msg, word)
		}
	}
	for _, tok := range []string{tokA, tokB, tokC, tokOp} {
		if strings.Contains(a.raw, tok) {
			t.Fatalf("%s: the answer shows a token: %s", what, a.raw)
		}
	}
	if (status == http.StatusUnauthorized) != (a.header.Get("WWW-Authenticate") != "") {
		t.Fatalf("%s: WWW-Authenticate %q on a %d", what, a.header.Get("WWW-Authenticate"), status)
	}
}

// allowed checks that the identity checks let an answer through.
func allowed(t testing.TB, what string, a answer) {
	t.Helper()
	if a.status == http.StatusUnauthorized || a.code() == api.CodeUnauthorized || a.code() == api.CodeForbidden {
		t.Fatalf("%s: %d %s: the identity checks should let it through", what, a.status, a.raw)
	}
}

// authMode is one way of checking identities, with the credentials of
// nodes a, b and the operator in it.
type authMode struct {
	name        string
	setup       authSetup
	a, b, c, op who
}

var authModes = []authMode{
	{"token/lean", authSetup{tokens: true}, who{token: tokA}, who{token: tokB}, who{token: tokC}, who{token: tokOp}},
	{"token/net-http", authSetup{tokens: true, serial: true}, who{token: tokA}, who{token: tokB}, who{token: tokC}, who{token: tokOp}},
	{"token/https", authSetup{tokens: true, tls: true}, who{token: tokA}, who{token: tokB}, who{token: tokC}, who{token: tokOp}},
	{"mtls", authSetup{mtls: true}, who{cert: "a"}, who{cert: "b"}, who{cert: "c"}, who{cert: "*"}},
	{"token+mtls", authSetup{tokens: true, mtls: true}, who{tokA, "a"}, who{tokB, "b"}, who{tokC, "c"}, who{tokOp, "*"}},
}

// attack runs, in every mode, an attack by node a on node b: prepare
// builds b's state as b, attack must be answered 403 forbidden, and
// control, the same request by b itself, must go through, which shows the
// 403 came from the identity check. check verifies, after the attack and
// before the control, that b's state is intact.
func attack(t *testing.T, refs bool, prepare func(ae *authEnv, m authMode), attack func(ae *authEnv, m authMode) answer, check func(ae *authEnv, m authMode), control func(ae *authEnv, m authMode) answer) {
	for _, m := range authModes {
		t.Run(m.name, func(t *testing.T) {
			s := m.setup
			s.refcount = refs
			ae := newAuthEnv(t, s)
			if prepare != nil {
				prepare(ae, m)
			}
			refusal(t, "attack", attack(ae, m), http.StatusForbidden, api.CodeForbidden)
			if check != nil {
				check(ae, m)
			}
			if a := control(ae, m); a.status != 200 {
				t.Fatalf("the same request by the node itself: %d %s", a.status, a.raw)
			}
			if n := testutil.ToFloat64(ae.srv.am.refusals.WithLabelValues(reasonOtherNode)); n < 1 {
				t.Fatalf("dlock_auth_refusals_total{reason=other_node} = %v", n)
			}
		})
	}
}

const (
	lockB    = `{"type":"pull","resource_id":"r","node_id":"b"}`
	lockC    = `{"type":"pull","resource_id":"r","node_id":"c"}`
	statusOf = "/status?type=pull&resource_id=r"
)

// bHoldsCWaits: b holds pull:r, c waits for it.
func bHoldsCWaits(ae *authEnv, m authMode) {
	if a := ae.do(m.b, "POST", "/lock", lockB); a.body["acquired"] != true {
		ae.t.Fatalf("b's lock: %s", a.raw)
	}
	if a := ae.do(m.c, "POST", "/lock", lockC); a.body["queued"] != true {
		ae.t.Fatalf("c's lock: %s", a.raw)
	}
}

func bStillHolds(ae *authEnv, m authMode) {
	a := ae.do(m.a, "GET", statusOf, "")
	if a.body["holder"] != "b" || a.body["queue_length"] != 1.0 {
		ae.t.Fatalf("after the attack: %s, want b holding and c waiting", a.raw)
	}
}

// TestAuthAttackUnlockAsOtherSuccess: /unlock as b with success:true
// would release b's lock and tell c the work is done.
func TestAuthAttackUnlockAsOtherSuccess(t *testing.T) {
	attack(t, false, bHoldsCWaits,
		func(ae *authEnv, m authMode) answer {
			return ae.do(m.a, "POST", "/unlock", `{"type":"pull","resource_id":"r","node_id":"b","success":true}`)
		},
		bStillHolds,
		func(ae *authEnv, m authMode) answer {
			return ae.do(m.b, "POST", "/unlock", `{"type":"pull","resource_id":"r","node_id":"b","success":true}`)
		})
}

// TestAuthAttackUnlockFailureOrCancelAsOther: /unlock as b with
// success:false, or /cancel as b, would drop b's hold.
func TestAuthAttackUnlockFailureOrCancelAsOther(t *testing.T) {
	attack(t, false, bHoldsCWaits,
		func(ae *authEnv, m authMode) answer {
			a := ae.do(m.a, "POST", "/unlock", `{"type":"pull","resource_id":"r","node_id":"b","success":false,"error":"x"}`)
			refusal(ae.t, "unlock as b, failure", a, http.StatusForbidden, api.CodeForbidden)
			return ae.do(m.a, "POST", "/cancel", lockB)
		},
		bStillHolds,
		func(ae *authEnv, m authMode) answer {
			a := ae.do(m.b, "POST", "/cancel", lockB)
			if a.body["released"] != true {
				ae.t.Fatalf("b's own cancel: %s", a.raw)
			}
			return a
		})
}

func bHasRef(ae *authEnv, m authMode) {
	if a := ae.do(m.b, "POST", "/refcount/add", `{"resource_id":"r","node_id":"b"}`); a.body["count"] != 1.0 {
		ae.t.Fatalf("b's reference: %s", a.raw)
	}
}

func refsAre(ae *authEnv, m authMode, nodes ...string) {
	ae.t.Helper()
	a := ae.do(m.a, "GET", "/refcount?resource_id=r", "")
	got := fmt.Sprint(a.body["nodes"])
	if want := fmt.Sprint(anySlice(nodes)); got != want {
		ae.t.Fatalf("references of r: %s, want %s", a.raw, want)
	}
}

func anySlice(s []string) []any {
	out := make([]any, len(s))
	for i, v := range s {
		out[i] = v
	}
	return out
}

// TestAuthAttackRefReleaseAsOther: /refcount/release as b would drop b's
// reference, and another node's garbage collection could delete the blob b
// still uses.
func TestAuthAttackRefReleaseAsOther(t *testing.T) {
	attack(t, true, bHasRef,
		func(ae *authEnv, m authMode) answer {
			return ae.do(m.a, "POST", "/refcount/release", `{"resource_id":"r","node_id":"b"}`)
		},
		func(ae *authEnv, m authMode) { refsAre(ae, m, "b") },
		func(ae *authEnv, m authMode) answer {
			return ae.do(m.b, "POST", "/refcount/release", `{"resource_id":"r","node_id":"b"}`)
		})
}

// TestAuthAttackRefReleaseAllAsOther: /refcount/release with b's node_id
// and no resource_id would drop every reference of b.
func TestAuthAttackRefReleaseAllAsOther(t *testing.T) {
	attack(t, true, bHasRef,
		func(ae *authEnv, m authMode) answer {
			return ae.do(m.a, "POST", "/refcount/release", `{"node_id":"b"}`)
		},
		func(ae *authEnv, m authMode) { refsAre(ae, m, "b") },
		func(ae *authEnv, m authMode) answer {
			return ae.do(m.b, "POST", "/refcount/release", `{"node_id":"b"}`)
		})
}

// TestAuthAttackRefAddAsOther: /refcount/add as b would pin the blob in
// b's name for ever.
func TestAuthAttackRefAddAsOther(t *testing.T) {
	attack(t, true, nil,
		func(ae *authEnv, m authMode) answer {
			return ae.do(m.a, "POST", "/refcount/add", `{"resource_id":"r","node_id":"b"}`)
		},
		func(ae *authEnv, m authMode) { refsAre(ae, m) },
		func(ae *authEnv, m authMode) answer {
			return ae.do(m.b, "POST", "/refcount/add", `{"resource_id":"r","node_id":"b"}`)
		})
}

// TestAuthAttackSubscribeAsOtherReplay: /subscribe?node_id=b with
// Last-Event-ID: 0 would replay b's events and keep b's session alive
// after b died.
func TestAuthAttackSubscribeAsOtherReplay(t *testing.T) {
	attack(t, false,
		func(ae *authEnv, m authMode) {
			s, _ := ae.stream(m.b, "/subscribe?node_id=b")
			s.Next(ae.t)
			ae.do(m.b, "POST", "/lock", lockB)
			if f := s.Next(ae.t); f.Event != "lock_assigned" {
				ae.t.Fatalf("b's grant: %+v", f)
			}
			s.Close()
		},
		func(ae *authEnv, m authMode) answer {
			for _, p := range []string{"/subscribe?node_id=b", "/lock/subscribe?node_id=b", "/subscribe?node_id=b&type=pull&resource_id=r"} {
				if s, status := ae.stream(m.a, p, "Last-Event-ID: 0"); s != nil || status != http.StatusForbidden {
					ae.t.Fatalf("%s as a: %d", p, status)
				}
			}
			return ae.do(m.a, "GET", "/subscribe?node_id=b", "", "Last-Event-ID: 0")
		},
		nil,
		func(ae *authEnv, m authMode) answer {
			s, status := ae.stream(m.b, "/subscribe?node_id=b", "Last-Event-ID: 0")
			if s == nil {
				ae.t.Fatalf("b's own replay: %d", status)
			}
			s.Next(ae.t)
			if f := s.Next(ae.t); f.Event != "lock_assigned" || f.JSON(ae.t)["node_id"] != "b" {
				ae.t.Fatalf("b's replay: %+v", f)
			}
			return answer{status: status}
		})
}

// TestAuthAttackStatusRenewsOthersLease: /status?node_id=b renews b's ttl
// lease, which would keep a dead b's hold alive.
func TestAuthAttackStatusRenewsOthersLease(t *testing.T) {
	attack(t, false, bHoldsCWaits,
		func(ae *authEnv, m authMode) answer {
			return ae.do(m.a, "GET", statusOf+"&node_id=b", "")
		},
		bStillHolds,
		func(ae *authEnv, m authMode) answer {
			return ae.do(m.b, "GET", statusOf+"&node_id=b", "")
		})
}

// routeCase is one request of the matrix; node is where it names a node
// ("" for none), filled in by the test.
type routeCase struct {
	method, path, body string
	names              bool // the request names a node
	operator           bool // an operator's route
	open               bool // no credential needed
	stream             bool
}

func routeCases(node string) map[string]routeCase {
	key := `{"type":"pull","resource_id":"r","node_id":"` + node + `"}`
	return map[string]routeCase{
		"/lock":                   {method: "POST", path: "/lock", body: key, names: true},
		"/unlock":                 {method: "POST", path: "/unlock", body: key, names: true},
		"/cancel":                 {method: "POST", path: "/cancel", body: key, names: true},
		"/status":                 {method: "GET", path: statusOf + "&node_id=" + node, names: true},
		"/status (no node)":       {method: "GET", path: statusOf},
		"/subscribe":              {method: "GET", path: "/subscribe?node_id=" + node, names: true, stream: true},
		"/lock/subscribe":         {method: "GET", path: "/lock/subscribe?node_id=" + node, names: true, stream: true},
		"/subscribe (observer)":   {method: "GET", path: "/subscribe?type=pull&resource_id=r", stream: true},
		"/refcount":               {method: "GET", path: "/refcount?resource_id=r"},
		"/refcount/add":           {method: "POST", path: "/refcount/add", body: `{"resource_id":"r","node_id":"` + node + `"}`, names: true},
		"/refcount/release":       {method: "POST", path: "/refcount/release", body: `{"resource_id":"r","node_id":"` + node + `"}`, names: true},
		"/refcount/release (all)": {method: "POST", path: "/refcount/release", body: `{"node_id":"` + node + `"}`, names: true},
		"/healthz":                {method: "GET", path: "/healthz", open: true},
		"/readyz":                 {method: "GET", path: "/readyz", open: true},
		"/metrics":                {method: "GET", path: "/metrics", operator: true},
		"/ui":                     {method: "GET", path: "/ui", operator: true},
		"/ui/api/keys":            {method: "GET", path: "/ui/api/keys", operator: true},
		"/ui/api/completions":     {method: "GET", path: "/ui/api/completions", operator: true},
		"/ui/api/sessions":        {method: "GET", path: "/ui/api/sessions", operator: true},
		"/ui/events":              {method: "GET", path: "/ui/events", operator: true, stream: true},
		"/nope (unknown path)":    {method: "GET", path: "/nope"},
	}
}

// TestAuthMatrix: every route, in every mode, with no credential, a
// credential the server does not know, node a acting as itself and as b,
// and the operator acting as b. The matrix names every route the server
// has, so a new route cannot skip it.
func TestAuthMatrix(t *testing.T) {
	for _, m := range authModes {
		t.Run(m.name, func(t *testing.T) {
			s := m.setup
			s.refcount = true
			ae := newAuthEnv(t, s)
			covered := map[string]bool{}
			for _, c := range routeCases("x") {
				covered[strings.SplitN(c.path, "?", 2)[0]] = true
			}
			if missing := slices.DeleteFunc(slices.Collect(maps.Keys(ae.srv.routes)), func(p string) bool { return covered[p] }); len(missing) > 0 {
				t.Fatalf("routes missing from the matrix: %v", missing)
			}
			var strangers []who
			if m.setup.tokens {
				strangers = append(strangers, who{token: "not-a-token-of-this-server", cert: m.a.cert}, who{token: tokA + "x", cert: m.a.cert})
			}
			if m.setup.mtls {
				strangers = append(strangers, who{token: m.a.token}) // no certificate
			}
			try := func(w who, c routeCase) answer {
				t.Helper()
				if c.stream {
					if s, status := ae.stream(w, c.path); s != nil {
						s.Close()
						return answer{status: status}
					}
				}
				return ae.do(w, c.method, c.path, c.body)
			}
			names := slices.Sorted(maps.Keys(routeCases("x")))
			for _, name := range names {
				c := routeCases("b")[name]
				what := func(w string) string { return fmt.Sprintf("%s as %s", name, w) }
				for _, w := range append([]who{{}}, strangers...) {
					a := try(w, c)
					if c.open {
						allowed(t, what(w.String()), a)
						continue
					}
					if a.status != http.StatusUnauthorized {
						t.Fatalf("%s: %d %s, want 401", what(w.String()), a.status, a.raw)
					}
					if !c.stream {
						refusal(t, what(w.String()), a, http.StatusUnauthorized, api.CodeUnauthorized)
					}
				}
				if a := try(m.op, c); c.path != "/nope" {
					allowed(t, what("the operator"), a)
				} else if a.status != http.StatusNotFound {
					t.Fatalf("%s: %d, want 404", what("the operator"), a.status)
				}
				a := try(m.a, c)
				switch {
				case c.names || c.operator:
					if a.status != http.StatusForbidden {
						t.Fatalf("%s: %d %s, want 403", what("a"), a.status, a.raw)
					}
					if !c.stream {
						refusal(t, what("a"), a, http.StatusForbidden, api.CodeForbidden)
					}
				default:
					allowed(t, what("a"), a)
				}
				if c.names {
					allowed(t, name+" as a, naming a", try(m.a, routeCases("a")[name]))
				}
			}
		})
	}
}

// TestAuthOperatorOnly: /ui and /metrics serve the operator and no node.
func TestAuthOperatorOnly(t *testing.T) {
	ae := newAuthEnv(t, authSetup{tokens: true})
	if a := ae.do(who{token: tokOp}, "GET", "/ui", ""); a.status != 200 || !strings.Contains(a.raw, "<html") {
		t.Fatalf("operator on /ui: %d", a.status)
	}
	if a := ae.do(who{token: tokOp}, "GET", "/metrics", ""); a.status != 200 || !strings.Contains(a.raw, "dlock_auth_refusals_total") {
		t.Fatalf("operator on /metrics: %d", a.status)
	}
	refusal(t, "node a on /ui", ae.do(who{token: tokA}, "GET", "/ui", ""), 403, api.CodeForbidden)
	refusal(t, "node a on /metrics", ae.do(who{token: tokA}, "GET", "/metrics", ""), 403, api.CodeForbidden)
	refusal(t, "nobody on /ui", ae.do(who{}, "GET", "/ui", ""), 401, api.CodeUnauthorized)
	if a := ae.do(who{}, "GET", "/healthz", ""); a.status != 200 {
		t.Fatalf("/healthz without a token: %d", a.status)
	}
	if n := testutil.ToFloat64(ae.srv.am.refusals.WithLabelValues(reasonOperatorOnly)); n != 2 {
		t.Fatalf("operator_only refusals %v", n)
	}
}

// TestAuthHostileHeaders: what a hostile client may try with its
// Authorization header, on both loops.
func TestAuthHostileHeaders(t *testing.T) {
	lockA := `{"type":"pull","resource_id":"r","node_id":"a"}`
	for _, serial := range []bool{false, true} {
		t.Run(fmt.Sprint("net-http-only=", serial), func(t *testing.T) {
			ae := newAuthEnv(t, authSetup{tokens: true, serial: serial})
			none := who{}
			for _, tc := range []struct {
				name    string
				path    string
				headers []string
				reason  string // "" when allowed
			}{
				{"token in the query string", "/lock?access_token=" + tokA, nil, reasonNoToken},
				{"token in a query parameter", "/lock?token=" + tokA, nil, reasonNoToken},
				{"lower-case header and scheme", "/lock", []string{"authorization: bearer " + tokA}, ""},
				{"upper-case scheme", "/lock", []string{"AUTHORIZATION: BEARER " + tokA}, ""},
				{"spaces around and between", "/lock", []string{"Authorization:   Bearer    " + tokA + "  "}, ""},
				{"tab between scheme and token", "/lock", []string{"Authorization: Bearer\t" + tokA}, reasonBadHeader},
				{"two tokens", "/lock", []string{"Authorization: Bearer " + tokA + " " + tokA}, reasonBadHeader},
				{"a list", "/lock", []string{"Authorization: Bearer " + tokA + ", Bearer " + tokB}, reasonBadHeader},
				{"Basic", "/lock", []string{"Authorization: Basic YTpi"}, reasonBadHeader},
				{"no scheme", "/lock", []string{"Authorization: " + tokA}, reasonBadHeader},
				{"empty header", "/lock", []string{"Authorization:"}, reasonNoToken},
				{"padding added", "/lock", []string{"Authorization: Bearer " + tokA + "="}, reasonUnknownToken},
				{"token in another case", "/lock", []string{"Authorization: Bearer " + strings.ToUpper(tokA)}, reasonUnknownToken},
				{"the same header twice", "/lock", []string{"Authorization: Bearer " + tokA, "Authorization: Bearer " + tokA}, reasonBadHeader},
				{"two different headers", "/lock", []string{"Authorization: Bearer " + tokB, "Authorization: Bearer " + tokA}, reasonBadHeader},
				{"a huge header", "/lock", []string{"Authorization: Bearer " + strings.Repeat("x", 8000)}, reasonUnknownToken},
				{"token as a cookie", "/lock", []string{"Cookie: token=" + tokA}, reasonNoToken},
				{"proxy header", "/lock", []string{"Proxy-Authorization: Bearer " + tokA}, reasonNoToken},
			} {
				before := testutil.ToFloat64(ae.srv.am.refusals.WithLabelValues(cmpOrStr(tc.reason, reasonNoToken)))
				a := ae.do(none, "POST", tc.path, lockA, tc.headers...)
				if tc.reason == "" {
					if a.status != 200 {
						t.Fatalf("%s: %d %s", tc.name, a.status, a.raw)
					}
					continue
				}
				refusal(t, tc.name, a, 401, api.CodeUnauthorized)
				if got := testutil.ToFloat64(ae.srv.am.refusals.WithLabelValues(tc.reason)); got != before+1 {
					t.Fatalf("%s: dlock_auth_refusals_total{reason=%s} %v → %v", tc.name, tc.reason, before, got)
				}
			}
		})
	}
}

func cmpOrStr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// TestAuthHostileBodies: the node a request acts as is the one the
// backend is given, however the body or the query spells it.
func TestAuthHostileBodies(t *testing.T) {
	for _, serial := range []bool{false, true} {
		t.Run(fmt.Sprint("net-http-only=", serial), func(t *testing.T) {
			ae := newAuthEnv(t, authSetup{tokens: true, serial: serial})
			a := who{token: tokA}
			for _, tc := range []struct {
				name, body string
				ok         bool
			}{
				{"a second node_id key, b last", `{"type":"pull","resource_id":"r","node_id":"a","node_id":"b"}`, false},
				{"a second node_id key, a last", `{"type":"pull","resource_id":"r","node_id":"b","node_id":"a"}`, true},
				{"a key in another case", `{"type":"pull","resource_id":"r","node_id":"a","NODE_ID":"b"}`, false},
				{"an escaped b", `{"type":"pull","resource_id":"r","node_id":"\u0062"}`, false},
				{"an escaped a", `{"type":"pull","resource_id":"r","node_id":"\u0061"}`, true},
				{"node A for node a", `{"type":"pull","resource_id":"r","node_id":"A"}`, false},
				{"node a with a space", `{"type":"pull","resource_id":"r","node_id":"a "}`, false},
				{"b nested in an extra field", `{"type":"pull","resource_id":"r","node_id":"a","x":{"node_id":"b"}}`, true},
			} {
				got := ae.do(a, "POST", "/lock", tc.body)
				if !tc.ok {
					refusal(t, tc.name, got, 403, api.CodeForbidden)
					continue
				}
				if got.status != 200 || got.body["holder"] != "a" {
					t.Fatalf("%s: %d %s, want a holding", tc.name, got.status, got.raw)
				}
				ae.do(a, "POST", "/unlock", `{"type":"pull","resource_id":"r","node_id":"a","success":false}`)
			}
			if st := ae.do(a, "GET", statusOf, ""); st.body["state"] != "free" {
				t.Fatalf("a refused body took the lock: %s", st.raw)
			}
			// The query: what is checked is what the backend gets.
			s, status := ae.stream(a, "/subscribe?node_id=a&node_id=b")
			if s == nil {
				t.Fatalf("node_id=a&node_id=b: %d", status)
			}
			if f := s.Next(t); f.JSON(t)["node_id"] != "a" {
				t.Fatalf("node_id=a&node_id=b subscribed %s", f.Data)
			}
			s.Close()
			if _, status := ae.stream(a, "/subscribe?node_id=b&node_id=a"); status != 403 {
				t.Fatalf("node_id=b&node_id=a: %d", status)
			}
			if _, status := ae.stream(a, "/subscribe?node_id=%62"); status != 403 {
				t.Fatalf("node_id=%%62: %d", status)
			}
			refusal(t, "status as b, escaped", ae.do(a, "GET", statusOf+"&node_id=%62", ""), 403, api.CodeForbidden)
		})
	}
}

// TestAuthReplayIsOwnOnly: a node's Last-Event-ID replays its own
// session's events only, whatever id it sends: event ids are per session,
// and another node's ids name nothing of its own.
func TestAuthReplayIsOwnOnly(t *testing.T) {
	ae := newAuthEnv(t, authSetup{tokens: true})
	a, b := who{token: tokA}, who{token: tokB}
	sb, _ := ae.stream(b, "/subscribe?node_id=b")
	sb.Next(t)
	sa, _ := ae.stream(a, "/subscribe?node_id=a")
	first := sa.Next(t)
	for i := range 3 {
		ae.do(b, "POST", "/lock", `{"type":"pull","resource_id":"b`+strconv.Itoa(i)+`","node_id":"b"}`)
		sb.Next(t)
	}
	ae.do(a, "POST", "/lock", `{"type":"pull","resource_id":"mine","node_id":"a"}`)
	sa.Next(t)
	sa.Close()
	sb.Close()
	for _, last := range []string{"0", first.ID, "1", "2", "3", "18446744073709551615", "-1", "x"} {
		s, status := ae.stream(a, "/subscribe?node_id=a", "Last-Event-ID: "+last)
		if s == nil {
			t.Fatalf("Last-Event-ID %s: %d", last, status)
		}
		s.Next(t)
		// A sentinel grant ends what the replay could hold.
		res := "sentinel-" + last
		ae.do(a, "POST", "/lock", `{"type":"pull","resource_id":"`+res+`","node_id":"a"}`)
		for {
			f := s.Next(t)
			d := f.JSON(t)
			if d["node_id"] != "a" {
				t.Fatalf("Last-Event-ID %s: a's stream replayed %s", last, f.Data)
			}
			if d["resource_id"] == res {
				break
			}
		}
		s.Close()
	}
}

// TestAuthRevokedTokenEndsStream: a reload that removes a token ends the
// event streams it opened, on the lean loop's hijacked streams, on
// net/http, and over HTTP/2 (the ResponseWriter path); other tokens'
// streams go on; the removed token is refused at once, also on a
// keep-alive connection that used it.
func TestAuthRevokedTokenEndsStream(t *testing.T) {
	for _, s := range []authSetup{{tokens: true}, {tokens: true, serial: true}, {tokens: true, tls: true}} {
		t.Run(fmt.Sprintf("serial=%v/tls=%v", s.serial, s.tls), func(t *testing.T) {
			ae := newAuthEnv(t, s)
			a, b, op := who{token: tokA}, who{token: tokB}, who{token: tokOp}
			sa, _ := ae.stream(a, "/subscribe?node_id=a")
			sa.Next(t)
			sb, _ := ae.stream(b, "/subscribe?node_id=b")
			sb.Next(t)
			so, _ := ae.stream(op, "/ui/events")
			if _, err := so.R.ReadString('\n'); err != nil {
				t.Fatal(err)
			}
			var h2a *kit.Stream
			if s.tls {
				h2a = ae.h2Stream(a, "/subscribe?node_id=a")
				h2a.Next(t)
			}
			keep := ae.dial(a)
			if r := keep.do("GET", statusOf, ""); r.status != 200 {
				t.Fatalf("a's status: %d", r.status)
			}

			authtest.WriteFile(t, ae.tokensPath, []byte(tokB+" b\n"))
			if err := ae.srv.Reload(); err != nil {
				t.Fatal(err)
			}
			if !ended(sa) || !ended(so) {
				t.Fatal("a stream of a removed token goes on")
			}
			if h2a != nil && !ended(h2a) {
				t.Fatal("an HTTP/2 stream of a removed token goes on")
			}
			refusal(t, "a removed token", ae.do(a, "GET", statusOf, ""), 401, api.CodeUnauthorized)
			refusal(t, "a removed token on a keep-alive connection", keep.do("GET", statusOf, ""), 401, api.CodeUnauthorized)
			ae.do(b, "POST", "/lock", lockB)
			if f := sb.Next(t); f.Event != "lock_assigned" {
				t.Fatalf("b's stream after the reload: %+v", f)
			}
			want := 2.0
			if h2a != nil {
				want = 3
			}
			if n := testutil.ToFloat64(ae.srv.am.revokedStreams); n != want {
				t.Fatalf("dlock_auth_revoked_streams_total %v, want %v", n, want)
			}
			if n := testutil.ToFloat64(ae.srv.am.reloads.WithLabelValues("tokens", "ok")); n != 1 {
				t.Fatalf("reloads %v", n)
			}
			// A bad file: the table stays, the error is reported.
			authtest.WriteFile(t, ae.tokensPath, []byte("short b\n"))
			if err := ae.srv.Reload(); err == nil || strings.Contains(err.Error(), "short") {
				t.Fatalf("a bad token file: %v", err)
			}
			if r := ae.do(b, "GET", statusOf, ""); r.status != 200 {
				t.Fatalf("b after a failed reload: %d", r.status)
			}
		})
	}
}

// h2Stream opens an event stream over HTTP/2 (TLS with ALPN h2): net/http
// serves it through its ResponseWriter.
func (ae *authEnv) h2Stream(w who, path string) *kit.Stream {
	ae.t.Helper()
	tr := &http.Transport{TLSClientConfig: ae.clientTLS(w, true), ForceAttemptHTTP2: true}
	ae.t.Cleanup(tr.CloseIdleConnections)
	req, _ := http.NewRequest("GET", "https://"+ae.addr+path, nil)
	if w.token != "" {
		req.Header.Set("Authorization", "Bearer "+w.token)
	}
	// The timeout bounds a broken run only.
	resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		ae.t.Fatal(err)
	}
	ae.t.Cleanup(func() { resp.Body.Close() })
	if resp.StatusCode != 200 || resp.ProtoMajor != 2 {
		ae.t.Fatalf("HTTP/2 stream: %d %s", resp.StatusCode, resp.Proto)
	}
	return &kit.Stream{Resp: resp, R: bufio.NewReader(resp.Body)}
}

// h2Do sends one request over HTTP/2 as w, with the header lines
// ("Name: value") given.
func (ae *authEnv) h2Do(w who, method, path, body string, headers ...string) answer {
	ae.t.Helper()
	tr := &http.Transport{TLSClientConfig: ae.clientTLS(w, true), ForceAttemptHTTP2: true}
	defer tr.CloseIdleConnections()
	req, _ := http.NewRequest(method, "https://"+ae.addr+path, strings.NewReader(body))
	if w.token != "" {
		req.Header.Set("Authorization", "Bearer "+w.token)
	}
	for _, h := range headers {
		k, v, _ := strings.Cut(h, ":")
		req.Header.Add(k, strings.TrimSpace(v))
	}
	resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		ae.t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.ProtoMajor != 2 {
		ae.t.Fatalf("%s %s over %s, want HTTP/2", method, path, resp.Proto)
	}
	data, _ := io.ReadAll(resp.Body)
	a := answer{status: resp.StatusCode, header: resp.Header, raw: string(data)}
	_ = json.Unmarshal(data, &a.body)
	return a
}

// TestAuthMTLSOverHTTP2: over HTTP/2 (net/http, not the lean loop) a
// certificate for a acts as a and not as b, and no certificate is 401.
func TestAuthMTLSOverHTTP2(t *testing.T) {
	ae := newAuthEnv(t, authSetup{mtls: true})
	if a := ae.h2Do(who{cert: "a"}, "POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"a"}`); a.body["acquired"] != true {
		t.Fatalf("a as a over h2: %d %s", a.status, a.raw)
	}
	refusal(t, "a as b over h2", ae.h2Do(who{cert: "a"}, "POST", "/unlock", `{"type":"pull","resource_id":"r","node_id":"b"}`), 403, api.CodeForbidden)
	refusal(t, "no certificate over h2", ae.h2Do(who{}, "GET", statusOf, ""), 401, api.CodeUnauthorized)
	refusal(t, "a as b on /status over h2", ae.h2Do(who{cert: "a"}, "GET", statusOf+"&node_id=b", ""), 403, api.CodeForbidden)
	if a := ae.h2Do(who{cert: "*"}, "POST", "/unlock", `{"type":"pull","resource_id":"r","node_id":"a"}`); a.status != 200 {
		t.Fatalf("the operator's certificate as a over h2: %d %s", a.status, a.raw)
	}
}

// TestAuthCertificateNames: a certificate names nodes by its CN and its
// DNS SANs, exactly.
func TestAuthCertificateNames(t *testing.T) {
	ae := newAuthEnv(t, authSetup{mtls: true})
	ae.certs["multi"] = ae.ca.Node(t, "node-a", "node-a", "alias-a").TLS(t)
	ae.certs["san-only"] = ae.ca.Node(t, "", "node-s").TLS(t)
	ae.certs["wildcard"] = ae.ca.Node(t, "*.nodes", "*.nodes").TLS(t)
	for _, tc := range []struct {
		cert, node string
		ok         bool
	}{
		{"multi", "node-a", true}, {"multi", "alias-a", true}, {"multi", "node-b", false}, {"multi", "Node-A", false},
		{"san-only", "node-s", true}, {"san-only", "", false},
		{"wildcard", "x.nodes", false}, {"wildcard", "*.nodes", true},
	} {
		if tc.node == "" {
			continue
		}
		a := ae.do(who{cert: tc.cert}, "GET", statusOf+"&node_id="+tc.node, "")
		if tc.ok {
			allowed(t, tc.cert+" as "+tc.node, a)
		} else {
			refusal(t, tc.cert+" as "+tc.node, a, 403, api.CodeForbidden)
		}
	}
}

// TestAuthTokenAndCertBothChecked: with a token file and mTLS, a request
// needs both, and both must allow the node it names.
func TestAuthTokenAndCertBothChecked(t *testing.T) {
	ae := newAuthEnv(t, authSetup{tokens: true, mtls: true})
	for _, tc := range []struct {
		w      who
		status int
	}{
		{who{tokA, "a"}, 200},
		{who{tokA, "b"}, 403},
		{who{tokB, "a"}, 403},
		{who{tokOp, "a"}, 200},
		{who{tokA, "*"}, 200},
		{who{tokOp, "b"}, 403},
		{who{"", "a"}, 401},
		{who{tokA, ""}, 401},
	} {
		a := ae.do(tc.w, "GET", statusOf+"&node_id=a", "")
		if a.status != tc.status {
			t.Fatalf("%v as a: %d %s, want %d", tc.w, a.status, a.raw, tc.status)
		}
	}
	// The operator's token on /ui still needs an operator's certificate.
	refusal(t, "operator token, node a's certificate, on /ui", ae.do(who{tokOp, "a"}, "GET", "/ui", ""), 403, api.CodeForbidden)
	if a := ae.do(who{tokOp, "*"}, "GET", "/ui", ""); a.status != 200 {
		t.Fatalf("operator on /ui: %d", a.status)
	}
}

// TestAuthCertRotation: a reload serves new certificates to new
// connections while open streams keep going (docs/SECURITY.md); when the
// new client CA no longer signs a connection's certificate, its next
// request is 401, new connections with it fail the handshake, and its
// open streams end.
func TestAuthCertRotation(t *testing.T) {
	ae := newAuthEnv(t, authSetup{mtls: true})
	a := who{cert: "a"}
	s1, _ := ae.stream(a, "/subscribe?node_id=a")
	s1.Next(t)
	h2 := ae.h2Stream(a, "/subscribe?node_id=a")
	h2.Next(t)
	keep := ae.dial(a)
	if r := keep.do("GET", statusOf, ""); r.status != 200 {
		t.Fatalf("status: %d", r.status)
	}
	serverSerial := func() string {
		c := ae.dial(who{cert: "a"})
		defer c.c.Close()
		return c.c.(*tls.Conn).ConnectionState().PeerCertificates[0].SerialNumber.String()
	}
	old := serverSerial()
	grant := func(res string) {
		t.Helper()
		ae.do(a, "POST", "/lock", `{"type":"pull","resource_id":"`+res+`","node_id":"a"}`)
		for _, s := range []*kit.Stream{s1, h2} {
			if f := s.Next(t); f.Event != "lock_assigned" || f.JSON(t)["resource_id"] != res {
				t.Fatalf("stream after rotation: %+v", f)
			}
		}
	}

	// Rotation: a new server certificate, a second CA added to the bundle.
	ca2 := authtest.NewCA(t, "second CA")
	ae.ca.Server(t).Write(t, ae.dir, "server")
	authtest.WriteFile(t, ae.caFile, append(append([]byte{}, ae.ca.PEM...), ca2.PEM...))
	if err := ae.srv.Reload(); err != nil {
		t.Fatal(err)
	}
	if serverSerial() == old {
		t.Fatal("a new connection still gets the old server certificate")
	}
	grant("after-rotation")
	if r := keep.do("GET", statusOf, ""); r.status != 200 {
		t.Fatalf("keep-alive connection after a rotation: %d %s", r.status, r.raw)
	}
	ae.certs["b2"] = ca2.Node(t, "b").TLS(t)
	if r := ae.do(who{cert: "b2"}, "GET", statusOf+"&node_id=b", ""); r.status != 200 {
		t.Fatalf("a certificate of the added CA: %d %s", r.status, r.raw)
	}

	// The first CA is dropped.
	authtest.WriteFile(t, ae.caFile, ca2.PEM)
	if err := ae.srv.Reload(); err != nil {
		t.Fatal(err)
	}
	refusal(t, "a dropped CA's certificate on a keep-alive connection", keep.do("GET", statusOf, ""), 401, api.CodeUnauthorized)
	if n := testutil.ToFloat64(ae.srv.am.refusals.WithLabelValues(reasonUntrusted)); n != 1 {
		t.Fatalf("untrusted_certificate refusals %v", n)
	}
	c, err := net.Dial("tcp", ae.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	tc := tls.Client(c, ae.clientTLS(a, false))
	_ = tc.SetDeadline(time.Now().Add(10 * time.Second))
	if err := tc.Handshake(); err == nil {
		// TLS 1.3: the server's refusal arrives after the client's side.
		if _, err := tc.Read(make([]byte, 1)); err == nil {
			t.Fatal("a dropped CA's certificate passed a new handshake")
		}
	}
	// The open streams, made with the dropped CA's certificate, end: they
	// would keep the node's session, and its session-leased locks, alive.
	for _, s := range []*kit.Stream{s1, h2} {
		if !ended(s) {
			t.Fatal("a stream of a dropped CA's certificate goes on")
		}
	}
	kit.WaitFor(t, "both streams counted as revoked", func() bool {
		return testutil.ToFloat64(ae.srv.am.revokedStreams) == 2
	})
	ae.certs["a2"] = ca2.Node(t, "a").TLS(t)
	if r := ae.do(who{cert: "a2"}, "GET", statusOf+"&node_id=a", ""); r.status != 200 {
		t.Fatalf("the added CA's certificate for a: %d %s", r.status, r.raw)
	}

	// A broken reload keeps what works.
	authtest.WriteFile(t, ae.certFile, []byte("not a certificate"))
	if err := ae.srv.Reload(); err == nil {
		t.Fatal("a broken certificate reloaded")
	}
	if n := testutil.ToFloat64(ae.srv.am.reloads.WithLabelValues("tls", "error")); n != 1 {
		t.Fatalf("tls reload errors %v", n)
	}
	if r := ae.do(who{cert: "a2"}, "GET", statusOf, ""); r.status != 200 {
		t.Fatalf("after a failed reload: %d", r.status)
	}
}

// TestAuthTLSWithoutClientCA: TLS alone checks no identity; plain HTTP to
// the TLS port fails the handshake, counted.
func TestAuthTLSWithoutClientCA(t *testing.T) {
	ae := newAuthEnv(t, authSetup{tls: true})
	if a := ae.do(who{}, "POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"a"}`); a.body["acquired"] != true {
		t.Fatalf("lock over TLS: %d %s", a.status, a.raw)
	}
	if a := ae.do(who{}, "GET", "/metrics", ""); a.status != 200 {
		t.Fatalf("/metrics over TLS without identities: %d", a.status)
	}
	resp := rawExchangeOrClosed(t, ae.addr, rawPost("/lock", `{"type":"pull","resource_id":"p","node_id":"a"}`))
	if resp != nil && resp.StatusCode == 200 {
		t.Fatal("plain HTTP served on the TLS port")
	}
	kit.WaitFor(t, "the failed handshake counted", func() bool { return testutil.ToFloat64(ae.srv.am.handshakeErrors) == 1 })
}

// rawExchangeOrClosed writes raw and reads one answer, nil when the
// server closes the connection instead.
func rawExchangeOrClosed(t *testing.T, addr, raw string) *http.Response {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, raw); err != nil {
		return nil
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return nil
	}
	resp.Body.Close()
	return resp
}

// TestAuthOffAnswersAsBefore: without a token file or client CA nothing
// is checked (the seeds' original client sends no credential) and the
// identity metrics do not exist.
func TestAuthOffAnswersAsBefore(t *testing.T) {
	e := newEnv(t, nil)
	if e.srv.guarded || e.srv.am != nil {
		t.Fatal("identities checked without a token file or client CA")
	}
	status, body := e.call("POST", "/unlock", `{"type":"pull","resource_id":"r","node_id":"b","success":true}`)
	if status != 403 || body["code"] != "not_holder" {
		t.Fatalf("unlock without auth: %d %v", status, body)
	}
	resp, err := http.Get(e.ts.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	data, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || strings.Contains(string(data), "dlock_auth_") || strings.Contains(string(data), "dlock_tls_") {
		t.Fatalf("/metrics without auth: %d, identity metrics present: %v", resp.StatusCode, strings.Contains(string(data), "dlock_auth_"))
	}
}

// TestAuthPipelinedEachChecked: the lean loop checks every request of a
// pipelined batch on its own: a token on the first does not carry over to
// the next, nor does a connection passed to net/http keep one.
func TestAuthPipelinedEachChecked(t *testing.T) {
	ae := newAuthEnv(t, authSetup{tokens: true})
	lockA := `{"type":"pull","resource_id":"r","node_id":"a"}`
	raw := rawPost("/lock", lockA, "Authorization: Bearer "+tokA) +
		rawPost("/lock", lockA) +
		rawPost("/unlock", lockA, "Authorization: Bearer "+tokB) +
		"GET " + statusOf + "&node_id=a HTTP/1.1\r\nHost: x\r\n\r\n" + // passed to net/http
		"GET " + statusOf + "&node_id=a HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + tokA + "\r\n\r\n" +
		rawPost("/unlock", lockA, "Connection: close")
	want := []int{200, 401, 403, 401, 200, 401}
	for i, resp := range rawExchange(t, ae.addr, raw, len(want)) {
		if resp.StatusCode != want[i] {
			t.Fatalf("request %d: %d %s, want %d", i+1, resp.StatusCode, bodyOf(resp), want[i])
		}
	}
}

// BenchmarkAuthLockUnlock: one keep-alive connection sending /lock and
// /unlock pairs through the lean loop, without identities, with a bearer
// token, and over mTLS with a token. One op is one pair.
func BenchmarkAuthLockUnlock(b *testing.B) {
	for _, bc := range []struct {
		name  string
		setup authSetup
		w     who
	}{
		{"off", authSetup{}, who{}},
		{"token", authSetup{tokens: true}, who{token: tokA}},
		{"tls", authSetup{tls: true}, who{}},
		{"mtls+token", authSetup{tokens: true, mtls: true}, who{tokA, "a"}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			ae := newAuthEnv(b, bc.setup)
			c := ae.dial(bc.w)
			auth := ""
			if bc.w.token != "" {
				auth = "Authorization: Bearer " + bc.w.token + "\r\n"
			}
			body := `{"type":"pull","resource_id":"r","node_id":"a"}`
			req := func(path string) string {
				return "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n" + auth + "\r\n" + body
			}
			pair := []byte(req("/lock") + req("/unlock"))
			_ = c.c.SetDeadline(time.Time{})
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if _, err := c.c.Write(pair); err != nil {
					b.Fatal(err)
				}
				for range 2 {
					resp, err := http.ReadResponse(c.br, nil)
					if err != nil || resp.StatusCode != 200 {
						b.Fatalf("%v %v", resp, err)
					}
					_, _ = io.Copy(io.Discard, resp.Body)
				}
			}
		})
	}
}

// basicAuth is the Authorization header line a browser sends for the user
// name user and the password tok (RFC 7617).
func basicAuth(user, tok string) string {
	return "Authorization: Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+tok))
}

// challenges checks a 401's challenges: Basic's, then Bearer's, where
// Basic credentials are accepted; Bearer's alone elsewhere.
func challenges(t testing.TB, what string, h http.Header, basic bool) {
	t.Helper()
	want := []string{wwwAuthenticateValue}
	if basic {
		want = []string{basicChallengeValue, wwwAuthenticateValue}
	}
	if got := h.Values("WWW-Authenticate"); !slices.Equal(got, want) {
		t.Fatalf("%s: WWW-Authenticate %q, want %q", what, got, want)
	}
}

// h2Get sends GET path over HTTP/2 with w's certificate and the header
// lines; the caller closes the body.
func (ae *authEnv) h2Get(w who, path string, headers ...string) *http.Response {
	ae.t.Helper()
	tr := &http.Transport{TLSClientConfig: ae.clientTLS(w, true), ForceAttemptHTTP2: true}
	ae.t.Cleanup(tr.CloseIdleConnections)
	req, _ := http.NewRequest("GET", "https://"+ae.addr+path, nil)
	for _, h := range headers {
		k, v, _ := strings.Cut(h, ":")
		req.Header.Add(k, strings.TrimSpace(v))
	}
	// The timeout bounds a broken run only.
	resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		ae.t.Fatal(err)
	}
	ae.t.Cleanup(func() { resp.Body.Close() })
	if resp.ProtoMajor != 2 {
		ae.t.Fatalf("GET %s over %s, want HTTP/2", path, resp.Proto)
	}
	return resp
}

// TestAuthBasicOperator: a browser's way to the operator's page. On GET
// of /metrics, /ui and /ui/* the operator token may come as the password
// of Basic credentials, looked up and checked for "*" as a Bearer token
// is, and a 401 there challenges Basic too, so that a browser asks for
// it. Basic on any other route, or with any other method, is 401
// bad_header with the Bearer challenge alone: credentials a browser keeps
// never reach a request that changes something. Through the lean loop
// (the POSTs), net/http, HTTPS and HTTP/2, and with a client CA too.
func TestAuthBasicOperator(t *testing.T) {
	lockOp := `{"type":"pull","resource_id":"r","node_id":"op"}`
	lockA := `{"type":"pull","resource_id":"r","node_id":"a"}`
	for _, m := range []struct {
		name  string
		setup authSetup
		op, a string // the certificates sent with the operator's and a's tokens
	}{
		{"lean", authSetup{tokens: true}, "", ""},
		{"net-http", authSetup{tokens: true, serial: true}, "", ""},
		{"https", authSetup{tokens: true, tls: true}, "", ""},
		{"token+mtls", authSetup{tokens: true, mtls: true}, "*", "a"},
	} {
		t.Run(m.name, func(t *testing.T) {
			ae := newAuthEnv(t, m.setup)
			op, a := who{cert: m.op}, who{cert: m.a}
			for _, tc := range []struct {
				name, method, path, body string
				w                        who
				headers                  []string
				status                   int
				reason                   string // the refusal counted, "" for none
				basic                    bool   // a 401 challenges Basic too
			}{
				{"nothing on /ui", "GET", "/ui", "", op, nil, 401, reasonNoToken, true},
				{"nothing on /ui/api/keys", "GET", "/ui/api/keys", "", op, nil, 401, reasonNoToken, true},
				{"nothing on /metrics", "GET", "/metrics", "", op, nil, 401, reasonNoToken, true},
				{"nothing on a node's route", "GET", statusOf, "", op, nil, 401, reasonNoToken, false},
				{"nothing, POST /lock", "POST", "/lock", lockA, op, nil, 401, reasonNoToken, false},
				{"nothing, POST /ui", "POST", "/ui", "", op, nil, 401, reasonNoToken, false},
				{"the operator on /ui", "GET", "/ui", "", op, []string{basicAuth("", tokOp)}, 200, "", false},
				{"the operator, a user name", "GET", "/ui", "", op, []string{basicAuth("alice", tokOp)}, 200, "", false},
				{"the operator, lower case", "GET", "/ui", "", op, []string{"authorization: basic " + basicAuth("", tokOp)[len("Authorization: Basic "):]}, 200, "", false},
				{"the operator on /ui/api/keys", "GET", "/ui/api/keys", "", op, []string{basicAuth("", tokOp)}, 200, "", false},
				{"the operator on /metrics", "GET", "/metrics", "", op, []string{basicAuth("", tokOp)}, 200, "", false},
				{"the operator, Bearer, on /ui", "GET", "/ui", "", op, []string{"Authorization: Bearer " + tokOp}, 200, "", false},
				{"node a on /ui", "GET", "/ui", "", a, []string{basicAuth("", tokA)}, 403, reasonOperatorOnly, false},
				{"node a on /metrics", "GET", "/metrics", "", a, []string{basicAuth("a", tokA)}, 403, reasonOperatorOnly, false},
				{"an unknown token", "GET", "/ui", "", op, []string{basicAuth("", tokOp+"x")}, 401, reasonUnknownToken, true},
				{"an empty password", "GET", "/ui", "", op, []string{basicAuth("dlock", "")}, 401, reasonBadHeader, true},
				{"the token as the user", "GET", "/ui", "", op, []string{basicAuth(tokOp, "")}, 401, reasonBadHeader, true},
				{"no colon", "GET", "/ui", "", op, []string{"Authorization: Basic " + base64.StdEncoding.EncodeToString([]byte(tokOp))}, 401, reasonBadHeader, true},
				{"not base64", "GET", "/ui", "", op, []string{"Authorization: Basic !" + tokOp}, 401, reasonBadHeader, true},
				{"unpadded base64", "GET", "/ui", "", op, []string{"Authorization: Basic " + base64.RawStdEncoding.EncodeToString([]byte("u:"+tokOp))}, 401, reasonBadHeader, true},
				{"two spaces", "GET", "/ui", "", op, []string{"Authorization: Basic  " + base64.StdEncoding.EncodeToString([]byte(":"+tokOp))}, 401, reasonBadHeader, true},
				{"Basic and a second header", "GET", "/ui", "", op, []string{basicAuth("", tokOp), "Authorization: Bearer " + tokOp}, 401, reasonBadHeader, true},
				{"the operator, POST /lock", "POST", "/lock", lockOp, op, []string{basicAuth("", tokOp)}, 401, reasonBadHeader, false},
				{"node a, POST /lock", "POST", "/lock", lockA, a, []string{basicAuth("", tokA)}, 401, reasonBadHeader, false},
				{"node a, POST /unlock", "POST", "/unlock", lockA, a, []string{basicAuth("a", tokA)}, 401, reasonBadHeader, false},
				{"node a, GET /status", "GET", statusOf + "&node_id=a", "", a, []string{basicAuth("", tokA)}, 401, reasonBadHeader, false},
				{"the operator, GET /status", "GET", statusOf, "", op, []string{basicAuth("", tokOp)}, 401, reasonBadHeader, false},
				{"the operator, POST /ui", "POST", "/ui", "", op, []string{basicAuth("", tokOp)}, 401, reasonBadHeader, false},
				{"the operator, an unknown path", "GET", "/favicon.ico", "", op, []string{basicAuth("", tokOp)}, 404, "", false},
				{"nothing, an unknown path", "GET", "/favicon.ico", "", op, nil, 401, reasonNoToken, true},
				{"the operator, POST to an unknown path", "POST", "/nope", "", op, []string{basicAuth("", tokOp)}, 401, reasonBadHeader, false},
			} {
				counted := cmpOrStr(tc.reason, reasonNoToken)
				before := testutil.ToFloat64(ae.srv.am.refusals.WithLabelValues(counted))
				got := ae.do(tc.w, tc.method, tc.path, tc.body, tc.headers...)
				switch tc.status {
				case 200:
					if got.status != 200 {
						t.Fatalf("%s: %d %s", tc.name, got.status, got.raw)
					}
					if want := map[string]string{"/ui": "<html", "/metrics": "dlock_auth_refusals_total", "/ui/api/keys": `"keys"`}[tc.path]; !strings.Contains(got.raw, want) {
						t.Fatalf("%s: the answer lacks %q: %.200s", tc.name, want, got.raw)
					}
				case 401:
					refusal(t, tc.name, got, 401, api.CodeUnauthorized)
					challenges(t, tc.name, got.header, tc.basic)
				case 403:
					refusal(t, tc.name, got, 403, api.CodeForbidden)
				default:
					if got.status != tc.status || got.header.Get("WWW-Authenticate") != "" {
						t.Fatalf("%s: %d %s, want %d", tc.name, got.status, got.raw, tc.status)
					}
				}
				after := testutil.ToFloat64(ae.srv.am.refusals.WithLabelValues(counted))
				if want := before + map[bool]float64{true: 1}[tc.reason != ""]; after != want {
					t.Fatalf("%s: dlock_auth_refusals_total{reason=%q} %v → %v, want %v", tc.name, counted, before, after, want)
				}
			}
			if st := ae.do(who{token: tokA, cert: m.a}, "GET", statusOf, ""); st.body["state"] != "free" {
				t.Fatalf("a refused lock was taken: %s", st.raw)
			}

			// The operator's live feed, opened with Basic; a node's stream
			// is not.
			s, status := ae.stream(op, "/ui/events", basicAuth("", tokOp))
			if s == nil {
				t.Fatalf("/ui/events with Basic: %d", status)
			}
			if f := s.Next(t); f.Event != "subscribed" {
				t.Fatalf("/ui/events with Basic: first frame %+v", f)
			}
			s.Close()
			if _, status := ae.stream(a, "/subscribe?node_id=a", basicAuth("", tokA)); status != 401 {
				t.Fatalf("/subscribe with Basic: %d, want 401", status)
			}

			if !m.setup.tls || m.setup.mtls {
				return
			}
			// HTTP/2: net/http's other ResponseWriter.
			resp := ae.h2Get(op, "/ui")
			if resp.StatusCode != 401 {
				t.Fatalf("/ui over HTTP/2 without credentials: %d", resp.StatusCode)
			}
			challenges(t, "/ui over HTTP/2", resp.Header, true)
			if resp := ae.h2Get(op, "/ui", basicAuth("", tokOp)); resp.StatusCode != 200 {
				t.Fatalf("/ui over HTTP/2 with Basic: %d", resp.StatusCode)
			}
			if resp := ae.h2Get(a, "/ui", basicAuth("", tokA)); resp.StatusCode != 403 {
				t.Fatalf("node a on /ui over HTTP/2 with Basic: %d", resp.StatusCode)
			}
			resp = ae.h2Get(a, statusOf, basicAuth("", tokA))
			if resp.StatusCode != 401 {
				t.Fatalf("node a on /status over HTTP/2 with Basic: %d", resp.StatusCode)
			}
			challenges(t, "/status over HTTP/2", resp.Header, false)
		})
	}
}

// TestAuthBasicRevokedStreamEnds: a /ui/events stream opened with Basic
// credentials ends when a reload removes its token, as one opened with a
// Bearer token does, on a connection taken over (HTTP/1.1) and through
// the ResponseWriter (HTTP/2); a stream of an operator token still in the
// file goes on, and the removed token is refused at once, also on a
// keep-alive connection that used it.
func TestAuthBasicRevokedStreamEnds(t *testing.T) {
	const tokOp2 = "second-operator-token-0123"
	for _, s := range []authSetup{{tokens: true}, {tokens: true, serial: true}, {tokens: true, tls: true}} {
		t.Run(fmt.Sprintf("serial=%v/tls=%v", s.serial, s.tls), func(t *testing.T) {
			ae := newAuthEnv(t, s)
			authtest.WriteFile(t, ae.tokensPath, []byte(tokenFile+tokOp2+" *\n"))
			if err := ae.srv.Reload(); err != nil {
				t.Fatal(err)
			}
			opened := func(s *kit.Stream) *kit.Stream {
				t.Helper()
				if f := s.Next(t); f.Event != "subscribed" {
					t.Fatalf("first frame %+v", f)
				}
				return s
			}
			sBasic, _ := ae.stream(who{}, "/ui/events", basicAuth("", tokOp))
			sBearer, _ := ae.stream(who{token: tokOp}, "/ui/events")
			sOther, _ := ae.stream(who{}, "/ui/events", basicAuth("ops", tokOp2))
			for _, s := range []*kit.Stream{sBasic, sBearer, sOther} {
				if s == nil {
					t.Fatal("an operator stream did not open")
				}
				opened(s)
			}
			var h2 *kit.Stream
			if s.tls {
				resp := ae.h2Get(who{}, "/ui/events", basicAuth("", tokOp))
				if resp.StatusCode != 200 {
					t.Fatalf("/ui/events over HTTP/2 with Basic: %d", resp.StatusCode)
				}
				h2 = opened(&kit.Stream{Resp: resp, R: bufio.NewReader(resp.Body)})
			}
			keep := ae.dial(who{})
			if r := keep.do("GET", "/ui/api/keys", "", basicAuth("", tokOp)); r.status != 200 {
				t.Fatalf("/ui/api/keys with Basic: %d %s", r.status, r.raw)
			}

			authtest.WriteFile(t, ae.tokensPath, []byte(tokA+" a\n"+tokOp2+" *\n"))
			if err := ae.srv.Reload(); err != nil {
				t.Fatal(err)
			}
			if !ended(sBasic) || !ended(sBearer) {
				t.Fatal("a stream of a removed token goes on")
			}
			if h2 != nil && !ended(h2) {
				t.Fatal("an HTTP/2 stream of a removed token goes on")
			}
			before := testutil.ToFloat64(ae.srv.am.refusals.WithLabelValues(reasonUnknownToken))
			r := ae.do(who{}, "GET", "/ui", "", basicAuth("", tokOp))
			refusal(t, "a removed token", r, 401, api.CodeUnauthorized)
			challenges(t, "a removed token", r.header, true)
			r = keep.do("GET", "/ui/api/keys", "", basicAuth("", tokOp))
			refusal(t, "a removed token on a keep-alive connection", r, 401, api.CodeUnauthorized)
			challenges(t, "a removed token on a keep-alive connection", r.header, true)
			if n := testutil.ToFloat64(ae.srv.am.refusals.WithLabelValues(reasonUnknownToken)); n != before+2 {
				t.Fatalf("unknown_token refusals %v → %v, want 2 more", before, n)
			}
			// The other operator's stream carries what happens next.
			ae.do(who{token: tokA}, "POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"a"}`)
			if f := sOther.Next(t); f.Event != "lock_assigned" || f.JSON(t)["node_id"] != "a" {
				t.Fatalf("the other operator's stream after the reload: %+v", f)
			}
			want := 2.0
			if h2 != nil {
				want = 3
			}
			if n := testutil.ToFloat64(ae.srv.am.revokedStreams); n != want {
				t.Fatalf("dlock_auth_revoked_streams_total %v, want %v", n, want)
			}
		})
	}
}

// TestAuthBasicBrowser: an operator opens /ui in a real headless chromium
// with a token file in force. The browser gets the 401, shows its prompt
// (answered here as a person would: the DevTools protocol's authRequired)
// once, and sends the credentials again by itself for the page's reads and
// its live feed (EventSource), which connects and carries locks taken
// afterwards; on the next visit it asks nothing and sends no request
// without them. (Before /favicon.ico took Basic credentials, its 401 made
// chromium forget them, and it asked again.)
func TestAuthBasicBrowser(t *testing.T) {
	ctx, closeBrowser := browser(t)
	ae := newAuthEnv(t, authSetup{tokens: true})

	type prompt struct{ scheme, realm, url string }
	var (
		mu      sync.Mutex
		prompts []prompt
	)
	events := make(chan any, 1024)
	// Every paused request goes on; a prompt gets the operator's token.
	handled := make(chan struct{})
	go func() {
		defer close(handled)
		for {
			var ev any
			select {
			case ev = <-events:
			case <-ctx.Done():
				return
			}
			var err error
			switch ev := ev.(type) {
			case *fetch.EventRequestPaused:
				_, err = chromedp.Call(ctx, fetch.ContinueRequest, fetch.ContinueRequestParams{RequestID: ev.RequestID})
			case *fetch.EventAuthRequired:
				mu.Lock()
				prompts = append(prompts, prompt{ev.AuthChallenge.Scheme, ev.AuthChallenge.Realm, ev.Request.URL})
				mu.Unlock()
				_, err = chromedp.Call(ctx, fetch.ContinueWithAuth, fetch.ContinueWithAuthParams{
					RequestID: ev.RequestID,
					AuthChallengeResponse: &fetch.AuthChallengeResponse{
						Response: fetch.AuthChallengeResponseResponseProvideCredentials,
						Username: "operator", Password: tokOp,
					},
				})
			}
			if err != nil && ctx.Err() == nil {
				t.Errorf("answering the browser: %v", err)
			}
		}
	}()
	// Before the server's cleanup, and before goleak looks.
	defer func() { closeBrowser(); <-handled }()
	if err := chromedp.Listen(ctx, func(ev any) {
		switch ev.(type) {
		case *fetch.EventRequestPaused, *fetch.EventAuthRequired:
			events <- ev
		}
	}); err != nil {
		t.Fatal(err)
	}
	handleAuth := true
	if _, err := chromedp.Call(ctx, fetch.Enable, fetch.EnableParams{HandleAuthRequests: &handleAuth}); err != nil {
		t.Fatal(err)
	}

	if a := ae.do(who{token: tokA}, "POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"a"}`); a.body["acquired"] != true {
		t.Fatalf("a's lock: %s", a.raw)
	}
	asked := func() []prompt {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(prompts)
	}
	noToken := func() float64 { return testutil.ToFloat64(ae.srv.am.refusals.WithLabelValues(reasonNoToken)) }
	rowR := fmt.Sprintf(rowJS, "pull:r")

	// The first visit: the browser asks, once.
	url := "http://" + ae.addr + "/ui"
	if err := chromedp.Do(ctx, chromedp.Navigate(url)); err != nil {
		t.Fatal(err)
	}
	pollUI[bool](t, ctx, "the live feed to connect", `document.getElementById("conn").textContent === "Live"`)
	if row := pollUI[uiRow](t, ctx, "a holding pull:r", rowR); row.Holder != "a" {
		t.Fatalf("row %+v, want a holding", row)
	}
	loadID := uiEval[string](t, ctx, `window.dlockLoadId`)
	if a := ae.do(who{token: tokB}, "POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"b"}`); a.body["queued"] != true {
		t.Fatalf("b's lock: %s", a.raw)
	}
	pollUI[bool](t, ctx, "b waiting, from the live feed", fmt.Sprintf(`(() => { const r = %s; return r && r.queue.join() === "b"; })()`, rowR))
	if got := asked(); len(got) != 1 || got[0].scheme != "basic" || got[0].realm != "dlock" || !strings.HasSuffix(got[0].url, "/ui") {
		t.Fatalf("the browser asked for credentials %d times: %+v; want once, Basic of realm dlock, for /ui", len(got), got)
	}

	// The next visit: the browser sends the credentials by itself, with the
	// page and with its reads and live feed, and asks nothing.
	before := noToken()
	if err := chromedp.Do(ctx, chromedp.Navigate(url)); err != nil {
		t.Fatal(err)
	}
	pollUI[bool](t, ctx, "the page loaded again, live", fmt.Sprintf(`window.dlockLoadId !== %q && document.getElementById("conn").textContent === "Live"`, loadID))
	if a := ae.do(who{token: tokC}, "POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"c"}`); a.body["queued"] != true {
		t.Fatalf("c's lock: %s", a.raw)
	}
	pollUI[bool](t, ctx, "c waiting, from the live feed", fmt.Sprintf(`(() => { const r = %s; return r && r.queue.join() === "b,c"; })()`, rowR))
	if got := asked(); len(got) != 1 {
		t.Fatalf("the browser asked again: %+v", got[1:])
	}
	if n := noToken(); n != before {
		t.Fatalf("%v requests of the second visit came without credentials", n-before)
	}
	// Nothing refused what the browser sent by itself, its /favicon.ico
	// included: a 401 to them would make it forget the credentials.
	if n := testutil.ToFloat64(ae.srv.am.refusals.WithLabelValues(reasonBadHeader)); n != 0 {
		t.Fatalf("bad_header refusals %v", n)
	}
	if n := testutil.ToFloat64(ae.srv.am.refusals.WithLabelValues(reasonOperatorOnly)); n != 0 {
		t.Fatalf("operator_only refusals %v", n)
	}
}
