package etcd

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/lock"
)

// presence tells the operators' view how many streams each node has open
// on the other servers: a server knows its own streams, and a session's
// etcd lease does not say who keeps it alive (docs/DESIGN.md, "The
// operators' view"). It costs nothing while nobody looks:
//
//	P/ui/v/<server>          someone looks through this server
//	P/ui/n/<node>/<server>   the server's count of the node's streams
//
// A server writes P/ui/v/ while someone looks through it (viewer). While
// any other server's P/ui/v/ exists, every server writes its counts, one
// key per node with streams there, and changes one as its node's streams
// open and close; when none does, it revokes them. Both live on one lease
// of the server's, kept alive with its sessions' (keeper.go), so that a
// server that dies takes its counts with it one session grace later, as it
// takes its sessions' keepalives. Every server follows P/ui/ with a watch
// of its own, idle while nobody looks.
type presence struct {
	b  *Backend
	id string // this server's, random per Backend

	mu      sync.Mutex
	viewers map[string]bool           // servers someone looks through, this one included
	remoteN map[string]map[string]int // node → other server → its streams there
	looking bool                      // someone looks through this server
	dirty   map[string]bool           // nodes whose count changed since written
	// writing is set while other servers look: this server's stream
	// changes are to be written (changed reads it without the mutex).
	writing atomic.Bool
	kick    chan struct{}

	// The writer's own state (write).
	lease     int64
	announced bool
	written   map[string]int // node → the count written
}

func newPresence(b *Backend) *presence {
	var raw [8]byte
	_, _ = rand.Read(raw[:])
	return &presence{
		b: b, id: hex.EncodeToString(raw[:]),
		viewers: map[string]bool{}, remoteN: map[string]map[string]int{},
		dirty: map[string]bool{}, written: map[string]int{}, kick: make(chan struct{}, 1),
	}
}

func (n names) ui() string                    { return n.p + "ui/" }
func (n names) uiViewer(server string) string { return n.p + "ui/v/" + server }
func (n names) uiStreams(node, server string) string {
	return n.p + "ui/n/" + esc(node) + "/" + server
}

// remote returns node's streams on the other servers, as they wrote them.
func (p *presence) remote(node string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, c := range p.remoteN[node] {
		n += c
	}
	return n
}

// changed notes that node's streams on this server changed; w.mu held.
func (p *presence) changed(node string) {
	if !p.writing.Load() {
		return
	}
	p.mu.Lock()
	p.dirty[node] = true
	p.mu.Unlock()
	p.poke()
}

// viewing notes whether someone looks through this server.
func (p *presence) viewing(on bool) {
	p.mu.Lock()
	p.looking = on
	p.mu.Unlock()
	p.poke()
}

