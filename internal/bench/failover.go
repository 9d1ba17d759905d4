package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/dlock/dlock/internal/rawhttp"
)

// FailoverOptions are the fail-over scenario's (docs/BENCHMARKS.md, "dlock
// on etcd"): several dlock servers on one etcd, one of which is killed
// under a node each round.
type FailoverOptions struct {
	Servers int // dlock servers sharing the lock state, at least 2
	Rounds  int // rounds, each with a server killed, at least 1
	// Start starts one more server of the service (`dlock serve --backend
	// etcd` on the one etcd); the stop it returns must kill it at once,
	// as SIGKILL does, and return when it is gone.
	Start  StartServer
	Dialer rawhttp.Dialer
	// Retry is how long the node keeps trying the other servers after the
	// kill before the round fails (0: 30 s).
	Retry time.Duration
	// Recheck, if positive, is how long after the fail-over the hold is
	// checked again: longer than the servers' --session-grace (5 s by
	// default), it shows the session outlived the keep-alives of the
	// killed server, not only its grace.
	Recheck time.Duration
	// Client makes the node a client.Client given every server, A first,
	// whose own fail-over moves its requests and stream (docs/DESIGN.md,
	// "What a client does"); without it the node is raw HTTP that tries
	// the other servers in turn.
	Client bool
	// Progress, if set, is called after each round with the rounds done.
	Progress func(rounds int64)
	// Round, if set, is called with each round's outcome.
	Round func(FailoverRound)
}

// FailoverRound is one round of the fail-over scenario.
type FailoverRound struct {
	// Lock is the time from the kill until the node's next /lock was
	// answered by another server; Stream until its session stream,
	// reopened on another server with Last-Event-ID, said subscribed.
	Lock, Stream time.Duration
	// Kept: the lock the node took on the killed server is still its,
	// with the same token, by /status on the server that answered.
	Kept bool
	// Replayed: the resumed stream delivered the next lock's
	// lock_assigned (docs/API.md: the events after Last-Event-ID).
	Replayed bool
	// Problem says what was not kept or not replayed.
	Problem string
}

// foServer is one running server of the fail-over scenario.
type foServer struct {
	base string
	stop func()
}

// Failover measures fail-over between servers of one lock service. Each
// round a node opens its session stream on the first server (A), takes a
// session-leased lock there, and reads its lock_assigned; then A is
// killed. The node does what a client with a list of servers does: its
// next /lock (of another key) goes to A's connection, which is dead, then
// to the other servers in turn until one answers; its stream, broken,
// reopens on the other servers with Last-Event-ID. One op is a round,
// timed from the kill until both the lock's answer and the stream's
// subscribed event came (the later of the two; the note gives each). A new
// server replaces A, at the end of the list, so each round kills another.
func Failover(ctx context.Context, o FailoverOptions) (Result, error) {
	if o.Servers < 2 || o.Rounds < 1 || o.Start == nil {
		return Result{}, errors.New("failover: at least 2 servers, 1 round and a Start")
	}
	if o.Retry <= 0 {
		o.Retry = 30 * time.Second
	}
	var servers []foServer
	defer func() {
		for _, s := range servers {
			s.stop()
		}
	}()
	for len(servers) < o.Servers {
		base, stop, err := o.Start(ctx)
		if err != nil {
			return Result{}, fmt.Errorf("starting server %d: %w", len(servers)+1, err)
		}
		servers = append(servers, foServer{base, stop})
	}
	id := runID()
	lat := &latencies{}
	var locks, streams []time.Duration
	kept, replayed := 0, 0
	var problems []string
	for round := 1; round <= o.Rounds; round++ {
		if err := ctx.Err(); err != nil {
			return Result{}, err
		}
		once := failoverRound
		if o.Client {
			once = failoverRoundClient
		}
		r, err := once(ctx, o, servers, fmt.Sprintf("fo%s-%d", id, round))
		if err != nil {
			return Result{}, fmt.Errorf("round %d: %w", round, err)
		}
		// The killed server is gone (its stop has run); a new one takes
		// its place at the end.
		base, stop, err := o.Start(ctx)
		if err != nil {
			servers = servers[1:]
			return Result{}, fmt.Errorf("round %d: starting the replacement server: %w", round, err)
		}
		servers = append(servers[1:], foServer{base, stop})
		lat.add([]time.Duration{max(r.Lock, r.Stream)})
		locks, streams = append(locks, r.Lock), append(streams, r.Stream)
		if r.Kept {
			kept++
		}
		if r.Replayed {
			replayed++
		}
		if r.Problem != "" {
			problems = append(problems, fmt.Sprintf("round %d: %s", round, r.Problem))
		}
		if o.Round != nil {
			o.Round(r)
		}
		if o.Progress != nil {
			o.Progress(int64(round))
		}
	}
	var total time.Duration
	for _, d := range lat.all {
		total += d
	}
	res := lat.result("failover", "dlock", "fail-over", o.Servers, total)
	res.Rate = 0 // rounds are paced by the restarts, not a rate
	res.Rounds, res.RoundMedian = len(lat.all), median(lat.all)
	keptText := "holds kept"
	if o.Recheck > 0 {
		keptText += fmt.Sprintf(" (then and %v after the kill)", o.Recheck)
	}
	res.Note = fmt.Sprintf("%d rounds, %d servers, one SIGKILLed each round: next /lock answered p50 %s max %s; stream resumed p50 %s max %s; %s %d/%d; next grant delivered on the resumed stream %d/%d",
		o.Rounds, o.Servers, fmtDur(median(locks)), fmtDur(durMax(locks)), fmtDur(median(streams)), fmtDur(durMax(streams)), keptText, kept, o.Rounds, replayed, o.Rounds)
	if len(problems) > 0 {
		res.Note += "; " + strings.Join(problems, "; ")
	}
	return res, nil
}

