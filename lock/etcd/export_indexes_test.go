package etcd

import "time"

// LeaveIndexesForTest has b's successes with more than over waiters leave
// their queue indexes, and has b sweep the ones it sees left after about
// after (up to twice that): set before the first call.
func LeaveIndexesForTest(b *Backend, over int, after time.Duration) {
	b.ix.over.Store(int64(over))
	b.ix.after.Store(int64(after))
}
