package etcd

// KeepalivesAnsweredForTest is how many keepalives of b's keeper etcd
// has answered.
func KeepalivesAnsweredForTest(b *Backend) uint64 { return b.keeper.answers.Load() }
