package etcdtest

import "go.uber.org/goleak"

// GoleakOptions are the goleak options that a leak check needs for this
// package's servers, once they are stopped (for Shared: TestMain's check
// through M). There are none today: with etcd v3.7.3 and grpc v1.83.2, a
// closed embedded server and its closed clients leave no goroutine
// (TestCloseLeavesNothing; the gRPC gateway, off here, leaves none either),
// and a Cluster leaves none in the test binary once stopped. Use it all the same, so that an option
// an upgrade needs is added here once, with its reason.
func GoleakOptions() []goleak.Option {
	return nil
}
