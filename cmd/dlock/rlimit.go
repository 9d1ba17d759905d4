package main

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// connsReserve is the file descriptors the default --max-conns leaves for
// everything but client connections: listeners, the refcount database,
// logs, and the refused connections still being answered.
const connsReserve = 256

// maxConnsCap bounds the default --max-conns whatever the fd limit: at
// about 30 KiB of memory for a busy connection (Go stack and buffers, kernel
// socket buffers), 200,000 of them fit, with the lock state, in a 24 GiB
// machine.
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
// reserve, at most maxConnsCap.
func defaultMaxConns(fdLimit uint64) int {
	if fdLimit <= 2*connsReserve {
		return max(int(fdLimit/2), 1)
	}
	return int(min(fdLimit-connsReserve, maxConnsCap))
}
