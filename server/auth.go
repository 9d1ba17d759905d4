package server

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/internal/auth"
	"github.com/dlock/dlock/lock"
	"github.com/prometheus/client_golang/prometheus"
)

// Identities (docs/SECURITY.md). With a token file or a client CA, every
// request but GET /healthz is identified once, in serveRequest, before it
// is routed: 401 without a valid credential. Every place a request names a
// node then asks mayActAs before the backend sees the node: 403 when the
// credential is another node's. Without either, none of this runs and the
// server answers as it always did.

// access is who may use a route when identities are checked.
type access uint8

const (
	accessNode     access = iota // any credential; a named node must be its own
	accessOpen                   // anyone: GET /healthz and /readyz, for probes
	accessOperator               // an operator credential ("*"): /metrics, /ui
)

// setAccess marks the routes that are not node routes.
func (s *Server) setAccess() {
	for p, rt := range s.routes {
		switch {
		case p == "/healthz", p == "/readyz":
			rt.access = accessOpen
		case p == "/metrics" || p == "/ui" || strings.HasPrefix(p, "/ui/"):
			rt.access = accessOperator
		}
	}
}

// caller is who a request comes from: what its token and its client
// certificate allow. A nil part is a check that is off.
type caller struct {
	grant *auth.Grant
	cert  *auth.CertIdentity
	// peer is the connection's client certificate, checked again by
	// mayActAs and by streams: a reload may have dropped its CA.
	peer *auth.Peer
}

func (c *caller) operator() bool {
	return (c.grant == nil || c.grant.Operator()) && (c.cert == nil || c.cert.Operator())
}

// mayActAs: with both a token and a certificate, both must allow it.
func (c *caller) mayActAs(node string) bool {
	return (c.grant == nil || c.grant.Operator() || c.grant.Node == node) && (c.cert == nil || c.cert.MayActAs(node))
}

type callerKey struct{}

func callerOf(ctx context.Context) *caller {
	c, _ := ctx.Value(callerKey{}).(*caller)
	return c
}

// Refusal reasons, the label of dlock_auth_refusals_total.
const (
	reasonNoToken        = "no_token"
	reasonBadHeader      = "bad_header"
	reasonUnknownToken   = "unknown_token"
	reasonNoCertificate  = "no_certificate"
	reasonUntrusted      = "untrusted_certificate"
	reasonOtherNode      = "other_node"
	reasonOperatorOnly   = "operator_only"
	reasonObservers      = "observers_per_credential"
	wwwAuthenticateValue = `Bearer realm="dlock"`
	// basicChallengeValue is the challenge a 401 carries, besides
	// wwwAuthenticateValue, where Basic credentials are accepted: it
	// makes a browser ask for them (docs/SECURITY.md).
	basicChallengeValue = `Basic realm="dlock", charset="UTF-8"`
)

type authMetrics struct {
	refusals        *prometheus.CounterVec
	handshakeErrors prometheus.Counter
	reloads         *prometheus.CounterVec
	revokedStreams  prometheus.Counter
}

// newAuthMetrics registers the identity metrics; only a server that
// checks identities or serves TLS has them.
func newAuthMetrics(reg *prometheus.Registry) *authMetrics {
	am := &authMetrics{
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dlock_auth_refusals_total",
			Help: "Requests answered 401 or 403 by the identity checks, by reason: no_token, bad_header, unknown_token, no_certificate, untrusted_certificate (401); other_node, operator_only (403); observers_per_credential (429).",
		}, []string{"reason"}),
		handshakeErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "dlock_tls_handshake_errors_total",
			Help: "TLS handshakes that failed: a client certificate the client CA does not sign, plain HTTP sent to the TLS port, a client too slow for the read timeout, ...",
		}),
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dlock_credential_reloads_total",
			Help: "Reloads (SIGHUP) of the token file and the TLS files, by what and result (ok, error: the last good version stays).",
		}, []string{"what", "result"}),
		revokedStreams: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "dlock_auth_revoked_streams_total",
			Help: "Event streams closed because a reload removed the token that opened them, or dropped the CA of their client certificate.",
		}),
	}
	for _, r := range []string{reasonNoToken, reasonBadHeader, reasonUnknownToken, reasonNoCertificate, reasonUntrusted, reasonOtherNode, reasonOperatorOnly, reasonObservers} {
		am.refusals.WithLabelValues(r)
	}
	reg.MustRegister(am.refusals, am.handshakeErrors, am.reloads, am.revokedStreams)
	return am
}

