package lock

import (
	"strings"
	"testing"
	"unicode/utf8"
)

// Tests of the limits of docs/SECURITY.md: identifiers, error texts, replay
// logs, sessions, queues, keys, and the cost of a mass session loss.

func TestTruncateError(t *testing.T) {
	cases := []struct {
		name, in string
		cut      bool
	}{
		{"empty", "", false},
		{"short", "disk full", false},
		{"exactly the limit", strings.Repeat("x", MaxErrorLen), false},
		{"one byte over", strings.Repeat("x", MaxErrorLen+1), true},
		{"two-byte characters", strings.Repeat("é", 40000), true},
		{"four-byte characters", strings.Repeat("🔒", 1000), true},
		{"invalid UTF-8", "bad \xff\xfe byte", false},
		{"long and invalid", strings.Repeat("\xff\x41", 2000), true},
	}
	for _, c := range cases {
		got, cut := TruncateError(c.in)
		if cut != c.cut || len(got) > MaxErrorLen || !utf8.ValidString(got) {
			t.Errorf("%s: got %d bytes, cut=%v, valid=%v; want at most %d valid bytes, cut=%v", c.name, len(got), cut, utf8.ValidString(got), MaxErrorLen, c.cut)
			continue
		}
		if !cut {
			if utf8.ValidString(c.in) && got != c.in {
				t.Errorf("%s: changed to %q", c.name, got)
			}
			continue
		}
		head, ok := strings.CutSuffix(got, "…")
		if !ok || len(got) < MaxErrorLen-3 {
			t.Errorf("%s: %d bytes ending %q, want about %d ending with …", c.name, len(got), got[max(0, len(got)-6):], MaxErrorLen)
		}
		if utf8.ValidString(c.in) && !strings.HasPrefix(c.in, head) {
			t.Errorf("%s: the kept part is not a prefix of the text", c.name)
		}
	}
}
