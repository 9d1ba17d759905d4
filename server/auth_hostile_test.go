package server

// Attacks on the identity checks (docs/SECURITY.md), each with what stops
// it.

import (
	"bufio"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/auth/authtest"
	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/rawhttp"
	"github.com/dlock/dlock/lock/memory"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// aliveOrEnded reads s until it ends (false) or carries an event about
// resource res (true): whether the stream still serves its node.
func aliveOrEnded(t *testing.T, s *kit.Stream, res string) bool {
	t.Helper()
	var ev rawhttp.Event
	for {
		if err := rawhttp.ReadEvent(s.R, &ev); err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatalf("the stream neither ended nor carried %s: %v", res, err)
			}
			return false
		}
		if strings.Contains(string(ev.Data), `"resource_id":"`+res+`"`) {
			return true
		}
	}
}

// TestAuthCrossSiteBrowserRefused: an operator's certificate ("*")
// imported into a browser for /ui is presented on every request the
// browser sends, also those another site makes it send: a form POST with
// enctype text/plain (no CORS preflight) whose body is JSON, or an <img>
// GET of /status?node_id=. They are refused (403, crossSite) on both loops,
// so a page cannot release b's lock with success:true, drop references or
// keep a dead node's leases.
func TestAuthCrossSiteBrowserRefused(t *testing.T) {
	// What a browser sends for <form method=post enctype=text/plain
	// action=https://dlock:7380/unlock><input name='{..."x":"' value='"}'>.
	formBody := `{"type":"pull","resource_id":"r","node_id":"b","success":true,"x":"="}`
	browser := []string{
		"Content-Type: text/plain",
		"Origin: https://evil.example",
		"Sec-Fetch-Site: cross-site",
		"Sec-Fetch-Mode: navigate",
		"Referer: https://evil.example/",
	}
	img := []string{"Sec-Fetch-Site: cross-site", "Sec-Fetch-Mode: no-cors", "Sec-Fetch-Dest: image", "Referer: https://evil.example/"}
	for _, h2 := range []bool{false, true} {
		t.Run(fmt.Sprint("h2=", h2), func(t *testing.T) {
			ae := newAuthEnv(t, authSetup{mtls: true})
			b, c, op := who{cert: "b"}, who{cert: "c"}, who{cert: "*"}
			if a := ae.do(b, "POST", "/lock", lockB); a.body["acquired"] != true {
				t.Fatalf("b's lock: %s", a.raw)
			}
			if a := ae.do(c, "POST", "/lock", lockC); a.body["queued"] != true {
				t.Fatalf("c's lock: %s", a.raw)
			}
			send := func(method, path, body string, headers []string) answer {
				if h2 {
					return ae.h2Do(op, method, path, body, headers...)
				}
				return ae.do(op, method, path, body, headers...)
			}
			if a := send("POST", "/unlock", formBody, browser); a.status == 200 {
				t.Errorf("a cross-site form POST, sent by a browser holding the operator's certificate, released b's lock with success:true: %d %s", a.status, a.raw)
			}
			if a := send("GET", statusOf+"&node_id=b", "", img); a.status == 200 {
				t.Errorf("a cross-site <img> GET renewed b's leases with the operator's certificate: %d %s", a.status, a.raw)
			}
			if n := testutil.ToFloat64(ae.srv.metrics.crossSite); n != 2 {
				t.Errorf("dlock_cross_site_refusals_total %v, want 2", n)
			}
			// The operator's page itself, same-origin, is served.
			if a := send("GET", "/ui/api/keys", "", []string{"Sec-Fetch-Site: same-origin", "Origin: https://" + ae.addr}); a.status != 200 {
				t.Errorf("the page's own read: %d %s", a.status, a.raw)
			}
		})
	}
	// Without identities too: a browser on a node reaches a server on
	// 127.0.0.1, and any page could make it unlock.
	e := newEnv(t, nil)
	post := func(body string, headers []string) int {
		t.Helper()
		req, _ := http.NewRequest("POST", e.ts.URL+"/unlock", strings.NewReader(body))
		for _, h := range headers {
			k, v, _ := strings.Cut(h, ": ")
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if st := post(formBody, browser); st != http.StatusForbidden {
		t.Fatalf("a cross-site form POST to a server without identities: %d, want 403", st)
	}
	if n := e.metric("dlock_cross_site_refusals_total"); n != 1 {
		t.Fatalf("dlock_cross_site_refusals_total %v, want 1", n)
	}
	// A client that is not a browser is answered as before.
	if st := post(formBody, nil); st != http.StatusForbidden && st != http.StatusConflict && st != http.StatusOK {
		t.Fatalf("an unlock without browser headers: %d", st)
	}
	if n := e.metric("dlock_cross_site_refusals_total"); n != 1 {
		t.Fatalf("dlock_cross_site_refusals_total %v after a plain request, want 1", n)
	}
}

// TestAuthRevokedWhileBodyHeldBack: net/http identifies a request when its
// headers arrive, before its body. A client that stages requests (headers
// sent, body withheld; "Expect: 100-continue" tells it the check passed)
// and sends the bodies after a SIGHUP removed its token, or gave it to
// another node, is refused: mayActAs checks the grant again.
func TestAuthRevokedWhileBodyHeldBack(t *testing.T) {
	lockA := `{"type":"pull","resource_id":"staged","node_id":"a"}`
	for _, tc := range []struct {
		name, file string // the token file after the reload
		now        int    // the answer to a new request with the token
	}{
		{"token removed", tokB + " b\n", 401},
		{"token given to node c", tokA + " c\n" + tokB + " b\n", 403},
	} {
		for _, serial := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/net-http-only=%v", tc.name, serial), func(t *testing.T) {
				ae := newAuthEnv(t, authSetup{tokens: true, serial: serial})
				c := ae.dial(who{token: tokA})
				// The headers only: the lean loop passes Expect to net/http.
				head := "POST /lock HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + tokA +
					"\r\nExpect: 100-continue\r\nContent-Length: " + strconv.Itoa(len(lockA)) + "\r\n\r\n"
				if _, err := io.WriteString(c.c, head); err != nil {
					t.Fatal(err)
				}
				// 100 Continue comes once the handler reads the body: after
				// the request was identified.
				resp, err := http.ReadResponse(c.br, nil)
				if err != nil || resp.StatusCode != http.StatusContinue {
					t.Fatalf("want 100 Continue: %v %v", resp, err)
				}
				authtest.WriteFile(t, ae.tokensPath, []byte(tc.file))
				if err := ae.srv.Reload(); err != nil {
					t.Fatal(err)
				}
				// The token is refused from now on...
				if r := ae.do(who{token: tokA}, "POST", "/lock", lockA); r.status != tc.now {
					t.Fatalf("the token on a new request after the reload: %d %s, want %d", r.status, r.raw, tc.now)
				}
				// ...but the staged request is served as node a.
				if _, err := io.WriteString(c.c, lockA); err != nil {
					t.Fatal(err)
				}
				resp, err = http.ReadResponse(c.br, nil)
				if err != nil {
					t.Fatal(err)
				}
				body, _ := io.ReadAll(resp.Body)
				if resp.StatusCode == 200 {
					t.Errorf("a request identified before the reload and completed after it was served with the revoked token: %d %s", resp.StatusCode, body)
				}
			})
		}
	}
}