func (s *Server) refuse401(reason string, err error) error {
	s.am.refusals.WithLabelValues(reason).Inc()
	return fmt.Errorf("%w: %w", api.ErrUnauthorized, err)
}

// acceptsBasic reports whether rq may carry its token as the password of
// Basic credentials (RFC 7617) instead of a Bearer token: with a token
// file, on an operator's route (/metrics, /ui, /ui/*), for reading (GET,
// HEAD) only. A browser cannot send a Bearer token but keeps Basic
// credentials and sends them again by itself; kept so, they must never
// reach a request that changes something (cross-site request forgery), so
// node routes, where state changes, refuse them (docs/SECURITY.md).
//
// A path the server does not have (rt nil) takes them too and is answered
// 404 as with a Bearer token: the browser sends what it keeps to every
// path under /, its own /favicon.ico included, and a 401 to
// credentials it sent makes it forget them, so that the page's next read
// or its live feed would fail or ask again.
func (s *Server) acceptsBasic(rq *request, rt *route) bool {
	return s.tokens != nil && (rt == nil || rt.access == accessOperator) &&
		(rq.method == http.MethodGet || rq.method == http.MethodHead)
}

// identify returns who rq comes from, or why it may not be served: 401
// without a valid credential, 403 for a node's credential on an
// operator's route. Where Basic credentials are accepted (acceptsBasic),
// serveRequest's 401 also carries their challenge, so that a browser
// asks for them.
func (s *Server) identify(rq *request, rt *route) (*caller, error) {
	basic := s.acceptsBasic(rq, rt)
	who := &caller{}
	if s.tokens != nil {
		v, dup := rq.authorization()
		if dup {
			// Two headers: which one would a proxy in front have checked?
			return nil, s.refuse401(reasonBadHeader, errors.New("more than one Authorization header"))
		}
		var tok []byte
		var err error
		isBasic := auth.IsBasic(v)
		switch {
		case isBasic && basic:
			// The token is the password; the user is ignored. It is
			// looked up, and checked for "*", as a Bearer token is.
			tok, err = auth.ParseBasic(v)
		case isBasic:
			return nil, s.refuse401(reasonBadHeader, errors.New("credentials of the Basic scheme are accepted only by GET of /metrics, /ui and /ui/*; send \"Authorization: Bearer TOKEN\""))
		default:
			tok, err = auth.ParseAuthorization(v)
		}
		switch {
		case errors.Is(err, auth.ErrNoToken) && basic:
			return nil, s.refuse401(reasonNoToken, errors.New("this server needs \"Authorization: Bearer TOKEN\", or Basic credentials with an operator token as the password (a token of its token file)"))
		case errors.Is(err, auth.ErrNoToken):
			return nil, s.refuse401(reasonNoToken, errors.New("this server needs \"Authorization: Bearer TOKEN\" (a token of its token file)"))
		case err != nil:
			return nil, s.refuse401(reasonBadHeader, err)
		}
		g, ok := s.tokens.Lookup(tok)
		if !ok {
			if isBasic {
				return nil, s.refuse401(reasonUnknownToken, errors.New("the password of the Basic credentials is not a token of the server's token file"))
			}
			return nil, s.refuse401(reasonUnknownToken, errors.New("the bearer token is not in the server's token file"))
		}
		who.grant = g
	}
	if s.mtls {
		id, err := s.certs.Identify(rq.peer)
		switch {
		case errors.Is(err, auth.ErrNoCertificate):
			return nil, s.refuse401(reasonNoCertificate, errors.New("this server needs a client certificate signed by its client CA"))
		case err != nil:
			return nil, s.refuse401(reasonUntrusted, err)
		}
		who.cert, who.peer = id, rq.peer
	}
	if rt != nil && rt.access == accessOperator && !who.operator() {
		s.am.refusals.WithLabelValues(reasonOperatorOnly).Inc()
		return nil, fmt.Errorf("%w: %s needs an operator credential (node \"*\")", api.ErrForbidden, rq.path)
	}
	return who, nil
}

