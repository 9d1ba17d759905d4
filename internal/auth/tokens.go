// Package auth is the server's view of who a client is (docs/SECURITY.md):
// bearer tokens from a token file, and node names from a verified client
// certificate. Both are re-read on demand (SIGHUP): a token table and a
// TLS configuration are swapped whole, so a request sees either the old
// or the new credentials, never a mix.
package auth

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/dlock/dlock/lock"
)

// Operator is the node name of a credential that may act as any node.
const Operator = "*"

// MinTokenLen is the shortest token a token file may hold: a token is a
// password that never has to be typed, so nothing justifies a short one.
// `dlock token new` makes 43-character tokens (32 random bytes).
const MinTokenLen = 16

// ErrTokenFile is a token file that cannot be used; the message names the
// line (never the token).
var ErrTokenFile = errors.New("token file")

// Grant is what one token of the token file allows: acting as Node, or as
// any node for the operator. A Grant stays the same object across reloads
// for as long as its token names the same node, and is revoked (Done
// closes) when a reload removes the token or gives it another node: the
// event streams it opened end then.
type Grant struct {
	// Node is the node the token may act as; Operator for any.
	Node   string
	ctx    context.Context
	revoke context.CancelFunc
}

// Operator reports whether the grant may act as any node.
func (g *Grant) Operator() bool { return g.Node == Operator }

// Revoked is a context cancelled when the token is removed by a reload.
func (g *Grant) Revoked() context.Context { return g.ctx }

// digest is a token's SHA-256. Tokens are kept and looked up by digest
// only: the lookup's timing depends on the digest of what a client sent,
// which tells it nothing about any stored token (it would have to invert
// SHA-256), so no comparison leaks a token byte by byte.
type digest [sha256.Size]byte

// table is one reading of the token file.
type table map[digest]*Grant

// Tokens is the token table of a token file, replaced whole by Reload.
type Tokens struct {
	path string
	mu   sync.Mutex // serialises Reload
	cur  atomic.Pointer[table]
}

// LoadTokens reads the token file at path (docs/SECURITY.md): lines
// "TOKEN NODE_ID", where NODE_ID "*" is an operator; blank lines and lines
// starting with '#' are skipped. Every line ends with a newline: a file
// whose last line has none is refused as half-written.
func LoadTokens(path string) (*Tokens, error) {
	t := &Tokens{path: path}
	tab, err := readTokenFile(path, nil)
	if err != nil {
		return nil, err
	}
	t.cur.Store(&tab)
	return t, nil
}

// Path is the token file's path.
func (t *Tokens) Path() string { return t.path }

// Len is the number of tokens in the table.
func (t *Tokens) Len() int { return len(*t.cur.Load()) }

// Lookup returns the grant of token; false when the table has no such
// token.
func (t *Tokens) Lookup(token []byte) (*Grant, bool) {
	g, ok := (*t.cur.Load())[sha256.Sum256(token)]
	return g, ok
}

// Reload reads the token file again and swaps the table. On an error the
// old table stays; an empty file is an error when the table has tokens
// (a comment line makes an empty table on purpose). Tokens no longer in the file, or now naming another
// node, are revoked once the new table is in place: a request that arrives
// after Reload returns is checked against the new file only.
func (t *Tokens) Reload() (added, removed int, err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	old := *t.cur.Load()
	tab, err := readTokenFile(t.path, old)
	if err != nil {
		return 0, 0, err
	}
	t.cur.Store(&tab)
	for d, g := range old {
		if tab[d] != g {
			g.revoke()
			removed++
		}
	}
	for d, g := range tab {
		if old[d] != g {
			added++
		}
	}
	return added, removed, nil
}

func readTokenFile(path string, old table) (table, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrTokenFile, err)
	}
	defer f.Close()
	return parseTokens(f, path, old)
}

// maxTokenLine bounds a token file line: a token and a node id (at most
// lock.MaxNodeLen bytes) fit many times over.
const maxTokenLine = 4096

// parseTokens reads a token file from r, reusing old's grant of a token
// that keeps its node. Errors name the file and the line, never the token.
//
// A file caught half-written (written in place, not renamed into place;
// docs/SECURITY.md) must not read as a smaller, valid file: cut inside a
// node id, "TOKEN node-10" would become "TOKEN node-1", and cut after the
// star of "*ops" an operator's token. Every writer of the format ends its
// lines with a newline (`dlock token new NODE >> file`, echo, editors), so
// a last line without one is refused, and so is an empty file that would
// revoke the tokens of old (a file of comments only is an empty table on
// purpose).
func parseTokens(r io.Reader, name string, old table) (table, error) {
	tab := table{}
	lineOf := map[digest]int{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 512), maxTokenLine)
	read, unterminated := false, false
	sc.Split(func(data []byte, atEOF bool) (int, []byte, error) {
		read = read || len(data) > 0
		adv, tok, err := bufio.ScanLines(data, atEOF)
		if atEOF && tok != nil && adv == len(data) && data[adv-1] != '\n' {
			unterminated = true
		}
		return adv, tok, err
	})
	n := 0
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w %s:%d: %s", ErrTokenFile, name, n, fmt.Sprintf(format, a...))
	}
	for sc.Scan() {
		n++
		if unterminated {
			return nil, bad("the last line does not end with a newline: written in place, or caught half-written? write it whole and rename it into place")
		}
		line := strings.TrimRight(sc.Text(), " \t\r")
		line = strings.TrimLeft(line, " \t")
		if line == "" || line[0] == '#' {
			continue
		}
		// The node id is the rest of the line: node ids may hold spaces.
		i := strings.IndexAny(line, " \t")
		if i < 0 {
			return nil, bad("want TOKEN NODE_ID, found one field")
		}
		tok, node := line[:i], strings.TrimLeft(line[i+1:], " \t")
		if !ValidToken(tok) {
			return nil, bad("the token is not a bearer token (RFC 6750: letters, digits and -._~+/, then any '=')")
		}
		if len(tok) < MinTokenLen {
			return nil, bad("the token has %d characters, at least %d are needed (`dlock token new NODE` makes one)", len(tok), MinTokenLen)
		}
		if node != Operator {
			if err := lock.ValidateNode(node); err != nil {
				return nil, bad("%v", err)
			}
		}
		d := digest(sha256.Sum256([]byte(tok)))
		if first, dup := lineOf[d]; dup {
			return nil, bad("the token of line %d again", first)
		}
		lineOf[d] = n
		if g := old[d]; g != nil && g.Node == node {
			tab[d] = g
			continue
		}
		ctx, cancel := context.WithCancel(context.Background())
		tab[d] = &Grant{Node: node, ctx: ctx, revoke: cancel}
	}
	if err := sc.Err(); err != nil {
		n++
		if errors.Is(err, bufio.ErrTooLong) {
			return nil, bad("the line is longer than %d bytes", maxTokenLine)
		}
		return nil, fmt.Errorf("%w %s: %w", ErrTokenFile, name, err)
	}
	if !read && len(old) > 0 {
		return nil, fmt.Errorf("%w %s: the file is empty, which would revoke all %d tokens: truncated, or caught half-written? write it whole and rename it into place; to revoke every token, leave a comment line in it", ErrTokenFile, name, len(old))
	}
	return tab, nil
}

// NewToken returns a fresh random token: 32 bytes from crypto/rand in
// unpadded base64url, 43 characters that are a valid bearer token.
func NewToken() string {
	var b [32]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand)
	return base64.RawURLEncoding.EncodeToString(b[:])
}