// TestAuthDroppedCAEndsStreams: a node's certificate is revoked by
// rotating the client CA (docs/SECURITY.md: there is no CRL). The session
// stream it opened before ends at the reload, on HTTP/1.1 and HTTP/2, as
// a removed token's does: otherwise it would keep the node's session, and
// its session-leased locks, alive and go on receiving its events.
func TestAuthDroppedCAEndsStreams(t *testing.T) {
	for _, h2 := range []bool{false, true} {
		t.Run(fmt.Sprint("h2=", h2), func(t *testing.T) {
			ae := newAuthEnv(t, authSetup{mtls: true})
			a := who{cert: "a"}
			var s *kit.Stream
			if h2 {
				s = ae.h2Stream(a, "/subscribe?node_id=a")
			} else {
				s, _ = ae.stream(a, "/subscribe?node_id=a")
			}
			s.Next(t)
			// a holds a key on its session.
			if r := ae.do(a, "POST", "/lock", `{"type":"pull","resource_id":"held","node_id":"a","lease":"session"}`); r.body["acquired"] != true {
				t.Fatalf("a's lock: %s", r.raw)
			}
			s.Next(t)

			// The operator revokes a: the client CA is rotated to a new one
			// that signs everyone but a.
			ca2 := authtest.NewCA(t, "second CA")
			authtest.WriteFile(t, ae.caFile, ca2.PEM)
			if err := ae.srv.Reload(); err != nil {
				t.Fatal(err)
			}
			ae.certs["op2"] = ca2.Node(t, "*", "*").TLS(t)
			ae.certs["b2"] = ca2.Node(t, "b", "b").TLS(t)
			if r := ae.do(who{cert: "b2"}, "POST", "/lock", `{"type":"pull","resource_id":"held","node_id":"b"}`); r.body["queued"] != true {
				t.Fatalf("b's lock: %s", r.raw)
			}
			// An operator grants something to a: does a's old stream still
			// carry it?
			if r := ae.do(who{cert: "op2"}, "POST", "/lock", `{"type":"pull","resource_id":"probe","node_id":"a"}`); r.status != 200 {
				t.Fatalf("probe: %s", r.raw)
			}
			if aliveOrEnded(t, s, "probe") {
				t.Errorf("the stream of a certificate whose CA was dropped goes on: it keeps a's session, and the key a holds, alive; b waits for as long as a keeps the connection")
			}
		})
	}
}