// challenge sets the WWW-Authenticate challenges of a 401 on h: Basic
// first where a browser may answer it, then Bearer.
func (s *Server) challenge(h http.Header, rq *request, rt *route) {
	h.Del("WWW-Authenticate")
	if s.acceptsBasic(rq, rt) {
		h.Add("WWW-Authenticate", basicChallengeValue)
	}
	h.Add("WWW-Authenticate", wwwAuthenticateValue)
}

// mayActAs answers whether the request whose context is ctx may name node
// (its body's node_id, /subscribe's or /status's node_id, /refcount/*'s).
// Every handler that reads a node id asks it before the backend sees the
// node.
func (s *Server) mayActAs(ctx context.Context, node string) error {
	if !s.guarded {
		return nil
	}
	who := callerOf(ctx)
	if err := s.stillValid(who); err != nil {
		return err
	}
	if who != nil && who.mayActAs(node) {
		return nil
	}
	s.am.refusals.WithLabelValues(reasonOtherNode).Inc()
	if who == nil {
		// Unreachable: serveRequest identified the request. Fail closed.
		return fmt.Errorf("%w: the request was not identified", api.ErrForbidden)
	}
	var held []string
	if who.grant != nil && !who.grant.Operator() {
		held = append(held, fmt.Sprintf("the token is node %q's", who.grant.Node))
	}
	if who.cert != nil && !who.cert.MayActAs(node) {
		held = append(held, fmt.Sprintf("the client certificate names %q", who.cert.Names))
	}
	return fmt.Errorf("%w: this credential may not act as node_id %q: %s", api.ErrForbidden, node, strings.Join(held, ", "))
}

// authorization is the request's Authorization header; dup when it has
// more than one (the lean loop passes those to net/http).
func (rq *request) authorization() (v []byte, dup bool) {
	if rq.r != nil {
		vs := rq.r.Header["Authorization"]
		if len(vs) == 0 {
			return nil, false
		}
		return []byte(vs[0]), len(vs) > 1
	}
	return leanHeader(rq.head, "Authorization"), false
}

// crossSite refuses a request a browser sends on behalf of another site
// (docs/SECURITY.md): a browser keeps an operator's client certificate or
// Basic credentials and presents them to whatever page makes it ask, and
// a page on any site can make it POST to /unlock or load /status?node_id=
// as an image. http.CrossOriginProtection tells such requests by their
// Sec-Fetch-Site or Origin header, which browsers set and other clients
// do not; the lean loop leaves every request with either header to
// net/http, so rq.r is set whenever one is present. Only GET and HEAD of
// the routes that merely read (/healthz, /metrics, /ui, /ui/*) may come
// from another site; a GET of /status or /subscribe renews a node's leases
// or keeps its session, so it is checked as a POST is.
func (s *Server) crossSite(rq *request, rt *route) error {
	if rq.r == nil {
		return nil
	}
	r := rq.r
	switch r.Method {
	case http.MethodGet, http.MethodHead:
		if rt != nil && rt.access != accessNode {
			return nil
		}
		fallthrough
	case http.MethodOptions:
		// Check lets these through as safe; here they are not.
		post := *r
		post.Method = http.MethodPost
		r = &post
	}
	if err := s.sameOrigin.Check(r); err != nil {
		s.metrics.crossSite.Inc()
		return fmt.Errorf("%w: a request a browser sent for another site (%v)", api.ErrForbidden, err)
	}
	return nil
}

