package main

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/lock"
)

// TestServeTooManyTypes: a dlock serve process of its own, whose table of
// type names nothing else fills, takes lock.MaxExtraTypes names besides the
// three from its callers and answers the next 400 too_many_types, without
// Retry-After; every name it took, and the three, still work
// (docs/DESIGN.md, "Other types").
func TestServeTooManyTypes(t *testing.T) {
	p := startServe(t)
	lockAs := func(typ string) (int, string, http.Header) {
		t.Helper()
		body := fmt.Sprintf(`{"type":%q,"resource_id":"r","node_id":"n"}`, typ)
		resp, err := http.Post("http://"+p.addr+"/lock", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b), resp.Header
	}
	for i := range lock.MaxExtraTypes {
		if st, body, _ := lockAs(fmt.Sprintf("layer-%d", i)); st != http.StatusOK {
			t.Fatalf("type %d: %d %s", i, st, body)
		}
	}
	st, body, h := lockAs("one-too-many")
	if st != http.StatusBadRequest || !strings.Contains(body, `"code":"`+api.CodeTooManyTypes+`"`) || h.Get("Retry-After") != "" {
		t.Fatalf("name %d: %d %s (Retry-After %q), want 400 too_many_types without Retry-After", lock.MaxExtraTypes+1, st, body, h.Get("Retry-After"))
	}
	for _, typ := range []string{"layer-0", fmt.Sprintf("layer-%d", lock.MaxExtraTypes-1), "pull", "update", "delete"} {
		if st, body, _ := lockAs(typ); st != http.StatusOK || !strings.Contains(body, `"holder":"n"`) {
			t.Fatalf("%s after the bound: %d %s", typ, st, body)
		}
	}
	if st, body, _ := lockAs("one-too-many"); st != http.StatusBadRequest {
		t.Fatalf("the refused name again: %d %s, want it refused still", st, body)
	}
	resp, err := http.Get("http://" + p.addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	metrics, _ := io.ReadAll(resp.Body)
	if want := `dlock_limit_refusals_total{limit="types"} 2`; !strings.Contains(string(metrics), want+"\n") {
		t.Fatalf("/metrics has no %s", want)
	}
}
