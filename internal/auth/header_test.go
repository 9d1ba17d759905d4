package auth

import (
	"bytes"
	"encoding/base64"
	"errors"
	"net/http"
	"regexp"
	"strings"
	"testing"
)

func TestParseAuthorization(t *testing.T) {
	for _, tc := range []struct {
		in, tok string
		err     error
	}{
		{"Bearer abc", "abc", nil},
		{"bearer abc", "abc", nil},
		{"BEARER abc", "abc", nil},
		{"BeArEr a-b.c_d~e+f/g==", "a-b.c_d~e+f/g==", nil},
		{"Bearer    abc", "abc", nil},
		{" \tBearer abc \t", "abc", nil},
		{"", "", ErrNoToken},
		{" \t ", "", ErrNoToken},
		{"Bearer", "", ErrBadHeader},
		{"Bearer ", "", ErrBadHeader},
		{"Bearer\tabc", "", ErrBadHeader},
		{"Bearerabc", "", ErrBadHeader},
		{"Basic YTpi", "", ErrBadHeader},
		{"Token abc", "", ErrBadHeader},
		{"Bearer abc def", "", ErrBadHeader},
		{"Bearer abc,Bearer def", "", ErrBadHeader},
		{"Bearer abc, def", "", ErrBadHeader},
		{"Bearer =abc", "", ErrBadHeader},
		{"Bearer a=b", "", ErrBadHeader},
		{"Bearer ab\x00", "", ErrBadHeader},
		{"Bearer abc\u00a0", "", ErrBadHeader},
		{"Bearer \"abc\"", "", ErrBadHeader},
		{"Bearer abc;", "", ErrBadHeader},
		{"Bearer  abc\tdef", "", ErrBadHeader},
		{"\u0130earer abc", "", ErrBadHeader},
		{"Bearer\u00a0abc", "", ErrBadHeader},
	} {
		tok, err := ParseAuthorization([]byte(tc.in))
		if string(tok) != tc.tok || !errors.Is(err, tc.err) {
			t.Errorf("ParseAuthorization(%q) = %q, %v; want %q, %v", tc.in, tok, err, tc.tok, tc.err)
		}
	}
}

// bearerRE is RFC 6750 §2.1's credentials with optional white space
// around, as a regular expression.
var bearerRE = regexp.MustCompile(`^[ \t]*[Bb][Ee][Aa][Rr][Ee][Rr] +([A-Za-z0-9._~+/-]+=*)[ \t]*$`)

// FuzzAuthorization holds the hand-written parser to the grammar: it
// accepts exactly what the regular expression does, returns the same
// token, and never panics.
func FuzzAuthorization(f *testing.F) {
	for _, s := range []string{"Bearer abc", "bearer  a==", " Bearer x ", "Bearer\tx", "Basic x", "Bearer a b", "", "Bearer =", "BEARER a/b+c", "Bearer a=b"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, v []byte) {
		tok, err := ParseAuthorization(v)
		m := bearerRE.FindSubmatch(v)
		switch {
		case m == nil && err == nil:
			t.Fatalf("%q: accepted token %q, the grammar does not", v, tok)
		case m != nil && (err != nil || !bytes.Equal(tok, m[1])):
			t.Fatalf("%q: got %q, %v; the grammar reads %q", v, tok, err, m[1])
		case err != nil && !errors.Is(err, ErrNoToken) && !errors.Is(err, ErrBadHeader):
			t.Fatalf("%q: unexpected error %v", v, err)
		case errors.Is(err, ErrNoToken) && len(bytes.Trim(v, " \t")) != 0:
			t.Fatalf("%q: no token, but the header is not empty", v)
		case err == nil && !ValidToken(string(tok)):
			t.Fatalf("%q: token %q is not valid", v, tok)
		}
	})
}

// basicOf is the Authorization value a browser sends for user and
// password.
func basicOf(user, password string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+password))
}

// netHTTPBasic is the password net/http's BasicAuth finds in the header
// value v, as its header reader would hand it over: without the white
// space around.
func netHTTPBasic(v []byte) (string, bool) {
	r := &http.Request{Header: http.Header{"Authorization": {string(bytes.Trim(v, " \t"))}}}
	_, pw, ok := r.BasicAuth()
	return pw, ok
}

