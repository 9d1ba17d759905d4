package auth

import (
	"bytes"
	"errors"
	"regexp"
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
