package auth

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const (
	tokA  = "aaaaaaaaaaaaaaaaaaaaaaaa"
	tokB  = "bbbbbbbbbbbbbbbbbbbbbbbb"
	tokOp = "operator-token-0123456789"
)

func writeTokens(t *testing.T, path, text string) {
	t.Helper()
	if err := os.WriteFile(path+".tmp", []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		t.Fatal(err)
	}
}

func TestLoadTokens(t *testing.T) {
	path := filepath.Join(t.TempDir(), "tokens")
	writeTokens(t, path, "# nodes\r\n\n  "+tokA+" node-a\r\n"+tokB+"\tnode with spaces  \n"+tokOp+" *\n\t# indented comment\n")
	tk, err := LoadTokens(path)
	if err != nil {
		t.Fatal(err)
	}
	for tok, want := range map[string]string{tokA: "node-a", tokB: "node with spaces", tokOp: "*"} {
		g, ok := tk.Lookup([]byte(tok))
		if !ok || g.Node != want || g.Operator() != (want == Operator) {
			t.Errorf("token for %q: %+v %v", want, g, ok)
		}
	}
	for _, tok := range []string{"", "node-a", tokA + "x", strings.ToUpper(tokA)} {
		if g, ok := tk.Lookup([]byte(tok)); ok {
			t.Errorf("Lookup(%q) = %+v", tok, g)
		}
	}
	if tk.Len() != 3 {
		t.Errorf("Len %d", tk.Len())
	}
}

func TestTokenFileErrors(t *testing.T) {
	secret := "s3cr3t-s3cr3t-s3cr3t"
	for _, tc := range []struct{ name, text, want string }{
		{"one field", "# x\n" + secret + "\n", ":2: want TOKEN NODE_ID"},
		{"one field and blanks", secret + "   \n", ":1: want TOKEN NODE_ID"},
		{"short token", "abc node-a\n", ":1: the token has 3 characters, at least 16"},
		{"bad character", secret + "! node-a\n", ":1: the token is not a bearer token"},
		{"equals inside", "abc=defghijklmnopqrs node-a\n", ":1: the token is not a bearer token"},
		{"duplicate", secret + " a\n\n" + secret + " b\n", ":3: the token of line 1 again"},
		{"control in node", secret + " a\x01b\n", ":1: invalid request: node_id contains a control character"},
		{"bidi in node", secret + " a\u202eb\n", ":1:"},
		{"long line", secret + " " + strings.Repeat("n", 5000) + "\n", ":1: the line is longer than"},
		{"node too long", secret + " " + strings.Repeat("n", 300) + "\n", ":1:"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "tokens")
			writeTokens(t, path, tc.text)
			_, err := LoadTokens(path)
			if err == nil || !errors.Is(err, ErrTokenFile) || !strings.Contains(err.Error(), path+tc.want) && !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err %v, want %q", err, tc.want)
			}
			if !strings.Contains(err.Error(), path+":") {
				t.Errorf("err %v does not name the file and line", err)
			}
			if strings.Contains(err.Error(), secret) || strings.Contains(err.Error(), "abc") {
				t.Errorf("the error shows the token: %v", err)
			}
		})
	}
	if _, err := LoadTokens(filepath.Join(t.TempDir(), "missing")); !errors.Is(err, os.ErrNotExist) || !errors.Is(err, ErrTokenFile) {
		t.Errorf("missing file: %v", err)
	}
}

// TestTokensReload: a reload revokes removed tokens and tokens given to
// another node, keeps the others' grants as they were, and a bad file
// leaves the table as it was.
func TestTokensReload(t *testing.T) {
	path := filepath.Join(t.TempDir(), "tokens")
	writeTokens(t, path, tokA+" a\n"+tokB+" b\n"+tokOp+" *\n")
	tk, err := LoadTokens(path)
	if err != nil {
		t.Fatal(err)
	}
	ga, _ := tk.Lookup([]byte(tokA))
	gb, _ := tk.Lookup([]byte(tokB))
	gop, _ := tk.Lookup([]byte(tokOp))

	writeTokens(t, path, tokA+" a\n"+tokOp+" c\n")
	added, removed, err := tk.Reload()
	if err != nil || added != 1 || removed != 2 {
		t.Fatalf("Reload: +%d -%d %v", added, removed, err)
	}
	if ga.Revoked().Err() != nil {
		t.Error("a kept token was revoked")
	}
	if g, _ := tk.Lookup([]byte(tokA)); g != ga {
		t.Error("a kept token has a new grant")
	}
	if gb.Revoked().Err() == nil || gop.Revoked().Err() == nil {
		t.Error("a removed token, or one given to another node, was not revoked")
	}
	if _, ok := tk.Lookup([]byte(tokB)); ok {
		t.Error("a removed token still works")
	}
	if g, ok := tk.Lookup([]byte(tokOp)); !ok || g.Node != "c" || g.Operator() || g.Revoked().Err() != nil {
		t.Errorf("a token given to node c: %+v %v", g, ok)
	}

	writeTokens(t, path, "broken\n")
	if _, _, err := tk.Reload(); err == nil {
		t.Fatal("a bad file reloaded")
	}
	if g, ok := tk.Lookup([]byte(tokA)); !ok || g != ga || ga.Revoked().Err() != nil {
		t.Error("a failed reload changed the table")
	}
	os.Remove(path)
	if _, _, err := tk.Reload(); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("reload of a removed file: %v", err)
	}
	if _, ok := tk.Lookup([]byte(tokA)); !ok {
		t.Error("a failed reload emptied the table")
	}
}

func TestNewToken(t *testing.T) {
	a, b := NewToken(), NewToken()
	if a == b || len(a) != 43 || !ValidToken(a) || len(a) < MinTokenLen {
		t.Fatalf("tokens %q %q", a, b)
	}
}