func TestParseBasic(t *testing.T) {
	const tok = "token-of-the-operator-0123"
	for _, tc := range []struct {
		in, pw string
		err    error
		std    bool // net/http's BasicAuth accepts it (with the same password when pw is set)
	}{
		{basicOf("", tok), tok, nil, true},
		{basicOf("alice", tok), tok, nil, true},
		{basicOf("dlock", "a-b.c_d~e+f/g=="), "a-b.c_d~e+f/g==", nil, true},
		{basicOf("a:b", tok), "b:" + tok, ErrBadHeader, true}, // the first colon ends the user: "b:..." is no token
		{basicOf("\x00\xff", tok), tok, nil, true},            // the user is ignored, whatever it holds
		{"basic " + basicOf("", tok)[6:], tok, nil, true},
		{"BASIC " + basicOf("", tok)[6:], tok, nil, true},
		{" \t" + basicOf("", tok) + " \t", tok, nil, true},
		{"", "", ErrNoToken, false},
		{" \t", "", ErrNoToken, false},
		{"Basic", "", ErrBadHeader, false},
		{"Basic ", "", ErrBadHeader, false},
		{"Basic  " + basicOf("", tok)[6:], "", ErrBadHeader, false}, // two spaces
		{"Basic\t" + basicOf("", tok)[6:], "", ErrBadHeader, false},
		{"Bearer " + tok, "", ErrBadHeader, false},
		{"Basic " + base64.StdEncoding.EncodeToString([]byte(tok)), "", ErrBadHeader, false},         // no colon
		{"Basic " + base64.RawStdEncoding.EncodeToString([]byte("u:"+tok)), "", ErrBadHeader, false}, // no padding
		{"Basic " + base64.URLEncoding.EncodeToString([]byte("u:"+tok+"?>")), "", ErrBadHeader, false},
		{basicOf("", tok) + ", Bearer x", "", ErrBadHeader, false},
		{basicOf("", tok) + " x", "", ErrBadHeader, false},
		{"Basic !!!!", "", ErrBadHeader, false},
		{"Basic ====", "", ErrBadHeader, false},
		{"\u0130asic " + basicOf("", tok)[6:], "", ErrBadHeader, false},
		// Intentional differences: net/http accepts these.
		{basicOf("", ""), "", ErrBadHeader, true},              // an empty password
		{basicOf("u", "tok en"), "", ErrBadHeader, true},       // a password that is no token
		{basicOf("u", tok+"\n"), "", ErrBadHeader, true},       // nor is this one
		{"Basic dTp4eHh4\r\neHh4eHg=", "", ErrBadHeader, true}, // CR LF in the base64, which encoding/base64 skips
		{"Basic dTp4eQ==", "xy", nil, true},
		{"Basic dTp4eR==", "", ErrBadHeader, true}, // "u:xy" again, with non-zero padding bits
	} {
		pw, err := ParseBasic([]byte(tc.in))
		want := tc.pw
		if tc.err != nil {
			want = ""
		}
		if string(pw) != want || !errors.Is(err, tc.err) {
			t.Errorf("ParseBasic(%q) = %q, %v; want %q, %v", tc.in, pw, err, want, tc.err)
		}
		if err != nil && !errors.Is(err, ErrNoToken) && !errors.Is(err, ErrBadBasic) {
			t.Errorf("ParseBasic(%q): error %v, want ErrBadBasic", tc.in, err)
		}
		std, ok := netHTTPBasic([]byte(tc.in))
		if ok != tc.std || (ok && tc.pw != "" && std != tc.pw) {
			t.Errorf("net/http's BasicAuth(%q) = %q, %v; the table says %q, %v", tc.in, std, ok, tc.pw, tc.std)
		}
		if got, want := IsBasic([]byte(tc.in)), strings.HasPrefix(strings.ToLower(strings.Trim(tc.in, " \t")), "basic "); got != want {
			t.Errorf("IsBasic(%q) = %v", tc.in, got)
		}
	}
}

// FuzzBasicMatchesNetHTTP holds ParseBasic to net/http's
// (*http.Request).BasicAuth on the same header value: where ParseBasic
// accepts, BasicAuth accepts with the same password, which is a valid
// token; where BasicAuth finds a password that is a valid token in
// canonical base64 (what encoding the decoded bytes again gives back),
// ParseBasic accepts it too. The differences in between are the ones
// ParseBasic's comment lists. It never panics. Each input is tried as a
// header value and, so that the fuzzer reaches the passwords as easily as
// the encodings, as "user:password" sent the way a browser sends it.
func FuzzBasicMatchesNetHTTP(f *testing.F) {
	for _, s := range []string{
		basicOf("", "token-of-the-operator-0123"), basicOf("dlock", "abc"), basicOf("", ""), basicOf("a:b", "c"),
		" basic " + basicOf("u", "x")[6:] + "\t", "Basic  dTp4eQ==", "Basic dTp4eR==", "Basic dTp4\r\neQ==",
		"Basic dTp4eQ", "Basic =", "Basic ", "Basic", "", "Bearer abc", "Basic dTp4eQ==,", "BASIC dTp4eQ==",
		":token-of-the-operator-0123", "user:a/b+c==", "u:x y", "u:", "no colon",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, v []byte) {
		checkBasic(t, v)
		checkBasic(t, []byte("Basic "+base64.StdEncoding.EncodeToString(v)))
	})
}

func checkBasic(t *testing.T, v []byte) {
	t.Helper()
	pw, err := ParseBasic(v)
	std, ok := netHTTPBasic(v)
	trimmed := bytes.Trim(v, " \t")
	switch {
	case err == nil && (!ok || std != string(pw)):
		t.Fatalf("%q: ParseBasic %q, net/http's BasicAuth %q, %v", v, pw, std, ok)
	case err == nil && (!ValidToken(string(pw)) || !IsBasic(v)):
		t.Fatalf("%q: accepted %q, no token or no Basic scheme", v, pw)
	case errors.Is(err, ErrNoToken) != (len(trimmed) == 0):
		t.Fatalf("%q: %v", v, err)
	case err != nil && !errors.Is(err, ErrNoToken) && (!errors.Is(err, ErrBadBasic) || !errors.Is(err, ErrBadHeader)):
		t.Fatalf("%q: unexpected error %v", v, err)
	case err != nil && ok && ValidToken(std):
		// BasicAuth matched "Basic " case-insensitively: trimmed[6:] is
		// what it decoded.
		user, _, _ := strings.Cut(string(mustDecode(t, trimmed[6:])), ":")
		if base64.StdEncoding.EncodeToString([]byte(user+":"+std)) == string(trimmed[6:]) {
			t.Fatalf("%q: net/http's BasicAuth finds the token %q in canonical base64, ParseBasic refused: %v", v, std, err)
		}
	}
}

func mustDecode(t *testing.T, b []byte) []byte {
	t.Helper()
	d, err := base64.StdEncoding.DecodeString(string(b))
	if err != nil {
		t.Fatalf("%q: net/http decoded it, encoding/base64 does not: %v", b, err)
	}
	return d
}