// stillValid checks again, once the body is read, what identify checked at
// the head: net/http identifies a request before its body arrives, and a
// client may hold the body back (Expect: 100-continue) across a reload
// that removes its token or drops its certificate's CA.
func (s *Server) stillValid(who *caller) error {
	if who == nil {
		return nil
	}
	if who.grant != nil && who.grant.Revoked().Err() != nil {
		return s.refuse401(reasonUnknownToken, errors.New("the bearer token was removed from the server's token file"))
	}
	if who.peer != nil {
		if _, err := s.certs.Identify(who.peer); err != nil {
			return s.refuse401(reasonUntrusted, err)
		}
	}
	return nil
}

// MaxObserversPerCredential bounds the key observers (/subscribe with
// type and resource_id) one node's credential may hold open when
// identities are on: they share --max-watchers with the operator's
// /ui/events, and one node must not take them all (docs/SECURITY.md).
const MaxObserversPerCredential = 16

// observerSlot takes one of the observer streams of the credential of the
// request whose context is ctx, for as long as the stream is open; an
// operator's, or a server without identities, has no bound here.
func (s *Server) observerSlot(ctx context.Context) (release func(), err error) {
	who := callerOf(ctx)
	if !s.guarded || who == nil || who.operator() {
		return func() {}, nil
	}
	var key strings.Builder
	if who.grant != nil {
		key.WriteString(who.grant.Node)
	}
	if who.cert != nil {
		// Node ids hold no control characters (docs/API.md): NUL
		// separates them.
		for _, n := range who.cert.Names {
			key.WriteByte(0)
			key.WriteString(n)
		}
	}
	k := key.String()
	s.obsMu.Lock()
	defer s.obsMu.Unlock()
	if s.observers[k] >= MaxObserversPerCredential {
		s.am.refusals.WithLabelValues(reasonObservers).Inc()
		return nil, fmt.Errorf("%w: this credential holds %d key observer streams, at most %d are allowed", lock.ErrTooManyWatchers, s.observers[k], MaxObserversPerCredential)
	}
	s.observers[k]++
	return sync.OnceFunc(func() {
		s.obsMu.Lock()
		defer s.obsMu.Unlock()
		if s.observers[k]--; s.observers[k] == 0 {
			delete(s.observers, k)
		}
	}), nil
}

// generation is one reading of the TLS files; its ctx ends at the next.
type generation struct {
	ctx  context.Context
	next context.CancelFunc
}

func newGeneration() *generation {
	ctx, cancel := context.WithCancel(context.Background())
	return &generation{ctx: ctx, next: cancel}
}

// revocation returns the context an event stream of the request whose
// context is ctx ends with (docs/SECURITY.md): cancelled, and counted in
// dlock_auth_revoked_streams_total, when the token that opened it is
// removed, when a reload of the TLS files leaves its client certificate
// unverified (its CA dropped), or when that certificate expires. nil
// without credentials. stop, called when the stream ends, releases what
// watches them.
func (s *Server) revocation(ctx context.Context) (revoked context.Context, stop func()) {
	who := callerOf(ctx)
	if who == nil || (who.grant == nil && who.peer == nil) {
		return nil, func() {}
	}
	revoked, cancel := context.WithCancel(context.Background())
	var (
		mu                  sync.Mutex // guards what follows
		ended               bool
		stopToken, stopCert func() bool
		expiry              *time.Timer
	)
	end := func(credentialGone bool) {
		mu.Lock()
		defer mu.Unlock()
		if ended {
			return
		}
		ended = true
		// Counted before the stream ends: whoever sees it end sees it
		// counted (TestAuthBasicRevokedStreamEnds).
		if credentialGone {
			s.am.revokedStreams.Inc()
		}
		cancel()
		for _, f := range []func() bool{stopToken, stopCert} {
			if f != nil {
				f()
			}
		}
		if expiry != nil {
			expiry.Stop()
		}
	}
	if who.grant != nil {
		mu.Lock()
		stopToken = context.AfterFunc(who.grant.Revoked(), func() { end(true) })
		mu.Unlock()
	}
	if who.peer != nil {
		var check func()
		check = func() {
			// The generation is read before the check: a reload between
			// them ends it, and the certificate is checked once more.
			gen := s.certGen.Load()
			id, err := s.certs.Identify(who.peer)
			if err != nil {
				end(true)
				return
			}
			mu.Lock()
			defer mu.Unlock()
			if ended {
				return
			}
			// Once on the next reload, and when the certificate (or its
			// CA's) expires; not twice, whichever of the two called.
			if stopCert != nil {
				stopCert()
			}
			stopCert = context.AfterFunc(gen.ctx, check)
			if expiry != nil {
				expiry.Stop()
			}
			expiry = time.AfterFunc(time.Until(id.Expires)+time.Millisecond, check)
		}
		check()
	}
	return revoked, func() { end(false) }
}