func durMax(d []time.Duration) float64 {
	if len(d) == 0 {
		return 0
	}
	return float64(slices.Max(d).Nanoseconds()) / 1e3
}

// fmtDur formats µs for a note.
func fmtDur(us float64) string {
	return time.Duration(us * 1e3).Round(10 * time.Microsecond).String()
}

type lockAnswer struct {
	Acquired bool   `json:"acquired"`
	Token    uint64 `json:"token"`
}

// failoverRound is one round on servers, whose first is killed; its stop
// has run when it returns.
func failoverRound(ctx context.Context, o FailoverOptions, servers []foServer, node string) (FailoverRound, error) {
	var r FailoverRound
	a, others := servers[0], servers[1:]
	killed := false
	defer func() {
		if !killed {
			a.stop()
		}
	}()
	held, next := node+"-held", node+"-next"
	s, err := o.Dialer.Subscribe(a.base, node)
	if err != nil {
		return r, fmt.Errorf("subscribe on %s: %w", a.base, err)
	}
	defer s.Close()
	c, err := o.Dialer.Dial(a.base)
	if err != nil {
		return r, err
	}
	defer c.Close()
	st, err := c.Post("/lock", lockBody(held, node))
	var first lockAnswer
	if err != nil || st != 200 || json.Unmarshal(c.Body, &first) != nil || !first.Acquired {
		return r, fmt.Errorf("lock on %s: %d %v %s", a.base, st, err, c.Body)
	}
	s.SetReadDeadline(time.Now().Add(10 * time.Second))
	if err := awaitAssigned(s, held); err != nil {
		return r, fmt.Errorf("lock_assigned on %s: %w", a.base, err)
	}
	lastID := s.ID()
	if lastID == "" {
		return r, fmt.Errorf("lock_assigned on %s has no id", a.base)
	}
	s.SetReadDeadline(time.Time{})

	t0 := time.Now()
	killed = true
	a.stop()
	deadline := t0.Add(o.Retry)
	var wg sync.WaitGroup
	var lockErr, streamErr error
	var nc *rawhttp.Conn // the connection that answered the next lock
	var ns *rawhttp.Stream
	wg.Go(func() {
		// The dead connection first, as a client finds out.
		if st, err := c.Post("/lock", lockBody(next, node)); err == nil && st == 200 {
			lockErr = errors.New("the killed server answered")
			return
		}
		lockErr = untilAnswered(ctx, deadline, others, func(base string) (bool, error) {
			conn, err := o.Dialer.Dial(base)
			if err != nil {
				return false, nil
			}
			st, err := conn.Post("/lock", lockBody(next, node))
			if err != nil || st != 200 {
				conn.Close()
				return false, nil
			}
			var ans lockAnswer
			if json.Unmarshal(conn.Body, &ans) != nil || !ans.Acquired {
				conn.Close()
				return false, fmt.Errorf("next lock on %s: %s", base, conn.Body)
			}
			r.Lock = time.Since(t0)
			nc = conn
			return true, nil
		})
	})
	wg.Go(func() {
		for {
			if _, _, err := s.Next(); err != nil {
				break // the stream broke with its server
			}
		}
		streamErr = untilAnswered(ctx, deadline, others, func(base string) (bool, error) {
			st, err := o.Dialer.Resume(base, node, lastID)
			if err != nil {
				return false, nil
			}
			r.Stream = time.Since(t0)
			ns = st
			return true, nil
		})
	})
	wg.Wait()
	if nc != nil {
		defer nc.Close()
	}
	if ns != nil {
		defer ns.Close()
	}
	if lockErr != nil {
		return r, fmt.Errorf("next lock after the kill: %w", lockErr)
	}
	if streamErr != nil {
		return r, fmt.Errorf("resuming the stream after the kill: %w", streamErr)
	}

	// The hold taken on the killed server: the same holder and token.
	st, err = nc.Get("/status?type=pull&resource_id=" + url.QueryEscape(held))
	var status struct {
		Holder string `json:"holder"`
		Token  uint64 `json:"token"`
	}
	if err != nil || st != 200 || json.Unmarshal(nc.Body, &status) != nil {
		return r, fmt.Errorf("status after the kill: %d %v %s", st, err, nc.Body)
	}
	r.Kept = status.Holder == node && status.Token == first.Token
	if !r.Kept {
		r.Problem = fmt.Sprintf("hold lost: holder %q token %d, was %q %d", status.Holder, status.Token, node, first.Token)
	}
	// The next lock's grant, after Last-Event-ID, on the resumed stream.
	ns.SetReadDeadline(time.Now().Add(5 * time.Second))
	if err := awaitAssigned(ns, next); err == nil {
		r.Replayed = true
	} else {
		r.Problem = joinNote(r.Problem, "no lock_assigned of the next lock on the resumed stream: "+err.Error())
	}
	ns.SetReadDeadline(time.Time{})
	if r.Kept && o.Recheck > 0 {
		// The stream stays open and read, as a node's does.
		go func() {
			for {
				if _, _, err := ns.Next(); err != nil {
					return
				}
			}
		}()
		select {
		case <-time.After(o.Recheck - time.Since(t0)):
		case <-ctx.Done():
			return r, ctx.Err()
		}
		st, err = nc.Get("/status?type=pull&resource_id=" + url.QueryEscape(held))
		if err != nil || st != 200 || json.Unmarshal(nc.Body, &status) != nil {
			return r, fmt.Errorf("status %v after the kill: %d %v %s", o.Recheck, st, err, nc.Body)
		}
		if r.Kept = status.Holder == node && status.Token == first.Token; !r.Kept {
			r.Problem = fmt.Sprintf("hold lost within %v: holder %q token %d, was %q %d", o.Recheck, status.Holder, status.Token, node, first.Token)
		}
	}
	for _, k := range []string{next, held} {
		nc.Post("/unlock", fmt.Appendf(nil, `{"type":"pull","resource_id":%q,"node_id":%q,"success":true}`, k, node))
	}
	return r, nil
}

func lockBody(key, node string) []byte {
	return fmt.Appendf(nil, `{"type":"pull","resource_id":%q,"node_id":%q,"lease":"session"}`, key, node)
}

// untilAnswered tries each server in turn, over and over, until try says
// one answered, try fails, or the deadline passes.
func untilAnswered(ctx context.Context, deadline time.Time, servers []foServer, try func(base string) (bool, error)) error {
	for {
		for _, s := range servers {
			ok, err := try(s.base)
			if err != nil || ok {
				return err
			}
		}
		if time.Now().After(deadline) {
			return errors.New("no other server answered in time")
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// awaitAssigned reads the stream until a lock_assigned of resource.
func awaitAssigned(s *rawhttp.Stream, resource string) error {
	want := []byte(`"resource_id":"` + resource + `"`)
	for {
		name, data, err := s.Next()
		if err != nil {
			return err
		}
		if name == "lock_assigned" && strings.Contains(string(data), string(want)) {
			return nil
		}
	}
}
