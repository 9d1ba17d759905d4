// Command etcd is etcd's own server at the version go.mod pins (the one the
// embedded test servers run), built from the Go module proxy: for the tests
// and benchmarks that run etcd as a process, on an etcd newer than the
// Debian package's 3.4 (`make etcd` puts it in bin/; docs/PERFORMANCE.md,
// "On etcd").
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
