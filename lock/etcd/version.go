package etcd

import (
	"context"
	"strconv"
	"strings"
	"time"
)

// checkVersions warns once, when the backend opens, of each etcd endpoint
// it was given whose member runs a version before 3.5. In etcd 3.4.23 every
// lease keepalive copies the write buffer not yet committed to disk, so a
// fleet's sessions that hold locks (a lease each, 3,000 keepalives a second
// for 10,000 sessions at a 10 s grace) starve its apply after a burst of
// writes, and sessions run out: docs/PERFORMANCE.md, "On etcd", says what
// was measured on each version. Later 3.4 releases took etcd 3.5's shared read buffer
// but were not measured, so every 3.4 is warned of. An endpoint that does
// not answer is passed over: the warning is advice, and the watch and the
// calls report an etcd that is away.
func (b *Backend) checkVersions() {
	defer b.wg.Done()
	defer close(b.versionsChecked)
	for _, ep := range b.cli.Endpoints() {
		ctx, cancel := context.WithTimeout(b.ctx, 5*time.Second)
		st, err := b.cli.Status(ctx, ep)
		cancel()
		if err != nil {
			continue
		}
		if before35(st.Version) {
			b.log.Warn("etcd backend: this etcd member runs a version before 3.5: in etcd 3.4.23 every lease keepalive copies its uncommitted writes, and with thousands of sessions a burst of locks made it drop sessions; run etcd 3.5 or later (docs/PERFORMANCE.md, \"On etcd\")",
				"endpoint", ep, "version", st.Version)
		}
	}
}

// before35 reports whether version, as etcd's Status answers it
// ("3.4.23"), is a 3.x before 3.5. A version it cannot read is not.
func before35(version string) bool {
	major, rest, ok := strings.Cut(version, ".")
	if !ok {
		return false
	}
	minor, _, _ := strings.Cut(rest, ".")
	ma, err1 := strconv.Atoi(major)
	mi, err2 := strconv.Atoi(minor)
	if err1 != nil || err2 != nil {
		return false
	}
	return ma < 3 || (ma == 3 && mi < 5)
}