// TestAuthObserversPerCredential: key observers, which any node's
// credential may open (docs/SECURITY.md), share --max-watchers with the
// operator's /ui/events. One node holds at most MaxObserversPerCredential
// of them, so it cannot take them all and blind the operator.
func TestAuthObserversPerCredential(t *testing.T) {
	ae := newAuthEnvWith(t, authSetup{tokens: true}, func(c *memory.Config) { c.MaxWatchers = 2 * MaxObserversPerCredential }, nil)
	a := who{token: tokA}
	// The first observer's connection is the test's, to close it.
	firstConn := ae.dial(a)
	_ = firstConn.c.SetDeadline(time.Time{})
	if resp := firstConn.send("GET", "/subscribe?type=pull&resource_id=r0", ""); resp.StatusCode != 200 {
		t.Fatalf("observer 0: %d", resp.StatusCode)
	}
	for i := 1; i < MaxObserversPerCredential; i++ {
		s, status := ae.stream(a, "/subscribe?type=pull&resource_id=r"+strconv.Itoa(i))
		if s == nil {
			t.Fatalf("observer %d: %d", i, status)
		}
		s.Next(t)
	}
	if _, status := ae.stream(a, "/subscribe?type=pull&resource_id=one-more"); status != http.StatusTooManyRequests {
		t.Fatalf("observer %d of one node: %d, want 429", MaxObserversPerCredential+1, status)
	}
	if s, status := ae.stream(who{token: tokOp}, "/ui/events"); status != 200 {
		t.Fatalf("the operator's /ui/events: %d after one node opened all it may", status)
	} else {
		s.Close()
	}
	if s, status := ae.stream(who{token: tokB}, "/subscribe?type=pull&resource_id=r0"); status != 200 {
		t.Fatalf("another node's observer: %d", status)
	} else {
		s.Close()
	}
	firstConn.c.Close()
	kit.WaitFor(t, "a's closed observer to free its place", func() bool {
		s, status := ae.stream(a, "/subscribe?type=pull&resource_id=again")
		if s != nil {
			s.Close()
		}
		return status == 200
	})
}

