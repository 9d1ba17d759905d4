// Package locktest is the conformance suite every lock.Backend passes: the
// rules of docs/DESIGN.md (who holds a key, who waits, what a success or a
// failure tells the waiters, which lease ends what, which reference refuses
// a delete, what a reconnecting stream replays), checked through the
// lock.Backend interface alone, so that the in-memory backend and the etcd
// backend are held to the same rules by the same tests. It is modelled on
// containerd's content testsuite: a backend's test is one call.
//
//	func TestConformance(t *testing.T) {
//		locktest.Run(t, func(t *testing.T, cfg locktest.Config) lock.Backend {
//			b, err := mybackend.New(t.Context(), mybackend.Config{Rules: cfg.Rules})
//			if err != nil {
//				t.Fatal(err)
//			}
//			return b
//		})
//	}
//
// # What Run checks
//
// Run runs named subtests in groups; `go test -run 'TestConformance/Leases/'`
// runs one group, and `-v` lists every subtest and every skip.
//
//   - Rules: TryLock (grant, re-lock, queue positions, no duplicate entry,
//     skip_recent), Unlock (success clears the queue for pull and delete,
//     hands off for update and on failure; not_holder before stale_token;
//     replayed unlocks), Cancel, completion records (completed_max,
//     completed_retention), fencing tokens strictly increasing per key and
//     across a restart, validation, Info, Close.
//   - Leases: ttl expiry and renewal by TryLock and Status, claim timeout,
//     max hold, session loss after the grace, a session lease without a
//     stream, hundreds of sessions lost at once.
//   - LockDelay: a hold ended by a ttl expiry or a lost session leaves its
//     key free but reserved for Rules.LockDelay (told at once, handed on
//     not a millisecond before the delay's end and right at it), a
//     newcomer queued behind the waiters, a key without waiters reserved
//     too, multi-node download off refusing with ErrLockHeld and no
//     holder, no delay after an unlock, a cancel, a claim timeout or max
//     hold, and none with LockDelay 0.
//   - Events: observers, a stream that is both session and observer, replay
//     with a last event id (Subscription.ID, Replay, Missed), the session
//     log's bounds in events and bytes, a stream that does not keep up,
//     Notify (called for waiting events and for the end).
//   - Refs: the reference rules (a successful pull references its holder and
//     every waiter it skips; delete refused while referenced or while a pull
//     or update is held; pull, update and RefAdd refused while a delete, or
//     with UpdateRequiresNoRef an update, is held; RefReleaseNode;
//     references kept across a restart), and ErrRefCountOff.
//   - Types: a type besides pull, update and delete (the seeds'
//     image-layer) has pull's rules (FIFO, a failure handed on with a new
//     token, a success that tells every waiter, skip_recent, multi-node
//     download off) and no reference rules; its events replay with their
//     type; the operators' view orders it the same in every process.
//   - Limits: identifiers, error texts cut to lock.MaxErrorLen, MaxKeys,
//     MaxQueue, MaxSessions, MaxSessionsPerNode, MaxWatchers, each answered
//     with its sentinel error and counted in Stats.
//   - Inspector: the operators' view, when the backend implements
//     lock.Inspector (skipped, saying so, when it does not).
//   - Linearizable: concurrent histories of lock, unlock (right, stale,
//     repeated) and dropped sessions, checked with porcupine against a model
//     of one key.
//   - Stress: hundreds of nodes racing for a few keys (never two holders,
//     tokens only increase, no waiter forgotten), and goroutines racing for
//     one key. Run the suite with -race.
//
// # What the suite expects of newBackend
//
// newBackend(t, cfg) returns a backend configured by cfg, or ends t with
// t.Fatal; it never returns nil. The suite builds cfg from
// lock.DefaultRules and changes what a subtest needs. A backend honours
// every rule of cfg.Rules (LockTTL, SessionGrace, ClaimTimeout, MaxHold,
// LockDelay, CompletedRetention, CompletedMax, AllowMultiNodeDownload,
// UpdateRequiresNoRef, StreamBuffer, SessionLog, SessionLogBytes and the
// limits MaxSessions, MaxSessionsPerNode, MaxQueue, MaxKeys, MaxWatchers),
// turns server-side reference counting on when cfg.RefCounting is set, and
// counts MaxKeys and CompletedMax exactly when cfg.ExactLimits is set (see
// Config).
//
// State: every subtest (every *testing.T) starts from an empty lock state.
// A second call of newBackend with the same t is a restart: the suite has
// closed the first backend and asks for another with the same cfg. The new
// one keeps what a restart must not lose — references, and fencing tokens
// that never go back — and the suite checks nothing else across it (the memory
// engine forgets its holds and queues, the etcd backend keeps them). A backend
// over shared storage names its data set per t: for instance a map from t
// to a fresh random key prefix, made on the first call with a t and reused
// by the next (t.Name() alone repeats under -count).
//
// Close: the suite closes every backend it was given, when its test ends
// (t.Cleanup) or at a restart, and fails the test if Close returns an
// error other than lock.ErrClosed. The suite's cleanup runs before the ones
// newBackend registered (cleanups run last in, first out), so newBackend
// may register the release of what the backend uses (a client, an embedded
// server). After Close every stream must be done, and the suite's goroutine
// leak check (goleak, in the calling package's TestMain) must find nothing
// left of the backend.
//
// Fake time: the subtests whose rules run on timers (ttl, claim timeout,
// max hold, session grace, completion retention) run inside a
// testing/synctest bubble, and call newBackend inside it, so a 60 s ttl
// passes in no real time. Such a backend must take its time from the time
// package (time.Now, time.Since, timers, time.AfterFunc) in goroutines it
// starts inside the bubble, and must not wait on anything outside it —
// network I/O, another process, a goroutine started before newBackend was
// called. All its goroutines must end by Close. A backend whose timers run
// elsewhere (an etcd cluster expiring its leases) cannot be faked: pass
// WithoutFakeTime with the reason, and those subtests are skipped with
// t.Skip and a message that says NOT TESTED and names the reason; `go test
// -v` lists them. The timer rules are then not checked for that backend,
// and it needs tests of its own for them: those of Rules/SkipRecentRetention,
// Rules/CompletionRecords, every Leases and LockDelay subtest, Events/ReplayBoundedInBytes
// (its end: a session begun anew replays nothing) and Limits/MaxSessions (a
// session that ended makes room).
//
// Events: the suite waits, at most EventWait, for the events it expects
// on a stream, so a backend may deliver a call's events after the call
// returns. Where it asserts that a stream received nothing, it looks once,
// without waiting: a backend that delivers a call's events before the call
// returns to its caller (the memory engine does) is held to that exactly, one that
// delivers them later less strictly there.
//
// Stats: the suite reads the counters of lock.Stats it has a rule for
// (Keys, Held, Queued, Sessions, Expiries, SessionsLost, SlowStreams, the
// Refused counters, TruncatedErrors, ReplayGaps) and compares them exactly.
//
// Real time: Linearizable and Stress run in real time, without a bubble;
// their only bounds (30 s for a waiter's outcome, 30 s for the
// linearizability check) are liveness bounds, not timing assertions.
package locktest

