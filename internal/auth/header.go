package auth

import "errors"

// Errors of ParseAuthorization.
var (
	// ErrNoToken is a request without an Authorization header.
	ErrNoToken = errors.New("no bearer token")
	// ErrBadHeader is an Authorization header that is not exactly
	// "Bearer TOKEN".
	ErrBadHeader = errors.New("the Authorization header is not \"Bearer TOKEN\"")
)

// ParseAuthorization returns the token of an Authorization header value
// (RFC 6750 §2.1): the scheme "Bearer" in any case, one or more spaces,
// and a b64token; optional white space (SP, HTAB) around the value, as
// header parsers leave or strip it. Anything else — another scheme, a
// second token, a comma, a tab between scheme and token — is ErrBadHeader:
// a header read one way here and another way by a proxy in front must not
// pass. The result aliases v.
func ParseAuthorization(v []byte) ([]byte, error) {
	v = trimOWS(v)
	if len(v) == 0 {
		return nil, ErrNoToken
	}
	const scheme = "bearer"
	if len(v) < len(scheme)+2 || v[len(scheme)] != ' ' {
		return nil, ErrBadHeader
	}
	for i := range len(scheme) {
		if c := v[i] | 0x20; c != scheme[i] { // ASCII letters only: | 0x20 lowers them
			return nil, ErrBadHeader
		}
	}
	tok := v[len(scheme):]
	for len(tok) > 0 && tok[0] == ' ' {
		tok = tok[1:]
	}
	if !validToken(tok) {
		return nil, ErrBadHeader
	}
	return tok, nil
}

// ValidToken reports whether tok is a b64token (RFC 6750 §2.1): one or
// more of A–Z a–z 0–9 - . _ ~ + /, then any number of '='.
func ValidToken(tok string) bool { return validToken([]byte(tok)) }

func validToken(tok []byte) bool {
	i := 0
	for i < len(tok) && tokenChar[tok[i]] {
		i++
	}
	if i == 0 {
		return false
	}
	for i < len(tok) && tok[i] == '=' {
		i++
	}
	return i == len(tok)
}

var tokenChar = func() (t [256]bool) {
	for c := 'a'; c <= 'z'; c++ {
		t[c], t[c-'a'+'A'] = true, true
	}
	for c := '0'; c <= '9'; c++ {
		t[c] = true
	}
	for _, c := range "-._~+/" {
		t[c] = true
	}
	return t
}()

func trimOWS(b []byte) []byte {
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t') {
		b = b[1:]
	}
	for len(b) > 0 && (b[len(b)-1] == ' ' || b[len(b)-1] == '\t') {
		b = b[:len(b)-1]
	}
	return b
}
