package memory

import (
	"cmp"
	"fmt"
	"sync/atomic"
	"time"
)

// Fencing tokens (docs/DESIGN.md, "Fencing tokens").
//
// A grant's token is max(the key's previous token + 1, the token clock),
// where the token clock is the manager's monotonic clock in Unix
// microseconds. A key granted more than once per microsecond runs ahead of
// the clock; what bounds it is what makes tokens go forward across restarts:
//
//   - Without a CeilingStore, the lead: no token is issued more than the
//     lead ahead of the clock; a key that far ahead waits for the clock to
//     tick (at most a microsecond, see waitClock). A new manager waits
//     startWait and starts every key at its clock + lead - startWait, above
//     anything a manager that stopped before it issued, as long as the wall
//     clock did not step back.
//   - With a CeilingStore, the ceiling: a bound kept durable ahead of every
//     token (clock + lead + window, rewritten every period; and, for a key
//     running ahead of that, its token + window, asked for when the key is
//     half a window below the ceiling), written by one goroutine, never under
//     a shard mutex. A token may pass the lead up to the stored ceiling. A
//     new manager starts every key above the stored ceiling too, so a
//     restart, however fast and whatever the wall clock did, never goes back.
//
// A key forgotten while the manager runs (maybeDrop) leaves its last token in
// its shard's floor, which every new key of the shard starts from.
//
// If the store fails, keepCeiling retries; tokens within the lead stay safe
// by the clock. A key that reaches the stored ceiling before it moves (only
// a key granted faster than once per microsecond, in process, while the
// store has stalled for the second or more it takes to run half a window
// ahead) is granted above it rather than stall its shard, and the log says
// so: until the next store lands, a restart could repeat those tokens.
const (
	defaultTokenLead = time.Minute
	startWait        = 2 * time.Millisecond
	ceilingPeriod    = 5 * time.Second
	ceilingWindow    = 2 * ceilingPeriod
	ceilingRetry     = 500 * time.Millisecond
)

// CeilingStore keeps the fencing-token ceiling durable, so that tokens never
// go back across a restart (Config.TokenCeiling). The manager calls it from
// New and from one goroutine of its own, never under a shard mutex.
type CeilingStore interface {
	// LoadCeiling returns the last ceiling stored, or 0 if none ever was.
	// A store it cannot read must return an error, not 0.
	LoadCeiling() (uint64, error)
	// StoreCeiling durably records c (c only grows). It returns once c would
	// survive a crash.
	StoreCeiling(c uint64) error
}

// tokenClock is the manager's part of the token rule.
type tokenClock struct {
	lead    uint64 // µs a token may run ahead of the clock (beyond the ceiling)
	window  uint64 // µs the ceiling is stored ahead
	store   CeilingStore
	ceiling atomic.Uint64 // the stored ceiling; 0 without a store
	want    atomic.Uint64 // highest token a grant asked the ceiling to cover
	above   atomic.Uint64 // highest token granted above the stored ceiling
	kick    chan struct{} // asks keepCeiling to store now
	stop    chan struct{}
	done    chan struct{}
}

// startTokens sets the manager's clock origin and the floor every key starts
// from, and stores the first ceiling. It runs before any grant.
func (m *Backend) startTokens() (floor uint64, err error) {
	k := &m.tok
	lead := m.cfg.tokenLead
	if lead <= 0 {
		lead = defaultTokenLead
	}
	lead = max(lead, 2*startWait)
	k.lead = uint64(lead / time.Microsecond)
	k.window = uint64(cmp.Or(m.cfg.tokenWindow, ceilingWindow) / time.Microsecond)
	k.store = m.cfg.TokenCeiling
	var prev uint64
	if k.store != nil {
		if prev, err = k.store.LoadCeiling(); err != nil {
			return 0, fmt.Errorf("lock: loading the token ceiling: %w", err)
		}
	}
	// A manager that stopped before this one issued no token above its
	// clock at its end plus the lead, or above its last stored ceiling.
	// Wait startWait, so that this one's clock + lead - startWait is above
	// the first.
	end := uint64(time.Now().UnixMicro()) + uint64(startWait/time.Microsecond)
	for d := startWait; uint64(time.Now().UnixMicro()) <= end; d = time.Microsecond {
		time.Sleep(d)
	}
	m.start = time.Now()
	m.startUS = uint64(m.start.UnixMicro())
	floor = max(m.startUS+k.lead-uint64(startWait/time.Microsecond), prev+1)
	if k.store != nil {
		k.want.Store(floor)
		if err := m.storeCeiling(); err != nil {
			return 0, err
		}
	}
	return floor, nil
}

