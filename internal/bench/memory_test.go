package bench

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/memory"
)

// held-session: every lock is held under a session lease, by one of the
// nodes, each with its session; and the three memory measurements each
// get a server of their own.
func TestMemoryFreshServers(t *testing.T) {
	const held, nodes, sessions = 300, 7, 25
	var started, stopped []string
	start := func(context.Context) (string, func(), error) {
		// A long grace: the sessions outlive their streams, closed before
		// stop, while the test looks.
		srv := dlocktest.Start(t, dlocktest.Options{Config: func(c *memory.Config) { c.SessionGrace = time.Hour }})
		started = append(started, srv.URL())
		return srv.URL(), func() {
			stopped = append(stopped, srv.URL())
			st := srv.Memory.Stats()
			if st.SlowStreams != 0 || st.RefusedSessions != 0 || st.RefusedKeys != 0 {
				t.Errorf("streams closed as slow or requests refused: %+v", st)
			}
			if len(stopped) != 2 {
				return
			}
			if st.Held != held || st.Sessions != nodes {
				t.Errorf("held-session: %d held by %d sessions, want %d by %d", st.Held, st.Sessions, held, nodes)
			}
			holders := map[string]int{}
			for cur := ""; ; {
				p, err := srv.Memory.InspectKeys(context.Background(), lock.KeyQuery{Cursor: cur, Limit: lock.MaxInspectLimit})
				if err != nil {
					t.Fatal(err)
				}
				for _, k := range p.Keys {
					if k.Lease != lock.LeaseSession {
						t.Errorf("%v held by %s with lease %v", k.Key, k.Holder, k.Lease)
					}
					holders[k.Holder]++
				}
				if cur = p.Next; cur == "" {
					break
				}
			}
			sp, err := srv.Memory.InspectSessions(context.Background(), lock.SessionQuery{Limit: lock.MaxInspectLimit})
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range sp.Sessions {
				if s.Keys != holders[s.Node] || s.Keys < held/nodes || s.Keys > held/nodes+1 {
					t.Errorf("session of %s has %d keys, holds %d, want %d or %d", s.Node, s.Keys, holders[s.Node], held/nodes, held/nodes+1)
				}
				delete(holders, s.Node)
			}
			if len(holders) != 0 {
				t.Errorf("locks held by nodes without a session: %v", holders)
			}
		}, nil
	}
	var done []string
	rs, err := Memory(context.Background(), MemoryOptions{Held: held, HeldNodes: nodes, Sessions: sessions, Conns: 4, Start: start,
		Done: func(r Result) { done = append(done, r.Scenario) }})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"idle-sessions", "held-session", "held-ttl"}
	if len(started) != 3 || !slices.Equal(started, stopped) || len(slices.Compact(slices.Clone(started))) != 3 || !slices.Equal(done, want) {
		t.Fatalf("servers started %v, stopped %v, results %v; want one each for %v", started, stopped, done, want)
	}
	for i, r := range rs {
		n := map[string]int64{"idle-sessions": sessions, "held-session": held, "held-ttl": held}[r.Scenario]
		if r.Scenario != want[i] || r.Ops != n || r.RSSMiB <= 0 || r.EmptyRSSMiB <= 0 || r.Note == "" {
			t.Errorf("%s: %+v", want[i], r)
		}
	}
	// --held 0 and --sessions 0 leave their measurements out.
	started, stopped = nil, nil
	rs, err = Memory(context.Background(), MemoryOptions{Sessions: 5, Conns: 2, Start: start})
	if err != nil || len(rs) != 1 || rs[0].Scenario != "idle-sessions" || len(started) != 1 {
		t.Fatalf("sessions only: %+v %v (%d servers)", rs, err, len(started))
	}
}