// Reload reads the token file and the TLS files again (dlock serve does it
// on SIGHUP). What fails to read keeps its last good version, and the
// error says which; event streams opened with a token that is gone end
// now, and so does every request that carries one.
func (s *Server) Reload() error {
	var errs []error
	if s.tokens != nil {
		added, removed, err := s.tokens.Reload()
		if err != nil {
			s.am.reloads.WithLabelValues("tokens", "error").Inc()
			errs = append(errs, err)
		} else {
			s.am.reloads.WithLabelValues("tokens", "ok").Inc()
			s.log.Info("token file reloaded", "path", s.tokens.Path(), "tokens", s.tokens.Len(), "added", added, "removed", removed)
		}
	}
	if s.certs != nil {
		if err := s.certs.Reload(); err != nil {
			s.am.reloads.WithLabelValues("tls", "error").Inc()
			errs = append(errs, err)
		} else {
			s.am.reloads.WithLabelValues("tls", "ok").Inc()
			s.certGen.Swap(newGeneration()).next()
			leaf := s.certs.Leaf()
			s.log.Info("TLS certificates reloaded", "subject", leaf.Subject.String(), "not_after", leaf.NotAfter, "client_ca", s.mtls)
		}
	}
	return errors.Join(errs...)
}

// peerKey holds, in a net/http connection's context, its client
// certificate's auth.Peer.
type peerKey struct{}

// peerOf is the client certificate of a request net/http read.
func peerOf(r *http.Request) *auth.Peer {
	if p, ok := r.Context().Value(peerKey{}).(*auth.Peer); ok {
		return p
	}
	// Not served through Serve (which handshakes itself): the handshake's
	// CA is not known, Identify verifies the certificate again.
	return auth.NewPeer(r.TLS)
}

// connContext gives each connection net/http serves the client
// certificate the lean loop's handshake took: from the passed
// connection, or from h2Peers for an h2 connection handed over whole.
func (s *Server) connContext(prev func(context.Context, net.Conn) context.Context) func(context.Context, net.Conn) context.Context {
	return func(ctx context.Context, c net.Conn) context.Context {
		if prev != nil {
			ctx = prev(ctx, c)
		}
		var p *auth.Peer
		switch c := c.(type) {
		case *passedConn:
			p = c.peer
		case passedTLSConn:
			p = c.peer
		case *tls.Conn:
			if v, ok := s.h2Peers.LoadAndDelete(c); ok {
				p = v.(*auth.Peer)
			}
		}
		if p != nil {
			ctx = context.WithValue(ctx, peerKey{}, p)
		}
		return ctx
	}
}

// passedTLSConn is a passed connection over TLS: net/http fills
// Request.TLS from its ConnectionState.
type passedTLSConn struct {
	*passedConn
	tc *tls.Conn
}

func (c passedTLSConn) ConnectionState() tls.ConnectionState { return c.tc.ConnectionState() }
