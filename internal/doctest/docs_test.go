package doctest

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"unicode"
)

// root is the repository's root, from this package's directory.
const root = "../.."

// pages are the Markdown pages whose commands must be run: the README and
// every page of docs/. deploy/README.md is held by the deploy module's own
// tests, which run each of its blocks (deploy/readme_test.go).
func pages(t *testing.T) []string {
	t.Helper()
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	out := []string{"README.md"}
	for _, d := range docs {
		rel, err := filepath.Rel(root, d)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, rel)
	}
	return out
}

// TestEveryCommandIsRun holds every shell block of README.md and docs/ to a
// marker that names the test running it, and that test to exist and to
// read the page.
func TestEveryCommandIsRun(t *testing.T) {
	n := 0
	for _, page := range pages(t) {
		blocks, err := Read(filepath.Join(root, page))
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range blocks {
			if !b.Shell() {
				continue
			}
			n++
			where := page + ":" + strconv.Itoa(b.Line)
			if b.Test == "" {
				t.Errorf("%s: a %s block with no <!-- run: DIR TEST --> marker above it: which test runs it?", where, b.Lang)
				continue
			}
			if err := runs(b.Dir, b.Test, page); err != "" {
				t.Errorf("%s: marker %s %s: %s", where, b.Dir, b.Test, err)
			}
		}
	}
	if n == 0 {
		t.Fatal("no shell block in any page: the pages were not found")
	}
}

// runs checks that dir has a test file defining test and naming page.
func runs(dir, test, page string) string {
	files, _ := filepath.Glob(filepath.Join(root, dir, "*_test.go"))
	if len(files) == 0 {
		return "no test files in " + dir
	}
	defined, named := false, false
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return err.Error()
		}
		s := string(b)
		if strings.Contains(s, "func "+test+"(t *testing.T)") {
			defined = true
		}
		// The page is named relative to the root or to dir.
		rel, _ := filepath.Rel(dir, page)
		if strings.Contains(s, `"`+page+`"`) || strings.Contains(s, `"`+filepath.ToSlash(rel)+`"`) {
			named = true
		}
	}
	switch {
	case !defined:
		return "no func " + test + " in " + dir
	case !named:
		return "no test file of " + dir + " names " + page + " as a string: does " + test + " read it?"
	}
	return ""
}

var link = regexp.MustCompile(`\]\(([^)\s]+)\)`)

// TestLinks checks every relative link of the pages: the file exists, and
// an anchor names one of its headings.
func TestLinks(t *testing.T) {
	all := append(pages(t), "deploy/README.md")
	for _, page := range all {
		data, err := os.ReadFile(filepath.Join(root, page))
		if err != nil {
			t.Fatal(err)
		}
		blocks, err := Parse(page, data)
		if err != nil {
			t.Fatal(err)
		}
		text := outsideBlocks(string(data), blocks)
		for _, m := range link.FindAllStringSubmatch(text, -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			file, anchor, _ := strings.Cut(target, "#")
			path := filepath.Join(root, page)
			if file != "" {
				path = filepath.Join(root, filepath.Dir(page), file)
			}
			if _, err := os.Stat(path); err != nil {
				t.Errorf("%s: link %q: %v", page, target, err)
				continue
			}
			if anchor == "" || !strings.HasSuffix(path, ".md") {
				continue
			}
			b, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if !headings(string(b))[anchor] {
				t.Errorf("%s: link %q: no heading of %s has the anchor #%s", page, target, file, anchor)
			}
		}
	}
}

// outsideBlocks blanks the fenced blocks of a page, whose text is not
// Markdown.
func outsideBlocks(text string, blocks []Block) string {
	lines := strings.Split(text, "\n")
	for _, b := range blocks {
		n := strings.Count(b.Text, "\n")
		for i := b.Line - 1; i <= b.Line+n && i < len(lines); i++ {
			lines[i] = ""
		}
	}
	return strings.Join(lines, "\n")
}

// headings returns the anchors of a page's headings, as GitHub makes them.
func headings(text string) map[string]bool {
	out := map[string]bool{}
	seen := map[string]int{}
	blocks, _ := Parse("", []byte(text))
	for _, l := range strings.Split(outsideBlocks(text, blocks), "\n") {
		h, ok := strings.CutPrefix(l, "#")
		if !ok {
			continue
		}
		s := slug(strings.TrimSpace(strings.TrimLeft(h, "#")))
		if k := seen[s]; k > 0 {
			out[s+"-"+strconv.Itoa(k)] = true
		} else {
			out[s] = true
		}
		seen[s]++
	}
	return out
}

// slug is GitHub's anchor of a heading: lower case, punctuation dropped
// (hyphens and underscores kept), spaces made hyphens.
func slug(h string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(h) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}
