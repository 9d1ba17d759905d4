package main

import (
	"io"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestParse(t *testing.T) {
	env := map[string]string{"DLOCK_CONTENT_ROOT": "/shared", "DLOCK_CONTENT_NODE": "n7", "DLOCK_CONTENT_SERVER": "http://10.0.0.5:7380"}
	c, err := parse([]string{"--node", "n1"}, func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.root != "/shared" || c.node != "n1" || c.server != "http://10.0.0.5:7380" {
		t.Fatalf("got %+v: the environment fills unset flags, the command line wins", c)
	}
	if _, err := parse(nil, func(string) string { return "" }, io.Discard); err == nil || !strings.Contains(err.Error(), "--root") {
		t.Fatalf("no root: %v", err)
	}
	if _, err := parse(nil, func(k string) string {
		return map[string]string{"DLOCK_CONTENT_LOG_LEVEL": "loud", "DLOCK_CONTENT_ROOT": "/r"}[k]
	}, io.Discard); err == nil || !strings.Contains(err.Error(), "DLOCK_CONTENT_LOG_LEVEL") {
		t.Fatalf("bad log level: %v", err)
	}
}

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("net/http.(*conn).closeWriteAndWait"))
}
