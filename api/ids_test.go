package api

import (
	"errors"
	"strings"
	"testing"

	"github.com/dlock/dlock/lock"
)

// TestIDsNeverAlias: encoding/json decodes invalid UTF-8 and lone surrogate
// escapes to U+FFFD, so "a\ud800" and "a\udfff" would both name the node
// "a\uFFFD". Every parser refuses them, and the reflection-free parser
// leaves every such body to encoding/json, whose result is then validated.
func TestIDsNeverAlias(t *testing.T) {
	ids := []string{`a\ud800`, `a\udfff`, `a\udbff\udbff`, `a\ufffd`, "a\uFFFD", "a\xff", "a\xed\xa0\x80", `a\u202e`, "a\u2067", `a\u200e`}
	for _, id := range ids {
		bodies := map[string]string{
			"node_id":     `{"type":"pull","resource_id":"r","node_id":"` + id + `"}`,
			"resource_id": `{"type":"pull","resource_id":"` + id + `","node_id":"n"}`,
		}
		for field, body := range bodies {
			if _, ok := parseFast([]byte(body)); ok {
				t.Errorf("the fast path took %s %q", field, id)
			}
			_, errLock := ParseLock([]byte(body))
			_, errUnlock := ParseUnlock([]byte(body))
			_, _, errKey := ParseKey([]byte(body))
			_, errRef := ParseRef([]byte(strings.Replace(body, `"type":"pull",`, "", 1)), false)
			for name, err := range map[string]error{"ParseLock": errLock, "ParseUnlock": errUnlock, "ParseKey": errKey, "ParseRef": errRef} {
				if !errors.Is(err, lock.ErrInvalid) {
					t.Errorf("%s with %s %q: %v, want ErrInvalid", name, field, id, err)
				}
			}
		}
	}
	// Escapes that decode to valid characters are one id, as JSON says.
	a, err1 := ParseLock([]byte(`{"type":"pull","resource_id":"r","node_id":"caf\u00e9"}`))
	b, err2 := ParseLock([]byte(`{"type":"pull","resource_id":"r","node_id":"café"}`))
	if err1 != nil || err2 != nil || a.Node != b.Node {
		t.Errorf("escaped and literal é: %q %v, %q %v", a.Node, err1, b.Node, err2)
	}
}

// TestRetryAfterStatus: every 429 and 503 carries Retry-After.
func TestRetryAfterStatus(t *testing.T) {
	for _, err := range []error{lock.ErrTooManySessions, lock.ErrQueueFull, lock.ErrTooManyKeys, ErrOverloaded, ErrUnavailable, lock.ErrClosed} {
		status, _ := ErrorResponse(err)
		if got := RetryAfterStatus(status); got < 1 || got < RetryAfter(err) {
			t.Errorf("%v (%d): RetryAfterStatus %d, RetryAfter %d", err, status, got, RetryAfter(err))
		}
	}
	for _, status := range []int{200, 400, 403, 409, 413, 500} {
		if got := RetryAfterStatus(status); got != 0 {
			t.Errorf("RetryAfterStatus(%d) = %d, want 0", status, got)
		}
	}
}
