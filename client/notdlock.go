package client

import (
	"bytes"
	"fmt"
	"mime"
	"net/url"
)

// NotDlockError is an answer that did not come from a dlock server: a web
// page from another server at the address (a web server, a proxy's or a
// captive portal's error page). dlock answers JSON (docs/API.md); the
// page itself is not kept, only that it was one. Err is what the answer
// would have been taken for: the *api.Error of its status, or the JSON
// decoding error of a 200, so errors.As and errors.Is match as before.
type NotDlockError struct {
	// Server is the server's base URL, scheme://host[:port].
	Server string
	// Method and URL are the request's.
	Method, URL string
	// Status is the answer's HTTP status code.
	Status int
	// Got names what came instead of JSON: "HTML".
	Got string
	Err error
}

func (e *NotDlockError) Error() string {
	return fmt.Sprintf("dlock: %s %s: not a dlock server (got %s, HTTP %d)", e.Method, e.URL, e.Got, e.Status)
}

func (e *NotDlockError) Unwrap() error { return e.Err }

// notDlock returns a *NotDlockError wrapping err when the answer is a web
// page, and err otherwise: a JSON body, or a text one (net/http's own
// refusals, which a dlock server sends too, are plain text).
func notDlock(method, u string, status int, contentType string, body []byte, err error) error {
	mt, _, _ := mime.ParseMediaType(contentType)
	head := bytes.TrimSpace(body[:min(len(body), 512)])
	isHTML := mt == "text/html" || mt == "application/xhtml+xml" ||
		bytes.HasPrefix(bytes.ToLower(head), []byte("<!doctype html")) || bytes.HasPrefix(bytes.ToLower(head), []byte("<html"))
	if !isHTML {
		return err
	}
	server := u
	if pu, perr := url.Parse(u); perr == nil {
		server = (&url.URL{Scheme: pu.Scheme, Host: pu.Host}).String()
	}
	return &NotDlockError{Server: server, Method: method, URL: u, Status: status, Got: "HTML", Err: err}
}
