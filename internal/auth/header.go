package auth

import (
	"bytes"
	"encoding/base64"
	"errors"
)

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

// ErrBadBasic is an Authorization header that names the Basic scheme but
// is not exactly "Basic " and the padded base64 of "user:TOKEN". It is an
// ErrBadHeader (errors.Is), with its own message.
var ErrBadBasic error = badBasic{}

type badBasic struct{}

func (badBasic) Error() string {
	return "the Authorization header is not \"Basic \" and the base64 of \"user:TOKEN\""
}

func (badBasic) Is(target error) bool { return target == ErrBadHeader }

// IsBasic reports whether an Authorization header value names the Basic
// scheme (RFC 7617): after optional white space, "Basic" in any case and a
// space. It says which parser to ask, not that the value is valid.
func IsBasic(v []byte) bool {
	return hasScheme(trimOWS(v), "basic")
}

// ParseBasic returns the password of Basic credentials (RFC 7617), which
// dlock takes as a token: "Basic" in any case, exactly one space, and the
// base64 (RFC 4648 §4, padded) of "user:password"; optional white space
// (SP, HTAB) around the value. The user, which may be empty, is ignored;
// the password is what follows the first colon. An empty value is
// ErrNoToken; anything else that is not that is ErrBadBasic.
//
// It accepts a subset of what net/http's (*http.Request).BasicAuth does
// with the same value (as net/http's header reader hands it over, without
// the white space around), and where it accepts, both return the same
// password: FuzzBasicMatchesNetHTTP holds it to that. What BasicAuth takes
// and ParseBasic refuses, on purpose:
//   - a CR or LF inside the base64, which encoding/base64 skips: a header
//     read one way here and another way by a proxy in front must not pass;
//   - base64 that is not canonical (non-zero padding bits, as "YR=="), which
//     StdEncoding decodes and StdEncoding.Strict() does not: every encoder,
//     browsers included, writes the canonical form;
//   - a password that is not a valid token (ValidToken), an empty one
//     included: no token file holds it.
//
// Unlike ParseAuthorization the result does not alias v.
func ParseBasic(v []byte) ([]byte, error) {
	v = trimOWS(v)
	if len(v) == 0 {
		return nil, ErrNoToken
	}
	const scheme = "basic"
	if !hasScheme(v, scheme) {
		return nil, ErrBadBasic
	}
	enc := v[len(scheme)+1:]
	if len(enc) == 0 || bytes.ContainsAny(enc, "\r\n") {
		return nil, ErrBadBasic
	}
	dec := make([]byte, base64.StdEncoding.DecodedLen(len(enc)))
	n, err := base64.StdEncoding.Strict().Decode(dec, enc)
	if err != nil {
		return nil, ErrBadBasic
	}
	_, pw, ok := bytes.Cut(dec[:n], []byte{':'})
	if !ok || !validToken(pw) {
		return nil, ErrBadBasic
	}
	return pw, nil
}

// hasScheme reports whether v starts with scheme, a lower-case ASCII word,
// in any case, and a space.
func hasScheme(v []byte, scheme string) bool {
	if len(v) <= len(scheme) || v[len(scheme)] != ' ' {
		return false
	}
	for i := range len(scheme) {
		if v[i]|0x20 != scheme[i] { // ASCII letters only: | 0x20 lowers them
			return false
		}
	}
	return true
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
