package memory

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/dlock/dlock/internal/datadir"
	"github.com/dlock/dlock/lock"
)

// grantLoop grants and releases key (pull, r) n times as fast as it can,
// with a failure so that nothing is retained or skipped, and checks that
// every token is above the last and at most the lead ahead of the clock, or,
// with a ceiling store, at most the stored ceiling.
func grantLoop(t *testing.T, m *Backend, last uint64, n int) uint64 {
	t.Helper()
	for i := range n {
		r := mustLock(t, m, lockReq(lock.Pull, "r", "a"))
		if r.Token <= last {
			t.Fatalf("grant %d: token %d after %d", i, r.Token, last)
		}
		if c := m.tok.ceiling.Load(); m.tok.store != nil && r.Token > c {
			t.Fatalf("grant %d: token %d above the stored ceiling %d", i, r.Token, c)
		}
		if ahead := int64(r.Token) - int64(m.micros(m.now())); m.tok.store == nil && ahead > int64(m.tok.lead) {
			t.Fatalf("grant %d: token %d is %dµs ahead of the clock, lead is %dµs", i, r.Token, ahead, m.tok.lead)
		}
		last = r.Token
		mustUnlock(t, m, lock.Pull, "r", "a", false)
	}
	return last
}

func openCeiling(t *testing.T, dir string) *datadir.CeilingFile {
	t.Helper()
	d, err := datadir.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d.TokenCeiling()
}

// TestTokensRestartDataDir restarts a manager on the same data dir at once,
// the way a crashed server comes back, after a burst that runs the key ahead
// of the clock: tokens never go back.
func TestTokensRestartDataDir(t *testing.T) {
	store := openCeiling(t, t.TempDir())
	var last uint64
	for range 5 {
		m := newMemory(t, func(c *Config) { c.TokenCeiling = store })
		last = grantLoop(t, m, last, 50)
		c, err := store.LoadCeiling()
		if err != nil || c < last {
			t.Fatalf("stored ceiling %d (%v) below the last token %d", c, err, last)
		}
		m.Close()
	}
}

// TestTokensRestartClock is the same without a data dir: the clock and the
// lead keep tokens going forward while the wall clock does.
func TestTokensRestartClock(t *testing.T) {
	var last uint64
	for range 5 {
		m := newMemory(t, nil)
		last = grantLoop(t, m, last, 50)
		m.Close()
	}
}

// TestTokensHotKey grants one key in a tight loop with a short lead, so the
// key runs into the lead and waits for the clock, then restarts with and
// without a data dir.
func TestTokensHotKey(t *testing.T) {
	for _, withStore := range []bool{false, true} {
		var store CeilingStore
		if withStore {
			store = openCeiling(t, t.TempDir())
		}
		var last uint64
		for range 2 {
			m := newMemory(t, func(c *Config) { c.tokenLead = 2 * startWait; c.TokenCeiling = store })
			last = grantLoop(t, m, last, 10000)
			m.Close()
		}
	}
}

// TestTokensLead runs one key's tokens ahead of the clock as fast as the
// shard can issue them, until the lead stops them: no token is ever more
// than the lead ahead, and each still goes up.
func TestTokensLead(t *testing.T) {
	m := newMemory(t, func(c *Config) { c.tokenLead = 2 * startWait })
	s := m.shards[0]
	ks := &keyState{lastToken: s.tokenFloor}
	s.mu.Lock()
	defer s.mu.Unlock()
	capped := 0
	for i := 0; capped < 1000; i++ {
		if i == 1e6 {
			t.Fatal("a million tokens did not reach the lead")
		}
		token := s.nextToken(ks, m.now())
		clock := m.micros(m.now())
		if token <= ks.lastToken || token > clock+m.tok.lead {
			t.Fatalf("token %d after %d, clock %d, lead %d", token, ks.lastToken, clock, m.tok.lead)
		}
		if token+1 > clock+m.tok.lead {
			capped++ // the next one waits for the clock
		}
		ks.lastToken = token
	}
}