// storeCeiling stores a ceiling a window above the clock + lead and above
// every token a grant asked to cover.
func (m *Backend) storeCeiling() error {
	k := &m.tok
	c := max(m.micros(m.now())+k.lead, k.want.Load(), k.above.Load()) + k.window
	if c <= k.ceiling.Load() {
		return nil
	}
	if err := k.store.StoreCeiling(c); err != nil {
		return fmt.Errorf("lock: storing the token ceiling: %w", err)
	}
	k.ceiling.Store(c)
	return nil
}

// keepTokens starts keepCeiling, the last step of New.
func (m *Backend) keepTokens() {
	if k := &m.tok; k.store != nil {
		k.kick = make(chan struct{}, 1)
		k.stop, k.done = make(chan struct{}), make(chan struct{})
		go m.keepCeiling()
	}
}

// keepCeiling moves the ceiling ahead every period, and when a grant asks,
// until Close. A store that fails is retried every ceilingRetry.
func (m *Backend) keepCeiling() {
	k := &m.tok
	defer close(k.done)
	t := time.NewTimer(ceilingPeriod)
	defer t.Stop()
	failing, exposed, reported := false, false, uint64(0)
	for {
		select {
		case <-k.stop:
			return
		case <-t.C:
		case <-k.kick:
		}
		err := m.storeCeiling()
		if a := k.above.Load(); a > reported {
			reported = a
			m.log.Error("tokens granted above the stored token ceiling: a key ran ahead faster than the ceiling was stored",
				"token", a, "ceiling", k.ceiling.Load(), "stored_now", err == nil)
		}
		switch {
		case err != nil:
			// Logged when it starts failing and when tokens within the lead
			// may pass the ceiling, not every retry.
			now := m.micros(m.now())+k.lead > k.ceiling.Load()
			if !failing || now != exposed {
				m.log.Error("token ceiling not stored: retrying", "err", err, "ceiling", k.ceiling.Load(),
					"tokens_rest_on_clock", now)
			}
			failing, exposed = true, now
			t.Reset(ceilingRetry)
			continue
		case failing:
			m.log.Info("token ceiling stored again", "ceiling", k.ceiling.Load())
			failing, exposed = false, false
		}
		t.Reset(ceilingPeriod)
	}
}

func (m *Backend) stopTokens() {
	if k := &m.tok; k.stop != nil {
		close(k.stop)
		<-k.done
	}
}

// nextToken is the token of ks's next grant. Called under the shard mutex.
func (s *shard) nextToken(ks *keyState, now mono) uint64 {
	m := s.m
	clock := m.micros(now)
	token := max(ks.lastToken+1, clock)
	if token > clock+m.tok.lead {
		m.tokenAhead(token)
	}
	return token
}

// tokenAhead bounds a token more than the lead ahead of the clock.
func (m *Backend) tokenAhead(token uint64) {
	k := &m.tok
	if k.store == nil {
		m.waitClock(token - k.lead)
		return
	}
	c := k.ceiling.Load()
	if token+k.window/2 > c {
		atomicMax(&k.want, token)
		select {
		case k.kick <- struct{}{}:
		default:
		}
	}
	if token > c {
		atomicMax(&k.above, token)
	}
}

func atomicMax(a *atomic.Uint64, v uint64) {
	for {
		old := a.Load()
		if v <= old || a.CompareAndSwap(old, v) {
			return
		}
	}
}

// waitClock spins until the token clock reaches us. It runs under a shard
// mutex, which is safe because it is short by construction: without a
// store, every token is at most the lead ahead of the clock when issued, so
// a key's next token is at most one microsecond past what the lead allows. Only a key granted
// faster than once per microsecond for a whole lead ever gets here. (Under
// testing/synctest the clock stands still while goroutines run: a test must
// not grant one key more than startWait/1µs = 2000 times in one instant.)
func (m *Backend) waitClock(us uint64) {
	for m.micros(m.now()) < us {
	}
}

// forgetToken keeps the last token of a key the shard forgets, so that the
// key, made again, goes on above it. Called under the shard mutex.
func (s *shard) forgetToken(ks *keyState) {
	s.tokenFloor = max(s.tokenFloor, ks.lastToken)
}
