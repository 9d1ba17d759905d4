package main

import (
	"io"
	"strings"
	"testing"
)

// TestParseServeLimits: the lock manager's limits are flags with
// environment fallbacks and documented defaults.
func TestParseServeLimits(t *testing.T) {
	d, err := parseServe(nil, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if l := d.rules; l.MaxSessions != 100000 || l.MaxSessionsPerNode != 16 || l.MaxQueue != 100000 || l.MaxKeys != 1000000 || l.SessionLogBytes != 1<<20 {
		t.Errorf("defaults: sessions %d, per node %d, queue %d, keys %d, log bytes %d", l.MaxSessions, l.MaxSessionsPerNode, l.MaxQueue, l.MaxKeys, l.SessionLogBytes)
	}
	env := map[string]string{
		"DLOCK_MAX_SESSIONS":          "10",
		"DLOCK_MAX_SESSIONS_PER_NODE": "2",
		"DLOCK_MAX_QUEUE":             "3",
		"DLOCK_MAX_KEYS":              "4",
		"DLOCK_SESSION_LOG_BYTES":     "65536",
	}
	c, err := parseServe([]string{"--max-queue", "30"}, func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if l := c.rules; l.MaxSessions != 10 || l.MaxSessionsPerNode != 2 || l.MaxQueue != 30 || l.MaxKeys != 4 || l.SessionLogBytes != 65536 {
		t.Errorf("environment (and the flag over it): %+v", l)
	}
	for _, args := range [][]string{{"--max-sessions", "-1"}, {"--max-keys", "-5"}, {"--session-log-bytes", "100"}} {
		if _, err := parseServe(args, func(string) string { return "" }, io.Discard); err == nil || !strings.Contains(err.Error(), strings.ReplaceAll(strings.TrimPrefix(args[0], "--"), "-", " ")) {
			t.Errorf("parseServe(%v) = %v, want an error naming the setting", args, err)
		}
	}
}