func (p *presence) poke() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// run follows P/ui/ until the backend closes, and writes this server's
// part.
func (p *presence) run() {
	defer p.b.wg.Done()
	p.b.wg.Add(1)
	go p.writer()
	b := p.b
	for b.ctx.Err() == nil {
		rev, err := p.list()
		if err == nil {
			p.follow(rev)
		}
		select {
		case <-b.ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

// list reads P/ui/ whole and returns its revision.
func (p *presence) list() (int64, error) {
	ctx, cancel := context.WithTimeout(p.b.ctx, callTimeout)
	defer cancel()
	resp, err := p.b.cli.Get(ctx, p.b.n.ui(), clientv3.WithPrefix())
	if err != nil {
		return 0, err
	}
	p.mu.Lock()
	old := p.remoteN
	p.viewers, p.remoteN = map[string]bool{}, map[string]map[string]int{}
	for _, kv := range resp.Kvs {
		p.applyLocked(kv, false)
	}
	nodes := make([]string, 0, len(old)+len(p.remoteN))
	for node := range old {
		nodes = append(nodes, node)
	}
	for node := range p.remoteN {
		nodes = append(nodes, node)
	}
	p.updateLocked()
	p.mu.Unlock()
	p.tell(nodes)
	return resp.Header.Revision, nil
}

// follow applies P/ui/'s changes after rev until the watch ends.
func (p *presence) follow(rev int64) {
	b := p.b
	ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(b.ctx))
	defer cancel()
	for resp := range b.cli.Watch(ctx, b.n.ui(), clientv3.WithPrefix(), clientv3.WithRev(rev+1)) {
		if resp.Err() != nil || resp.CompactRevision > 0 {
			return // listed again
		}
		var nodes []string
		p.mu.Lock()
		for _, ev := range resp.Events {
			if node := p.applyLocked(ev.Kv, ev.Type == mvccpb.DELETE); node != "" {
				nodes = append(nodes, node)
			}
		}
		p.updateLocked()
		p.mu.Unlock()
		p.tell(nodes)
	}
}

// applyLocked applies one record of P/ui/ and returns the node whose count
// on another server it changed, if any; p.mu held.
func (p *presence) applyLocked(kv *mvccpb.KeyValue, deleted bool) string {
	rest, ok := strings.CutPrefix(string(kv.Key), p.b.n.ui())
	if !ok {
		return ""
	}
	if server, ok := strings.CutPrefix(rest, "v/"); ok {
		if deleted {
			delete(p.viewers, server)
		} else {
			p.viewers[server] = true
		}
		return ""
	}
	rest, ok = strings.CutPrefix(rest, "n/")
	if !ok {
		return ""
	}
	en, server, ok := strings.Cut(rest, "/")
	node, err := url.PathUnescape(en)
	if !ok || err != nil || server == p.id {
		return ""
	}
	m := p.remoteN[node]
	n, err := strconv.Atoi(string(kv.Value))
	if deleted || err != nil || n <= 0 {
		if m == nil {
			return ""
		}
		delete(m, server)
		if len(m) == 0 {
			delete(p.remoteN, node)
		}
		return node
	}
	if m == nil {
		m = map[string]int{}
		p.remoteN[node] = m
	}
	m[server] = n
	return node
}

// updateLocked starts or stops writing this server's counts as other
// servers start or stop looking; p.mu held.
func (p *presence) updateLocked() {
	others := len(p.viewers) > 1 || (len(p.viewers) == 1 && !p.viewers[p.id])
	if others != p.writing.Load() {
		p.writing.Store(others)
		p.poke()
	}
}

// tell the operator feeds of this server the new counts of nodes.
func (p *presence) tell(nodes []string) {
	b := p.b
	if len(nodes) == 0 || b.ops.n.Load() == 0 {
		return
	}
	w := b.w
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, node := range nodes {
		b.ops.publish(lock.OpEvent{Session: &lock.SessionChange{Node: node, Streams: len(w.streams[node]) + p.remote(node)}})
	}
}

// writer writes this server's part of P/ui/ whenever it is poked, until
// the backend closes; then it revokes it.
func (p *presence) writer() {
	defer p.b.wg.Done()
	b := p.b
	retry := time.NewTimer(time.Hour)
	defer retry.Stop()
	for {
		select {
		case <-b.ctx.Done():
			p.revoke()
			return
		case <-p.kick:
		case <-retry.C:
		}
		if err := p.write(); err != nil && b.ctx.Err() == nil {
			b.log.Warn("etcd backend: writing the operators' view's stream counts", "err", err)
			retry.Reset(time.Second)
		}
	}
}

// write brings this server's part of P/ui/ to what it should be now.
func (p *presence) write() error {
	b := p.b
	p.mu.Lock()
	looking, writing := p.looking, p.writing.Load()
	dirty := p.dirty
	p.dirty = map[string]bool{}
	p.mu.Unlock()
	if !looking && !writing {
		p.revoke()
		return nil
	}
	// Every node's count, from the watcher's table of streams: all of
	// them when writing starts, else those that changed.
	counts := map[string]int{}
	w := b.w
	w.mu.Lock()
	switch {
	case !writing:
	case len(p.written) == 0:
		for node, l := range w.streams {
			counts[node] = len(l)
		}
	default:
		for node := range dirty {
			counts[node] = len(w.streams[node])
		}
	}
	w.mu.Unlock()
	if !writing {
		for node := range p.written {
			counts[node] = 0
		}
	}
	if p.lease == 0 {
		ctx, cancel := context.WithTimeout(b.ctx, callTimeout)
		sent := time.Now()
		g, err := b.cli.Grant(ctx, b.graceTTL)
		cancel()
		if err != nil {
			p.requeue(dirty)
			return b.etcdErr("granting the view's lease", err)
		}
		p.lease = int64(g.ID)
		b.keeper.add(p.lease, sent, sent.Add(time.Duration(g.TTL)*time.Second))
	}
	// ops[i] writes the count of nodes[i], or the viewer's record ("").
	var ops []clientv3.Op
	var nodes []string
	if looking != p.announced {
		if looking {
			ops = append(ops, clientv3.OpPut(b.n.uiViewer(p.id), "", clientv3.WithLease(clientv3.LeaseID(p.lease))))
		} else {
			ops = append(ops, clientv3.OpDelete(b.n.uiViewer(p.id)))
		}
		nodes = append(nodes, "")
	}
	for node, n := range counts {
		switch {
		case n == p.written[node]:
			continue
		case n == 0:
			ops = append(ops, clientv3.OpDelete(b.n.uiStreams(node, p.id)))
		default:
			ops = append(ops, clientv3.OpPut(b.n.uiStreams(node, p.id), strconv.Itoa(n), clientv3.WithLease(clientv3.LeaseID(p.lease))))
		}
		nodes = append(nodes, node)
	}
	// etcd takes at most 128 operations a transaction. Each has a bound
	// of its own and keeps what it wrote: with one bound for all, the
	// counts of a server with many streams on a slow etcd (782
	// transactions for 100,000) never all went, and every attempt began
	// again with all of them (TestAttackViewCountsConverge).
	for len(ops) > 0 {
		n := min(len(ops), 128)
		ctx, cancel := context.WithTimeout(b.ctx, callTimeout)
		_, err := b.cli.Txn(ctx).Then(ops[:n]...).Commit()
		cancel()
		if err != nil {
			if errors.Is(err, rpctypes.ErrLeaseNotFound) {
				// etcd ended the lease (this server did not reach it
				// for its TTL): start over with a new one and every
				// count.
				p.drop()
			} else {
				for _, node := range nodes {
					if node != "" {
						dirty[node] = true
					}
				}
			}
			p.requeue(dirty)
			return b.etcdErr("writing the view's stream counts", err)
		}
		for _, node := range nodes[:n] {
			switch c := counts[node]; {
			case node == "":
				p.announced = looking
			case c == 0:
				delete(p.written, node)
			default:
				p.written[node] = c
			}
		}
		ops, nodes = ops[n:], nodes[n:]
	}
	return nil
}

// requeue marks nodes dirty again after a failed write.
func (p *presence) requeue(dirty map[string]bool) {
	p.mu.Lock()
	for node := range dirty {
		p.dirty[node] = true
	}
	p.mu.Unlock()
}

// drop forgets the lease and what was written with it.
func (p *presence) drop() {
	if p.lease != 0 {
		p.b.keeper.remove(p.lease)
	}
	p.lease, p.announced = 0, false
	clear(p.written)
}

// revoke takes this server's part of P/ui/ away at once.
func (p *presence) revoke() {
	if p.lease == 0 {
		return
	}
	lease := p.lease
	p.drop()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_, _ = p.b.cli.Revoke(ctx, clientv3.LeaseID(lease))
}
