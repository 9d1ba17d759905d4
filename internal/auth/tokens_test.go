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
		{"no final newline", "# x\n" + secret + " node-a", ":2: the last line does not end with a newline: written in place, or caught half-written? write it whole and rename it into place"},
		{"no final newline after a node with spaces", secret + " node a\n" + secret + "x node b", ":2: the last line does not end with a newline"},
		{"no final newline after a CR", secret + " node-a\r", ":1: the last line does not end with a newline"},
		{"no final newline in a comment", secret + " node-a\n# x", ":2: the last line does not end with a newline"},
		{"no final newline in blanks", secret + " node-a\n  ", ":2: the last line does not end with a newline"},
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

// TestTokensReloadCutShort: a token file caught half-written — written in
// place and reloaded before the write ends — is refused, and the table
// stays as it was. Read as a whole file, a file cut to nothing revokes
// every token, a file cut inside "node-10" gives node-10's token to
// node-1, and one cut after the star of "*ops" makes the token an
// operator's.
func TestTokensReloadCutShort(t *testing.T) {
	const (
		tok1   = "token-of-node-1-0123456789"
		tok10  = "token-of-node-10-012345678"
		tokOps = "token-of-ops-team-01234567"
	)
	whole := tok1 + " node-1\n" + tok10 + " node-10\n" + tokOps + " *ops\n"
	for _, tc := range []struct {
		name, cut, want string
		check           func(t *testing.T, tk *Tokens)
	}{
		{"cut to nothing", "", path0 + ": the file is empty, which would revoke all 3 tokens", func(t *testing.T, tk *Tokens) {
			if _, ok := tk.Lookup([]byte(tok1)); !ok {
				t.Error("every token was revoked by an empty file")
			}
		}},
		{"cut in a node id", tok1 + " node-1\n" + tok10 + " node-1", path0 + ":2: the last line does not end with a newline", func(t *testing.T, tk *Tokens) {
			if g, _ := tk.Lookup([]byte(tok10)); g == nil || g.Node != "node-10" {
				t.Errorf("node-10's token now acts as %+v", g)
			}
		}},
		{"cut after a star", whole[:len(whole)-len("ops\n")], path0 + ":3: the last line does not end with a newline", func(t *testing.T, tk *Tokens) {
			if g, _ := tk.Lookup([]byte(tokOps)); g == nil || g.Operator() {
				t.Errorf("the token of node \"*ops\" became an operator's: %+v", g)
			}
		}},
		{"cut in a token", tok1 + " node-1\n" + tok10[:5], path0 + ":2: the last line does not end with a newline", func(t *testing.T, tk *Tokens) {
			if g, _ := tk.Lookup([]byte(tok10)); g == nil || g.Node != "node-10" {
				t.Errorf("node-10's token now acts as %+v", g)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "tokens")
			writeTokens(t, path, whole)
			tk, err := LoadTokens(path)
			if err != nil {
				t.Fatal(err)
			}
			// What a reader sees while the writer is between two writes.
			if err := os.WriteFile(path, []byte(tc.cut), 0o600); err != nil {
				t.Fatal(err)
			}
			_, removed, err := tk.Reload()
			if err == nil {
				t.Fatalf("a file cut short reloaded (%d tokens revoked)", removed)
			}
			if want := strings.Replace(tc.want, path0, path, 1); !errors.Is(err, ErrTokenFile) || !strings.Contains(err.Error(), want) {
				t.Errorf("err %v, want %q", err, want)
			}
			for _, tok := range []string{tok1, tok10, tokOps} {
				if strings.Contains(err.Error(), tok[:8]) {
					t.Errorf("the error shows a token: %v", err)
				}
			}
			tc.check(t, tk)
			if tk.Len() != 3 {
				t.Errorf("%d tokens after a refused reload, want 3", tk.Len())
			}
		})
	}
}

// path0 stands for the token file's path in the errors wanted.
const path0 = "$PATH"

// TestTokensEmptyFile: an empty file is an empty table at start (the
// server warns), and a reload of one is refused while the table has
// tokens; a file of comments only empties the table on purpose.
func TestTokensEmptyFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "tokens")
	writeTokens(t, path, "")
	tk, err := LoadTokens(path)
	if err != nil || tk.Len() != 0 {
		t.Fatalf("an empty file at start: %v, %d tokens", err, tk.Len())
	}
	if _, _, err := tk.Reload(); err != nil {
		t.Fatalf("an empty file again, with no tokens to lose: %v", err)
	}
	writeTokens(t, path, tokA+" a\n")
	if added, _, err := tk.Reload(); err != nil || added != 1 {
		t.Fatalf("Reload: +%d %v", added, err)
	}
	ga, _ := tk.Lookup([]byte(tokA))
	writeTokens(t, path, "")
	if _, _, err := tk.Reload(); !errors.Is(err, ErrTokenFile) || !strings.Contains(err.Error(), path+": the file is empty") {
		t.Fatalf("an empty file emptying the table: %v", err)
	}
	if g, _ := tk.Lookup([]byte(tokA)); g != ga || ga.Revoked().Err() != nil {
		t.Fatal("a refused reload changed the table")
	}
	writeTokens(t, path, "# every token revoked\n")
	if _, removed, err := tk.Reload(); err != nil || removed != 1 || tk.Len() != 0 || ga.Revoked().Err() == nil {
		t.Fatalf("a file of comments only: -%d %v, %d tokens", removed, err, tk.Len())
	}
}

func TestNewToken(t *testing.T) {
	a, b := NewToken(), NewToken()
	if a == b || len(a) != 43 || !ValidToken(a) || len(a) < MinTokenLen {
		t.Fatalf("tokens %q %q", a, b)
	}
}