// TestAuthExpiredCertificateRefused: a connection made before its client
// certificate expired is refused once it has (401), and a stream opened
// with it ends then: short-lived certificates are how many deployments
// revoke.
func TestAuthExpiredCertificateRefused(t *testing.T) {
	ae := newAuthEnv(t, authSetup{mtls: true})
	ca := authtest.NewCA(t, "short-lived CA")
	authtest.WriteFile(t, ae.caFile, append(append([]byte{}, ae.ca.PEM...), ca.PEM...))
	if err := ae.srv.Reload(); err != nil {
		t.Fatal(err)
	}
	notAfter := time.Now().Add(3 * time.Second).Truncate(time.Second)
	ae.certs["short"] = ca.NodeUntil(t, notAfter, "a").TLS(t)
	short := who{cert: "short"}
	keep := ae.dial(short)
	lockA := `{"type":"pull","resource_id":"exp","node_id":"a"}`
	if r := keep.do("POST", "/lock", lockA); r.status != 200 {
		t.Fatalf("before the expiry: %d %s", r.status, r.raw)
	}
	s, status := ae.stream(short, "/subscribe?node_id=a")
	if s == nil {
		t.Fatalf("stream before the expiry: %d", status)
	}
	s.Next(t)
	// The stream ends at the expiry, without a request or a reload.
	if !ended(s) {
		t.Fatal("a stream of an expired certificate goes on")
	}
	if now := time.Now(); !now.After(notAfter) {
		t.Fatalf("the stream ended at %v, before the certificate expired at %v", now, notAfter)
	}
	_ = keep.c.SetDeadline(time.Now().Add(10 * time.Second))
	if r := keep.do("POST", "/unlock", lockA); r.status != 401 {
		t.Errorf("a certificate that expired at %v, on the connection made before: %d %s, want 401", notAfter, r.status, r.raw)
	}
}