import (
	"errors"
	"testing"
	"testing/synctest"
	"time"

	"github.com/dlock/dlock/lock"
)

// EventWait is how long the suite waits for an event it expects before it
// fails the test. Inside a fake-time bubble it passes in no real time.
const EventWait = 10 * time.Second

// Option changes how Run treats a backend.
type Option func(*options)

type options struct {
	noFakeTime string
}

// WithoutFakeTime tells Run that the backend's timers cannot run in a
// testing/synctest bubble, for the reason given (say which clock the
// backend's timers follow). The subtests that need fake time are skipped,
// each with a message that says NOT TESTED and gives the reason.
func WithoutFakeTime(reason string) Option {
	return func(o *options) {
		if reason == "" {
			reason = "no reason given"
		}
		o.noFakeTime = reason
	}
}

// Run runs the conformance suite against the backends newBackend makes.
// See the package documentation for what it expects of newBackend.
func Run(t *testing.T, newBackend func(t *testing.T, cfg Config) lock.Backend, opts ...Option) {
	s := &suite{newBackend: newBackend}
	for _, o := range opts {
		o(&s.opts)
	}
	for _, g := range groups {
		t.Run(g.name, func(t *testing.T) {
			for _, tc := range g.tests {
				t.Run(tc.name, func(t *testing.T) { s.run(t, tc) })
			}
		})
	}
}

// test is one subtest of the suite.
type test struct {
	name string
	// fakeTime runs the test in a synctest bubble: it waits for timers.
	fakeTime bool
	run      func(t *testing.T, s *suite)
}

type group struct {
	name  string
	tests []test
}

var groups = []group{
	{"Rules", rulesTests},
	{"Leases", leaseTests},
	{"LockDelay", delayTests},
	{"Events", eventTests},
	{"Refs", refTests},
	{"Types", typeTests},
	{"Limits", limitTests},
	{"Inspector", inspectorTests},
	{"Linearizable", linearizableTests},
	{"Stress", stressTests},
}

// Config is what a subtest asks of newBackend: the rules, and two switches
// that each engine maps onto its own options.
type Config struct {
	lock.Rules
	// RefCounting turns server-side reference counting on. References
	// must survive a restart (a second newBackend with the same t): the
	// memory engine keeps them in a store the harness keeps per t, the etcd
	// engine in etcd.
	RefCounting bool
	// ExactLimits is set where a subtest counts MaxKeys or CompletedMax
	// exactly: an engine that checks them in parts concurrently (the memory
	// engine's shards, each with its share) checks them in one place.
	ExactLimits bool
}

type suite struct {
	newBackend func(t *testing.T, cfg Config) lock.Backend
	opts       options
}

func (s *suite) run(t *testing.T, tc test) {
	if !tc.fakeTime {
		tc.run(t, s)
		return
	}
	if s.opts.noFakeTime != "" {
		t.Skipf("NOT TESTED: %s needs fake time (testing/synctest) to run its timers, and this backend cannot run in it: %s", t.Name(), s.opts.noFakeTime)
	}
	synctest.Test(t, func(t *testing.T) { tc.run(t, s) })
}

// open returns a new backend with the default configuration changed by
// mod, closed when the test ends.
func (s *suite) open(t *testing.T, mod func(*Config)) lock.Backend {
	t.Helper()
	cfg := Config{Rules: lock.DefaultRules()}
	if mod != nil {
		mod(&cfg)
	}
	b := s.newBackend(t, cfg)
	if b == nil {
		t.Fatal("newBackend returned a nil backend")
	}
	t.Cleanup(func() { closeBackend(t, b) })
	return b
}

// restart closes b and opens its successor over the same state (see the
// package documentation, "State").
func (s *suite) restart(t *testing.T, b lock.Backend, mod func(*Config)) lock.Backend {
	t.Helper()
	closeBackend(t, b)
	return s.open(t, mod)
}

func closeBackend(t *testing.T, b lock.Backend) {
	t.Helper()
	if err := b.Close(); err != nil && !errors.Is(err, lock.ErrClosed) {
		t.Errorf("Close: %v", err)
	}
}
