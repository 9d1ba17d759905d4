package etcd

import "time"

// SetScanBudgetForTest sets how many keys one InspectKeys call examines,
// until the returned func sets it back.
func SetScanBudgetForTest(n int) func() {
	old := scanBudget
	scanBudget = n
	return func() { scanBudget = old }
}

// SetViewIdleForTest sets how long the view's state outlives the last
// inspection, until the returned func sets it back.
func SetViewIdleForTest(d time.Duration) func() {
	old := viewIdle
	viewIdle = d
	return func() { viewIdle = old }
}

// ViewForTest reports what b keeps for the operators' view: whether
// someone looks, whether it has an index of the keys, and how many
// indexes and operator events it built so far.
func ViewForTest(b *Backend) (looking, indexed bool, built uint64) {
	b.vw.idxMu.Lock()
	indexed = b.vw.idx != nil
	b.vw.idxMu.Unlock()
	return b.vw.on.Load(), indexed, b.vw.built.Load()
}

// DropViewForTest drops b's index of the keys, as the end of a look does:
// the next inspection builds it again.
func DropViewForTest(b *Backend) {
	b.w.mu.Lock()
	b.vw.drop()
	b.w.mu.Unlock()
}

// ViewBytesForTest is what b's index of the keys holds: its blocks' keys
// (cap, as allocated) and the list of blocks, 0 when it has none. The
// resource strings are the watch's own, shared.
func ViewBytesForTest(b *Backend) int {
	b.vw.idxMu.Lock()
	defer b.vw.idxMu.Unlock()
	x := b.vw.idx
	if x == nil {
		return 0
	}
	n := cap(x.blocks) * 24
	for _, bl := range x.blocks {
		n += cap(bl) * 24
	}
	return n
}