// TestAuthHoldsTLSResumptionAfterCADrop: a client that made a TLS
// session with a certificate of a CA since dropped cannot come back by
// resuming it (a session ticket carries the client certificate, and the
// ticket keys outlive a reload): the resumption is refused, and a request
// would be 401 in any case.
func TestAuthHoldsTLSResumptionAfterCADrop(t *testing.T) {
	ae := newAuthEnv(t, authSetup{mtls: true})
	cfg := ae.clientTLS(who{cert: "a"}, false)
	cfg.ClientSessionCache = tls.NewLRUClientSessionCache(8)
	dial := func() (*tls.Conn, error) {
		c, err := net.Dial("tcp", ae.addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		tc := tls.Client(c, cfg)
		return tc, tc.Handshake()
	}
	get := func(tc *tls.Conn) (int, error) {
		if _, err := io.WriteString(tc, "GET "+statusOf+" HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
			return 0, err
		}
		resp, err := http.ReadResponse(bufio.NewReader(tc), nil)
		if err != nil {
			return 0, err
		}
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	tc, err := dial()
	if err != nil {
		t.Fatal(err)
	}
	// TLS 1.3 sends the ticket after the handshake: a read takes it.
	if st, err := get(tc); err != nil || st != 200 {
		t.Fatalf("first connection: %d %v", st, err)
	}
	tc.Close()
	tc, err = dial()
	if err != nil || !tc.ConnectionState().DidResume {
		t.Fatalf("the session is not resumed while nothing changed: %v", err)
	}
	if st, err := get(tc); err != nil || st != 200 {
		t.Fatalf("resumed connection: %d %v", st, err)
	}
	tc.Close()

	authtest.WriteFile(t, ae.caFile, authtest.NewCA(t, "second CA").PEM)
	if err := ae.srv.Reload(); err != nil {
		t.Fatal(err)
	}
	tc, err = dial()
	if err == nil {
		resumed := tc.ConnectionState().DidResume
		if st, err := get(tc); err == nil && st == 200 {
			t.Fatalf("a session of a dropped CA's certificate was served again (resumed %v)", resumed)
		}
		if resumed {
			t.Errorf("a session of a dropped CA's certificate was resumed")
		}
	}
}

// TestAuthHoldsHandshakeSlowloris: a TLS handshake that never
// completes — nothing sent, half a ClientHello, a record header announcing
// more than TLS allows, plain HTTP — holds no one else up (the handshake
// runs in the connection's goroutine, not the accept loop) and ends within
// the read timeout, counted, its connection closed and uncounted.
func TestAuthHoldsHandshakeSlowloris(t *testing.T) {
	ae := newAuthEnvWith(t, authSetup{tokens: true, tls: true}, nil, func(o *Options) { o.ReadTimeout = 300 * time.Millisecond })
	base := ae.srv.conns.Load()
	hello := []byte{0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03} // 512 bytes announced, 6 sent
	huge := []byte{0x16, 0x03, 0x01, 0xff, 0xff}                                      // a 64 KiB record
	var slow []net.Conn
	for _, first := range [][]byte{nil, hello, huge, []byte("GET / HTTP/1.1\r\nAuthorization: Bearer " + tokA + "\r\n")} {
		c, err := net.Dial("tcp", ae.addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		if _, err := c.Write(first); err != nil {
			t.Fatal(err)
		}
		slow = append(slow, c)
	}
	// Meanwhile another client is served.
	if r := ae.do(who{token: tokA}, "POST", "/lock", `{"type":"pull","resource_id":"r","node_id":"a"}`); r.status != 200 {
		t.Fatalf("a client beside the stalled handshakes: %d %s", r.status, r.raw)
	}
	kit.WaitFor(t, "every stalled handshake to end", func() bool {
		return testutil.ToFloat64(ae.srv.am.handshakeErrors) == float64(len(slow)) && ae.srv.conns.Load() == base
	})
	for i, c := range slow {
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.Copy(io.Discard, c); err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatalf("stalled handshake %d: the server did not close the connection", i)
			}
		}
	}
}

// TestAuthHoldsTokenGivenToAnotherNode: a reload that gives a's token
// to node c ends the streams it opened as a, on the lean loop's hijacked
// connection and over HTTP/2, and every open connection — a lean
// keep-alive one and an HTTP/2 one — acts with it as c, never as a again.
func TestAuthHoldsTokenGivenToAnotherNode(t *testing.T) {
	ae := newAuthEnv(t, authSetup{tokens: true, tls: true})
	a := who{token: tokA}
	s1, _ := ae.stream(a, "/subscribe?node_id=a")
	s1.Next(t)
	s2 := ae.h2Stream(a, "/subscribe?node_id=a")
	s2.Next(t)
	keep := ae.dial(a)
	lockAs := func(node string) string {
		return `{"type":"pull","resource_id":"given","node_id":"` + node + `"}`
	}
	if r := keep.do("POST", "/lock", lockAs("a")); r.body["acquired"] != true {
		t.Fatalf("a's lock: %s", r.raw)
	}
	s1.Next(t)
	s2.Next(t)
	tr := &http.Transport{TLSClientConfig: ae.clientTLS(a, true), ForceAttemptHTTP2: true}
	t.Cleanup(tr.CloseIdleConnections)
	h2 := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	h2post := func(body string) int {
		t.Helper()
		req, _ := http.NewRequest("POST", "https://"+ae.addr+"/cancel", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+tokA)
		resp, err := h2.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.ProtoMajor != 2 {
			t.Fatalf("over %s", resp.Proto)
		}
		return resp.StatusCode
	}
	if st := h2post(lockAs("c")); st != 403 {
		t.Fatalf("a's token as c before the reload: %d", st)
	}

	authtest.WriteFile(t, ae.tokensPath, []byte(tokA+" c\n"+tokB+" b\n"+tokOp+" *\n"))
	if err := ae.srv.Reload(); err != nil {
		t.Fatal(err)
	}
	if !ended(s1) || !ended(s2) {
		t.Fatal("a stream opened as a goes on after its token was given to c")
	}
	if r := keep.do("POST", "/unlock", lockAs("a")); r.status != 403 || r.code() != "forbidden" {
		t.Fatalf("the lean keep-alive connection as a: %d %s", r.status, r.raw)
	}
	if st := h2post(lockAs("a")); st != 403 {
		t.Fatalf("the HTTP/2 connection as a: %d", st)
	}
	if st := h2post(lockAs("c")); st != 200 {
		t.Fatalf("the HTTP/2 connection as c: %d", st)
	}
	if r := keep.do("POST", "/lock", lockAs("c")); r.status != 200 {
		t.Fatalf("the lean keep-alive connection as c: %d %s", r.status, r.raw)
	}
	if st := ae.do(who{token: tokOp}, "GET", statusOf[:len(statusOf)-1]+"given", ""); st.body["holder"] != "a" {
		t.Fatalf("a's lock after the reload: %s", st.raw)
	}
}

// TestAuthHoldsHeaderTricks: an Authorization header hidden where a
// proxy or a lax parser might find it — in the trailers of a chunked
// body, folded into another header (obs-fold), split by a fold, two
// fields over HTTP/2 (one good, one not), a good Bearer with a Basic
// beside it — is refused, on both loops and over HTTP/2.
func TestAuthHoldsHeaderTricks(t *testing.T) {
	lockA := `{"type":"pull","resource_id":"r","node_id":"a"}`
	chunked := func(trailer string) string {
		return "POST /lock HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTrailer: Authorization\r\n\r\n" +
			strconv.FormatInt(int64(len(lockA)), 16) + "\r\n" + lockA + "\r\n0\r\n" + trailer + "\r\n\r\n"
	}
	for _, serial := range []bool{false, true} {
		t.Run(fmt.Sprint("net-http-only=", serial), func(t *testing.T) {
			ae := newAuthEnv(t, authSetup{tokens: true, serial: serial})
			for _, tc := range []struct{ name, raw string }{
				{"token in the trailers", chunked("Authorization: Bearer " + tokA)},
				{"folded into another header", rawPost("/lock", lockA, "X-Note: x\r\n Authorization: Bearer "+tokA)},
				{"a fold adding a second token", rawPost("/lock", lockA, "Authorization: Bearer "+tokA+"\r\n "+tokB)},
				{"Bearer and Basic", rawPost("/lock", lockA, "Authorization: Bearer "+tokA, basicAuth("", tokOp))},
				{"Basic then Bearer", rawPost("/lock", lockA, basicAuth("", tokOp), "Authorization: Bearer "+tokA)},
				{"Basic with the operator's token on a node route", rawPost("/lock", lockA, basicAuth("", tokOp))},
			} {
				resp := rawExchangeOrClosed(t, ae.addr, tc.raw)
				if resp != nil && resp.StatusCode != 401 {
					t.Errorf("%s: %d", tc.name, resp.StatusCode)
				}
			}
			if st := ae.do(who{}, "GET", statusOf, ""); st.status != 401 {
				t.Fatalf("no credential: %d", st.status)
			}
		})
	}
	t.Run("h2", func(t *testing.T) {
		ae := newAuthEnv(t, authSetup{tokens: true, tls: true})
		tr := &http.Transport{TLSClientConfig: ae.clientTLS(who{}, true), ForceAttemptHTTP2: true}
		defer tr.CloseIdleConnections()
		for _, vals := range [][]string{
			{"Bearer " + tokA, "Bearer " + tokB},
			{"Bearer " + tokA, "Bearer " + tokA},
			{"Bearer " + tokB, "Bearer nonsense-token-0123456789"},
		} {
			req, _ := http.NewRequest("POST", "https://"+ae.addr+"/lock", strings.NewReader(lockA))
			req.Header["Authorization"] = vals
			resp, err := (&http.Client{Transport: tr}).Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.ProtoMajor != 2 || resp.StatusCode != 401 {
				t.Errorf("two authorization fields %q over %s: %d", vals, resp.Proto, resp.StatusCode)
			}
		}
	})
}

// TestAuthHoldsNoTokenInLogs: with the log at debug, nothing a client
// sends in a refused credential — unknown, malformed, Basic, on both
// loops, HTTP/2 and a failed handshake — and nothing a broken token file
// holds reaches the log, an answer or a reload's error.
func TestAuthHoldsNoTokenInLogs(t *testing.T) {
	const secret = "SECRETsecretSECRETsecret0123"
	var logs kit.Buffer
	ae := newAuthEnvWith(t, authSetup{tokens: true, tls: true}, nil, func(o *Options) {
		o.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	})
	lockA := `{"type":"pull","resource_id":"r","node_id":"a"}`
	answers := []answer{
		ae.do(who{token: secret}, "POST", "/lock", lockA),
		ae.do(who{}, "POST", "/lock", lockA, "Authorization: Bearer "+secret+" "+secret),
		ae.do(who{}, "POST", "/lock", lockA, "Authorization: "+secret),
		ae.do(who{}, "POST", "/lock", lockA, basicAuth(secret, secret)),
		ae.do(who{}, "GET", "/ui", "", basicAuth(secret, secret)),
		ae.do(who{}, "GET", "/ui", "", "Authorization: Basic "+secret+"!"),
		ae.do(who{token: secret}, "GET", statusOf+"&node_id="+secret, ""),
		ae.do(who{token: tokA}, "GET", statusOf+"&node_id=b", "Authorization: Bearer "+secret),
		ae.h2Do(who{token: secret}, "POST", "/unlock", lockA),
		ae.h2Do(who{}, "GET", "/metrics", "", "Authorization: Bearer "+secret),
	}
	for i, a := range answers {
		if a.status < 400 || strings.Contains(a.raw, secret) {
			t.Errorf("answer %d: %d %s", i, a.status, a.raw)
		}
	}
	// Plain HTTP with the secret to the TLS port: a failed handshake,
	// logged at debug.
	rawExchangeOrClosed(t, ae.addr, rawPost("/lock", lockA, "Authorization: Bearer "+secret))
	kit.WaitFor(t, "the failed handshake", func() bool { return testutil.ToFloat64(ae.srv.am.handshakeErrors) >= 1 })
	for _, file := range []string{
		secret + " a\n" + secret + " b\n", // the same token twice
		secret + " a\x01\n",               // a control character in the node
		secret + "\n",                     // one field
		secret + "! a\n",                  // not a bearer token
		"a " + secret + "\n",              // swapped: a short "token"
		secret + " " + strings.Repeat(secret, 200) + "\n",  // a line too long
		secret + " " + strings.Repeat("n", 300) + "\n",     // a node id too long
		"Bearer " + secret + " a\n",                        // pasted from a header
		tokA + " a\n" + secret[:10] + "\n" + tokB + " b\n", // half a line
	} {
		authtest.WriteFile(t, ae.tokensPath, []byte(file))
		err := ae.srv.Reload()
		if err == nil {
			t.Errorf("token file %q reloaded", file)
			continue
		}
		if strings.Contains(err.Error(), secret[:10]) {
			t.Errorf("a reload error shows a token: %v", err)
		}
	}
	if strings.Contains(logs.String(), secret[:10]) {
		t.Fatalf("a token reached the log:\n%s", logs.String())
	}
	if !strings.Contains(logs.String(), "TLS handshake failed") {
		t.Fatalf("the log at debug does not have the failed handshake:\n%s", logs.String())
	}
}

// TestAuthHoldsReloadStorm: reloads back to back (a SIGHUP storm),
// each dropping or restoring a's token and re-reading the TLS files,
// while a's clients hammer every path — the lean loop's POSTs, net/http's
// GETs, HTTP/2 — and a's stream is open: every answer is 200 or 401,
// never anything else (no 403 from a half-swapped table, no 5xx, no
// broken connection); the stream ends; once the token is back, all work.
func TestAuthHoldsReloadStorm(t *testing.T) {
	ae := newAuthEnv(t, authSetup{tokens: true, mtls: true})
	a := who{tokA, "a"}
	s, _ := ae.stream(a, "/subscribe?node_id=a")
	s.Next(t)
	with := []byte(tokenFile)
	without := []byte(tokB + " b\n" + tokOp + " *\n")
	lean := ae.dial(a)
	nethttp := ae.dial(a)
	tr := &http.Transport{TLSClientConfig: ae.clientTLS(a, true), ForceAttemptHTTP2: true}
	t.Cleanup(tr.CloseIdleConnections)
	h2 := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	lockA := `{"type":"pull","resource_id":"storm","node_id":"a"}`
	var (
		wg    sync.WaitGroup
		stop  = make(chan struct{})
		errMu sync.Mutex
		errs  []string
		seen  [2]int // answers 200 and 401
	)
	record := func(what string, status int, err error) bool {
		errMu.Lock()
		defer errMu.Unlock()
		switch {
		case err != nil:
			errs = append(errs, fmt.Sprintf("%s: %v", what, err))
			return false
		case status == 200:
			seen[0]++
		case status == 401:
			seen[1]++
		default:
			errs = append(errs, fmt.Sprintf("%s: %d", what, status))
		}
		return true
	}
	exchange := func(c *conn, raw string) (int, error) {
		if _, err := io.WriteString(c.c, raw); err != nil {
			return 0, err
		}
		resp, err := http.ReadResponse(c.br, nil)
		if err != nil {
			return 0, err
		}
		_, err = io.Copy(io.Discard, resp.Body)
		return resp.StatusCode, err
	}
	loop := func(what string, do func() (int, error)) {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				if st, err := do(); !record(what, st, err) {
					return
				}
			}
		})
	}
	_ = lean.c.SetDeadline(time.Time{})
	_ = nethttp.c.SetDeadline(time.Time{})
	loop("lean", func() (int, error) {
		return exchange(lean, rawPost("/lock", lockA, "Authorization: Bearer "+tokA))
	})
	loop("net/http", func() (int, error) {
		return exchange(nethttp, "GET "+statusOf+"&node_id=a HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "+tokA+"\r\n\r\n")
	})
	loop("h2", func() (int, error) {
		req, _ := http.NewRequest("POST", "https://"+ae.addr+"/lock", strings.NewReader(lockA))
		req.Header.Set("Authorization", "Bearer "+tokA)
		resp, err := h2.Do(req)
		if err != nil {
			return 0, err
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode, nil
	})
	for i := range 200 {
		f := with
		if i%2 == 0 {
			f = without
		}
		authtest.WriteFile(t, ae.tokensPath, f)
		authtest.WriteFile(t, ae.caFile, ae.ca.PEM) // the same CA, read again
		if err := ae.srv.Reload(); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	wg.Wait()
	for _, e := range errs {
		t.Error(e)
	}
	if !ended(s) {
		t.Error("a's stream survived its token's removal")
	}
	for what, c := range map[string]*conn{"lean": lean, "net/http": nethttp} {
		if st, err := exchange(c, rawPost("/lock", lockA, "Authorization: Bearer "+tokA)); err != nil || st != 200 {
			t.Errorf("%s after the storm: %d %v", what, st, err)
		}
	}
	t.Logf("answers: %d × 200, %d × 401", seen[0], seen[1])
}
