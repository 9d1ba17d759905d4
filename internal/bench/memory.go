package bench

import (
	"bufio"
	"context"
	"fmt"
	"github.com/dlock/dlock/internal/rawhttp"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// ServerRSS reads the server's resident memory from its /metrics.
func ServerRSS(base string, d rawhttp.Dialer) (float64, error) {
	req, err := http.NewRequest(http.MethodGet, base+"/metrics", nil)
	if err != nil {
		return 0, err
	}
	if d.Token != "" {
		req.Header.Set("Authorization", "Bearer "+d.Token)
	}
	tr := &http.Transport{TLSClientConfig: d.TLS}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("%s/metrics: %s", base, resp.Status)
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "process_resident_memory_bytes "); ok {
			f, err := strconv.ParseFloat(v, 64)
			return f / (1 << 20), err
		}
	}
	return 0, fmt.Errorf("%s/metrics has no process_resident_memory_bytes", base)
}

// HeldLocks takes n locks on distinct keys (ttl leases) and reports the
// server's resident memory while they are held.
func HeldLocks(ctx context.Context, base string, d rawhttp.Dialer, n, conns int) (Result, error) {
	id := runID()
	before, err := ServerRSS(base, d)
	if err != nil {
		return Result{}, err
	}
	cs := make([]*rawhttp.Conn, conns)
	for i := range cs {
		if cs[i], err = d.Dial(base); err != nil {
			return Result{}, err
		}
		defer cs[i].Close()
	}
	var next atomic.Int64
	start := time.Now()
	err = parallel(conns, conns, func(w int) error {
		c := cs[w]
		var body []byte
		for {
			i := next.Add(1) - 1
			if i >= int64(n) || ctx.Err() != nil {
				return ctx.Err()
			}
			body = fmt.Appendf(body[:0], `{"type":"pull","resource_id":"sha256:held-%s-%d","node_id":"holder-%d","lease":"ttl"}`, id, i, w)
			if st, err := c.Post("/lock", body); err != nil || st != 200 {
				return fmt.Errorf("lock: %d %v", st, err)
			}
		}
	})
	if err != nil {
		return Result{}, err
	}
	elapsed := time.Since(start)
	after, err := ServerRSS(base, d)
	if err != nil {
		return Result{}, err
	}
	return Result{Scenario: "held-locks", System: "dlock", Concurrency: conns, Ops: int64(n), Seconds: elapsed.Seconds(),
		Rate: float64(n) / elapsed.Seconds(), Unit: "lock held", RSSMiB: after,
		Note: fmt.Sprintf("%d locks held: server RSS %.1f MiB (%.1f MiB before)", n, after, before)}, nil
}

// OpenSessions opens n session streams, keeps them open while it reads the
// server's resident memory, then closes them.
func OpenSessions(ctx context.Context, base string, d rawhttp.Dialer, n int) (Result, error) {
	id := runID()
	before, err := ServerRSS(base, d)
	if err != nil {
		return Result{}, err
	}
	streams := make([]*rawhttp.Stream, n)
	defer func() {
		for _, s := range streams {
			if s != nil {
				s.Close()
			}
		}
	}()
	start := time.Now()
	if err := parallel(64, n, func(i int) error {
		s, err := d.Subscribe(base, fmt.Sprintf("idle-%s-%d", id, i))
		streams[i] = s
		return err
	}); err != nil {
		return Result{}, err
	}
	elapsed := time.Since(start)
	after, err := ServerRSS(base, d)
	if err != nil {
		return Result{}, err
	}
	return Result{Scenario: "open-sessions", System: "dlock", Concurrency: 64, Ops: int64(n), Seconds: elapsed.Seconds(),
		Rate: float64(n) / elapsed.Seconds(), Unit: "session opened", RSSMiB: after,
		Note: fmt.Sprintf("%d sessions open: server RSS %.1f MiB (%.1f MiB before)", n, after, before)}, nil
}
