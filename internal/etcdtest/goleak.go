package etcdtest

import "go.uber.org/goleak"

// GoleakOptions are the goleak options a package that uses this package's
// servers needs in its leak check, after the servers have stopped.
func GoleakOptions() []goleak.Option {
	return nil
}
