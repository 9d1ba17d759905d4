package etcd

import "github.com/dlock/dlock/lock"

// logEvent appends d to the replay log of node's session s within the
// log's bounds (docs/DESIGN.md, "An etcd backend", "What a server keeps");
// w.mu held.
func (w *watcher) logEvent(s *sessInfo, node string, d lock.Delivery) {
	if dropped := s.log.Append(node, d, w.b.cfg.SessionLog, w.b.cfg.SessionLogBytes); dropped > 0 {
		s.dropped = dropped
	}
}

// forget empties the replay log; w.mu held.
func (s *sessInfo) forget() { s.log.Reset() }

// after is the events of node's replay log with an id above last, in
// order (nil for none); w.mu held.
func (s *sessInfo) after(node string, last uint64) []lock.Delivery { return s.log.After(node, last) }
