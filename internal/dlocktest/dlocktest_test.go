package dlocktest

import (
	"net/http"
	"strings"
	"testing"
	"testing/synctest"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/lock"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestInMemoryRestart: in a bubble, a restart is a new epoch that forgot
// the holds, reached by the same HTTP client.
func TestInMemoryRestart(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := Start(t, Options{InMemory: true})
		hc := s.HTTPClient()
		post := func() string {
			t.Helper()
			resp, err := hc.Post(s.URL()+"/lock", "application/json", strings.NewReader(`{"type":"pull","resource_id":"r","node_id":"a"}`))
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("lock: %d", resp.StatusCode)
			}
			return resp.Header.Get(api.EpochHeader)
		}
		before := post()
		s.Restart()
		if st, err := s.Backend.Status(t.Context(), lock.Pull, "r", ""); err != nil || st.Held {
			t.Fatalf("after the restart: %+v %v, want the key forgotten", st, err)
		}
		if after := post(); after == before || after == "" {
			t.Fatalf("epoch %q before the restart, %q after", before, after)
		}
		s.WaitQueued(t, lock.Key{Type: lock.Pull, Resource: "r"}, 0)
	})
}
