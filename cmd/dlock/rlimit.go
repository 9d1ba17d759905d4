package main

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// connsReserve is the file descriptors the default --max-conns leaves for
// everything but client connections: listeners, the refcount database,
// logs, and the refused connections still being answered.
const connsReserve = 256

// maxConnsCap bounds the default --max-conns whatever the fd limit. A
// connection costs the server at most about 19 KiB of resident memory (an
// idle keep-alive connection with a goroutine of its own, as over TLS; one
// waiting in the event loop costs far less) and a session stream about
// 7 KiB (measured over 10,000, docs/BENCHMARKS.md), plus a few KiB of kernel
// socket state: 200,000 take at most about 5 GiB, which leaves a 24 GiB
// machine room for the lock state and for sockets with data queued.
const maxConnsCap = 200_000

// raiseFileLimit raises the soft RLIMIT_NOFILE to the hard limit, so that
// connections, not an inherited default of 1024, are what the server runs
// out of. It returns the limit in force.
func raiseFileLimit() (uint64, error) {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return 0, fmt.Errorf("reading RLIMIT_NOFILE: %w", err)
	}
	if lim.Cur < lim.Max {
		raised := lim
		raised.Cur = lim.Max
		if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &raised); err != nil {
			return lim.Cur, fmt.Errorf("raising RLIMIT_NOFILE to %d: %w", lim.Max, err)
		}
		lim = raised
	}
	return lim.Cur, nil
}

// defaultMaxConns is --max-conns for an fd limit: the limit minus a
// reserve, at most maxConnsCap. An unknown limit (0) gives the cap: running
// out of descriptors first is survived too (accept backs off).
func defaultMaxConns(fdLimit uint64) int {
	if fdLimit == 0 {
		return maxConnsCap
	}
	if fdLimit <= 2*connsReserve {
		return max(int(fdLimit/2), 1)
	}
	return int(min(fdLimit-connsReserve, maxConnsCap))
}
