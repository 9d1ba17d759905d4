package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"syscall"
	"time"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/client"
)

// message is err as the one line exitCode prints after "dlock: ". The
// client's errors carry the package's "dlock: " prefix, some more than
// once; the line has it once, from exitCode.
func message(err error) string {
	return strings.ReplaceAll(err.Error(), "dlock: ", "")
}

// explained is an error with the line a person reads in place of its
// chain's, which errors.Is and errors.As still see.
type explained struct {
	msg string
	err error
}

func (e *explained) Error() string { return e.msg }
func (e *explained) Unwrap() error { return e.err }

// explain turns a failed request to servers into a line that says what is
// wrong and what to do: the server cannot be reached, speaks another
// protocol, or is not a dlock server. Other errors pass unchanged.
func explain(err error, servers []string) error {
	if err == nil {
		return nil
	}
	if msg := diagnose(err, servers); msg != "" {
		return &explained{msg: msg, err: err}
	}
	return err
}

func diagnose(err error, servers []string) string {
	if nd, ok := errors.AsType[*client.NotDlockError](err); ok {
		return fmt.Sprintf("%s: not a dlock server (got %s)", nd.Server, nd.Got)
	}
	if ae, ok := errors.AsType[*api.Error](err); ok {
		// net/http's answer to plain HTTP on a TLS port (400, text).
		if ae.Status == http.StatusBadRequest && strings.HasPrefix(ae.Code, "http_") {
			for _, s := range servers {
				if strings.HasPrefix(s, "http://") && speaksTLS(s) {
					return fmt.Sprintf("server at %s speaks TLS: use https://", s)
				}
			}
		}
		switch {
		case errors.Is(err, client.ErrUnauthorized):
			return message(err) + " (give this node's credential: --token-file, or --cert and --key)"
		case errors.Is(err, client.ErrForbidden):
			return message(err) + " (the credential belongs to another node than --node, or is not an operator's)"
		}
		return ""
	}
	ue, ok := errors.AsType[*url.Error](err)
	if !ok {
		return ""
	}
	server := baseURL(ue.URL)
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return fmt.Sprintf("cannot reach %s: connection refused (is dlock serve running there?)", server)
	case strings.HasPrefix(server, "http://") && (errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET)) && speaksTLS(server):
		// A TLS server closes a connection that starts in plain HTTP:
		// all the client sees is its end.
		return fmt.Sprintf("server at %s speaks TLS: use https://", server)
	case strings.Contains(ue.Err.Error(), "server gave HTTP response to HTTPS client"):
		// net/http's own words for it; it has no error value to match.
		return fmt.Sprintf("server at %s speaks plain HTTP: use http://", server)
	}
	if dns, ok := errors.AsType[*net.DNSError](err); ok {
		return fmt.Sprintf("cannot reach %s: no such host %s (check --server)", server, dns.Name)
	}
	if cve, ok := errors.AsType[*tls.CertificateVerificationError](err); ok {
		return fmt.Sprintf("%s: its certificate does not verify: %v (--ca names the CA that signed it)", server, cve.Err)
	}
	if ue.Timeout() {
		return fmt.Sprintf("%s did not answer in time (overloaded, or a firewall drops the traffic?)", server)
	}
	return fmt.Sprintf("%s: %v", server, message(ue.Err))
}

// baseURL is scheme://host of a request's URL.
func baseURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return raw
	}
	return (&url.URL{Scheme: u.Scheme, Host: u.Host}).String()
}

// speaksTLS reports whether the server of an http:// URL answers a TLS
// handshake: a second connection, only when a plain request to it broke.
// Nothing is sent over it but the handshake, so the server's certificate
// is not verified: the question is only which protocol the port speaks.
func speaksTLS(server string) bool {
	u, err := url.Parse(server)
	if err != nil || u.Host == "" {
		return false
	}
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), "80")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	d := tls.Dialer{Config: &tls.Config{InsecureSkipVerify: true, ServerName: u.Hostname()}}
	conn, err := d.DialContext(ctx, "tcp", host)
	if err == nil {
		conn.Close()
		return true
	}
	// A server that wants a client certificate refuses the handshake
	// with an alert: TLS all the same.
	_, alert := errors.AsType[tls.AlertError](err)
	oe, ok := errors.AsType[*net.OpError](err)
	return alert || (ok && oe.Op == "remote error")
}
