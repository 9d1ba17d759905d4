package client

import (
	"context"

	"github.com/dlock/dlock/lock"
)

// gate serializes one Client's callers of one key: one Client is one node,
// and the server would tell two callers of one node "acquired" alike.
type gate struct {
	slot  chan struct{} // holding its one place is owning the key in this client
	users int           // callers holding or waiting for the gate; guarded by Client.mu
	// successes counts this node's successful unlocks of the key: a caller
	// that waited through one skips, like a waiter of another node.
	successes chan uint64
}

func (c *Client) gate(k lock.Key) *gate {
	c.mu.Lock()
	defer c.mu.Unlock()
	g := c.gates[k]
	if g == nil {
		g = &gate{slot: make(chan struct{}, 1), successes: make(chan uint64, 1)}
		g.successes <- 0
		c.gates[k] = g
	}
	g.users++
	return g
}

func (g *gate) count() uint64 {
	n := <-g.successes
	g.successes <- n
	return n
}

// acquire waits for the key's turn in this client, until ctx ends or the
// client closes (closed). skipped reports that a previous holder in this
// client succeeded while the caller waited.
func (g *gate) acquire(ctx context.Context, closed <-chan struct{}) (skipped bool, err error) {
	before := g.count()
	select {
	case g.slot <- struct{}{}:
		return g.count() != before, nil
	case <-ctx.Done():
		return false, context.Cause(ctx)
	case <-closed:
		return false, ErrClosed
	}
}

// releaseGate gives the key's turn to the next caller of this client.
func (c *Client) releaseGate(k lock.Key, success bool) {
	c.mu.Lock()
	g := c.gates[k]
	c.mu.Unlock()
	if g == nil {
		return
	}
	if success {
		g.successes <- <-g.successes + 1
	}
	<-g.slot
	c.putGate(k)
}

func (c *Client) putGate(k lock.Key) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if g := c.gates[k]; g != nil {
		g.users--
		if g.users == 0 {
			delete(c.gates, k)
		}
	}
}
