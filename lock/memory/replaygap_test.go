package memory

import (
	"testing"
	"testing/synctest"
	"time"

	"github.com/dlock/dlock/lock"
)

// TestLostSessionGapShowsOnTheWire: a session that ended while nothing was
// numbered (its hold released with nobody waiting) and is opened again with
// a Last-Event-ID must answer a subscribed id past that id, so a client,
// which sees only ids, knows its holds are gone (docs/DESIGN.md, "Event ids
// and replay").
func TestLostSessionGapShowsOnTheWire(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemory(t, func(c *Config) { c.SessionGrace = 5 * time.Second })
		st, _, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: "a"})
		if err != nil {
			t.Fatal(err)
		}
		if res := mustLock(t, m, lockReq(lock.Pull, "r", "a")); !res.Acquired {
			t.Fatalf("lock: %+v", res)
		}
		st.Close()
		time.Sleep(6 * time.Second)
		synctest.Wait()
		if h, _ := m.Status(t.Context(), lock.Pull, "r", ""); h.Held {
			t.Fatalf("hold outlived its session: %+v", h)
		}
		// The client saw every event numbered so far (none was its own).
		last := m.seq.Load()
		st2, again, err := m.Subscribe(t.Context(), lock.SubscribeRequest{Node: "a", LastID: last, HasLast: true})
		if err != nil {
			t.Fatal(err)
		}
		defer st2.Close()
		if !again.Missed || again.ID <= last {
			t.Fatalf("reopened after the session ended: subscribed id %d missed=%v, want an id past %d", again.ID, again.Missed, last)
		}
	})
}
