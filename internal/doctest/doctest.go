// Package doctest reads the fenced blocks of the project's Markdown pages,
// so that tests can run every command a page shows as written
// (docs/DEVELOPMENT.md, "Commands in the docs").
//
// A shell block (sh, bash, console) is preceded by a marker naming the test
// that runs it:
//
//	<!-- run: DIR TEST -->
//
// where DIR is the package directory, from the repository's root, whose
// TEST runs the block. TestEveryCommandIsRun (this package) holds every
// page to that.
package doctest

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"regexp"
	"strings"
)

// A Block is one fenced block of a page.
type Block struct {
	File    string // the page, as given to Read
	Line    int    // the line of the opening fence, from 1
	Lang    string // the fence's info string: "sh", "console", "" …
	Section string // the nearest heading above the block, without its #s
	Dir     string // from the marker: the package directory that runs it
	Test    string // from the marker: the test that runs it
	Text    string // the lines between the fences, each ending in "\n"
}

// Shell says whether the block shows commands to type.
func (b Block) Shell() bool {
	switch b.Lang {
	case "sh", "bash", "shell", "console":
		return true
	}
	return false
}

func (b Block) String() string { return fmt.Sprintf("%s:%d (%q)", b.File, b.Line, b.Section) }

var marker = regexp.MustCompile(`^<!-- run: (\S+) (Test\w*) -->$`)

// Read returns the fenced blocks of the Markdown page at path, in order. A
// marker applies to the block whose fence is on the next line.
func Read(path string) ([]Block, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return Parse(path, data)
}

// Parse is Read of a page's bytes.
func Parse(path string, data []byte) ([]Block, error) {
	var (
		blocks  []Block
		cur     *Block
		fence   string
		section string
		prev    string
		text    strings.Builder
	)
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if cur != nil {
			if strings.TrimSpace(line) == fence {
				cur.Text = text.String()
				blocks = append(blocks, *cur)
				cur = nil
				prev = line
				continue
			}
			text.WriteString(line)
			text.WriteByte('\n')
			continue
		}
		if f, lang, ok := opening(line); ok {
			cur = &Block{File: path, Line: n, Lang: lang, Section: section}
			fence = f
			text.Reset()
			if m := marker.FindStringSubmatch(strings.TrimSpace(prev)); m != nil {
				cur.Dir, cur.Test = m[1], m[2]
			}
			prev = line
			continue
		}
		if h, ok := strings.CutPrefix(line, "#"); ok {
			section = strings.TrimSpace(strings.TrimLeft(h, "#"))
		}
		if strings.HasPrefix(strings.TrimSpace(line), "<!-- run:") && marker.FindString(strings.TrimSpace(line)) == "" {
			return nil, fmt.Errorf("%s:%d: a marker must read <!-- run: DIR TEST -->: %q", path, n, line)
		}
		prev = line
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if cur != nil {
		return nil, fmt.Errorf("%s:%d: a fenced block is not closed", path, cur.Line)
	}
	return blocks, nil
}

// opening recognises a fence that opens a block (``` or ~~~, three or
// more), with its info string's first word.
func opening(line string) (fence, lang string, ok bool) {
	t := strings.TrimLeft(line, " ")
	if len(line)-len(t) > 3 {
		return "", "", false
	}
	for _, c := range []byte{'`', '~'} {
		i := 0
		for i < len(t) && t[i] == c {
			i++
		}
		if i >= 3 {
			info := strings.Fields(t[i:])
			if len(info) > 0 {
				lang = info[0]
			}
			return t[:i], lang, true
		}
	}
	return "", "", false
}

// A Step is one command of a console block and the output shown after it.
type Step struct {
	Line int    // the command's line in the page
	Cmd  string // without the "$ " prompt; continuation lines joined
	Out  string // the lines after it up to the next prompt, each ending in "\n"
}

// Steps splits a console block into its commands and their outputs. A
// command line ending in a backslash continues on the next line.
func (b Block) Steps() []Step {
	var steps []Step
	lines := strings.SplitAfter(b.Text, "\n")
	for i := 0; i < len(lines); i++ {
		l := strings.TrimSuffix(lines[i], "\n")
		if c, ok := strings.CutPrefix(l, "$ "); ok {
			s := Step{Line: b.Line + 1 + i, Cmd: c}
			for strings.HasSuffix(s.Cmd, "\\") && i+1 < len(lines) {
				i++
				s.Cmd += "\n" + strings.TrimSuffix(lines[i], "\n")
			}
			steps = append(steps, s)
			continue
		}
		if len(steps) > 0 && lines[i] != "" {
			steps[len(steps)-1].Out += lines[i]
		}
	}
	return steps
}

// Marked returns the shell blocks of the blocks that name test as their
// runner, in order.
func Marked(blocks []Block, test string) []Block {
	var out []Block
	for _, b := range blocks {
		if b.Shell() && b.Test == test {
			out = append(out, b)
		}
	}
	return out
}