// TestTokensForgottenKey: a key forgotten as soon as it is released (no
// completion records) and made again still never repeats a token, even
// when it is granted faster than the clock ticks. Several goroutines, one
// per key, share a shard.
func TestTokensForgottenKey(t *testing.T) {
	m := newMemory(t, func(c *Config) { c.CompletedRetention = 0; c.Shards = 1 })
	var wg sync.WaitGroup
	for _, res := range []string{"r1", "r2", "r3"} {
		wg.Go(func() {
			var last uint64
			for range 5000 {
				r, err := m.TryLock(context.Background(), lockReq(lock.Pull, res, "a"))
				if err != nil || r.Token <= last {
					t.Errorf("%s: token %d after %d (%v)", res, r.Token, last, err)
					return
				}
				last = r.Token
				if _, err := m.Unlock(context.Background(), lock.UnlockRequest{Type: lock.Pull, Resource: res, Node: "a", Success: true}); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if n := m.Stats().Keys; n != 0 {
		t.Fatalf("%d keys kept, want every key forgotten", n)
	}
}

// TestTokensCeilingAhead: a stored ceiling far above the clock (a restart
// right after a long burst, or a wall clock set back) moves the first token
// above it, and grants in one instant do not wait on the lead.
func TestTokensCeilingAhead(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		last := uint64(time.Now().Add(time.Hour).UnixMicro())
		store := &memCeiling{c: last}
		m := newMemory(t, func(c *Config) { c.TokenCeiling = store })
		for range 100 {
			r := mustLock(t, m, lockReq(lock.Pull, "r", "a"))
			if r.Token <= last {
				t.Fatalf("token %d not above %d", r.Token, last)
			}
			last = r.Token
			mustUnlock(t, m, lock.Pull, "r", "a", false)
		}
		if c := store.load(); c < last+uint64(ceilingPeriod/time.Microsecond) {
			t.Fatalf("ceiling %d less than a period above the last token %d", c, last)
		}
	})
}

// TestTokensCeilingKept: the ceiling moves ahead every period, stays above
// every token, and a store that fails for a while is retried until it works.
func TestTokensCeilingKept(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := &memCeiling{}
		m := newMemory(t, func(c *Config) { c.TokenCeiling = store })
		first := store.load()
		if first == 0 {
			t.Fatal("no ceiling stored by New")
		}
		check := func() {
			t.Helper()
			r := mustLock(t, m, lockReq(lock.Pull, "r", "a"))
			mustUnlock(t, m, lock.Pull, "r", "a", false)
			if c := store.load(); r.Token >= c {
				t.Fatalf("token %d at or above the stored ceiling %d", r.Token, c)
			}
		}
		check()
		time.Sleep(ceilingPeriod)
		synctest.Wait()
		if c := store.load(); c != first+uint64(ceilingPeriod/time.Microsecond) {
			t.Fatalf("ceiling %d after a period, want %d", c, first+uint64(ceilingPeriod/time.Microsecond))
		}
		check()
		store.fail(true)
		time.Sleep(ceilingPeriod + 3*ceilingRetry)
		synctest.Wait()
		if n := store.failures(); n != 4 {
			t.Fatalf("%d failed stores, want 4 (one, then a retry every %v)", n, ceilingRetry)
		}
		check()
		store.fail(false)
		time.Sleep(ceilingRetry)
		synctest.Wait()
		if c := store.load(); c != first+uint64((2*ceilingPeriod+4*ceilingRetry)/time.Microsecond) {
			t.Fatalf("ceiling %d after the store works again", c)
		}
		check()
	})
}

// TestTokensCeilingFollowsHotKey: a key running ahead of the clock asks for
// the ceiling to move ahead of it before it gets there; while the store is
// failing it is granted above the ceiling rather than wait, and the next
// store covers what it was granted.
func TestTokensCeilingFollowsHotKey(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := &memCeiling{}
		m := newMemory(t, func(c *Config) {
			c.TokenCeiling = store
			c.tokenLead, c.tokenWindow = 2*startWait, time.Millisecond
		})
		first := store.load()
		grant := func() uint64 {
			mustLock(t, m, lockReq(lock.Pull, "r", "a"))
			mustLock(t, m, lockReq(lock.Pull, "r", "b"))
			mustUnlock(t, m, lock.Pull, "r", "a", false) // hand-off to b
			mustUnlock(t, m, lock.Pull, "r", "b", false)
			return status(t, m, lock.Pull, "r", "").Token
		}
		var last uint64
		for range 3000 { // 6000 grants in one instant: 4000 past the lead
			last = grant()
			synctest.Wait()
			if c := store.load(); last > c {
				t.Fatalf("token %d above the stored ceiling %d", last, c)
			}
		}
		if c := store.load(); c <= first || m.tok.above.Load() != 0 {
			t.Fatalf("ceiling %d did not follow the key (first %d, token %d)", c, first, last)
		}
		store.fail(true)
		for range 1000 {
			last = grant()
		}
		if c := store.load(); last <= c || m.tok.above.Load() != last {
			t.Fatalf("a failing store: token %d, ceiling %d, above %d", last, c, m.tok.above.Load())
		}
		store.fail(false)
		time.Sleep(ceilingRetry)
		synctest.Wait()
		if c := store.load(); c <= last {
			t.Fatalf("ceiling %d after the store works again, token %d", c, last)
		}
	})
}

// TestTokensCeilingErrors: a ceiling that cannot be read or stored stops New.
func TestTokensCeilingErrors(t *testing.T) {
	cfg := DefaultConfig()
	cfg.TokenCeiling = &memCeiling{failing: true}
	if _, err := New(t.Context(), cfg); !errors.Is(err, errStore) {
		t.Fatalf("New with a store that cannot store: %v", err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "token-ceiling"), []byte("dlock-token-ceiling/1 12345 00000000\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg.TokenCeiling = openCeiling(t, dir)
	if _, err := New(t.Context(), cfg); !errors.Is(err, datadir.ErrCorrupt) {
		t.Fatalf("New with a corrupt ceiling file: %v", err)
	}
}

var errStore = errors.New("disk on fire")

// memCeiling is a CeilingStore in memory that can be told to fail.
type memCeiling struct {
	mu      sync.Mutex
	c       uint64
	failing bool
	nfail   int
}

func (s *memCeiling) LoadCeiling() (uint64, error) { return s.load(), nil }

func (s *memCeiling) StoreCeiling(c uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.failing {
		s.nfail++
		return errStore
	}
	s.c = c
	return nil
}

func (s *memCeiling) load() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.c
}

func (s *memCeiling) fail(on bool) {
	s.mu.Lock()
	s.failing = on
	s.mu.Unlock()
}

func (s *memCeiling) failures() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.nfail
}
