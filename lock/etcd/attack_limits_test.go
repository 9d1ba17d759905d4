package etcd_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/etcd"
)

// TestAttackStreamsPerNodeRace opens many streams of one node at once on
// one server: Config.MaxSessionsPerNode bounds them however they race
// (docs/DESIGN.md, "Sessions and events").
func TestAttackStreamsPerNodeRace(t *testing.T) {
	const limit, tries = 3, 40
	b, _ := open(t, func(c *etcd.Config) { c.MaxSessionsPerNode = limit })
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		opened  []lock.Stream
		refused int
	)
	start := make(chan struct{})
	for range tries {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			st, _, err := b.Subscribe(context.Background(), lock.SubscribeRequest{Node: "n"})
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				opened = append(opened, st)
			case errors.Is(err, lock.ErrTooManySessions):
				refused++
			default:
				t.Errorf("Subscribe: %v", err)
			}
		}()
	}
	close(start)
	wg.Wait()
	for _, st := range opened {
		st.Close()
	}
	if len(opened) > limit || len(opened)+refused != tries {
		t.Fatalf("%d streams opened and %d refused, want at most %d opened", len(opened), refused, limit)
	}
}

// TestAttackWatchersRace opens many observers at once: Config.MaxWatchers
// bounds them however they race (docs/DESIGN.md, "Observers").
func TestAttackWatchersRace(t *testing.T) {
	const limit, tries = 3, 60
	b, _ := open(t, func(c *etcd.Config) { c.MaxWatchers = limit })
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		opened  []lock.Stream
		refused int
	)
	start := make(chan struct{})
	for i := range tries {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			req := lock.SubscribeRequest{Observe: &lock.Key{Type: lock.Pull, Resource: "r"}}
			if i%2 == 0 {
				req.Node = fmt.Sprintf("n%d", i) // a session that observes too
			}
			st, _, err := b.Subscribe(context.Background(), req)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				opened = append(opened, st)
			case errors.Is(err, lock.ErrTooManyWatchers):
				refused++
			default:
				t.Errorf("Subscribe: %v", err)
			}
		}()
	}
	close(start)
	wg.Wait()
	for _, st := range opened {
		st.Close()
	}
	if len(opened) > limit || len(opened)+refused != tries {
		t.Fatalf("%d observers opened and %d refused, want at most %d opened", len(opened), refused, limit)
	}
}
