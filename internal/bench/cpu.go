package bench

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/dlock/dlock/internal/rawhttp"
)

// scrape reads the named samples (unlabelled ones) from base's /metrics:
// dlock's, or etcd's on its client URL.
func scrape(base string, d rawhttp.Dialer, names ...string) (map[string]float64, error) {
	req, err := http.NewRequest(http.MethodGet, base+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	if d.Token != "" {
		req.Header.Set("Authorization", "Bearer "+d.Token)
	}
	tr := &http.Transport{TLSClientConfig: d.TLS}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s/metrics: %s", base, resp.Status)
	}
	v, err := parseMetrics(resp.Body, names...)
	if err != nil {
		return nil, fmt.Errorf("%s/metrics: %w", base, err)
	}
	return v, nil
}

// parseMetrics picks the named unlabelled samples out of the Prometheus
// text format; every name must be there.
func parseMetrics(r io.Reader, names ...string) (map[string]float64, error) {
	v := make(map[string]float64, len(names))
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		name, value, ok := strings.Cut(sc.Text(), " ")
		if !ok || strings.HasPrefix(name, "#") {
			continue
		}
		for _, n := range names {
			if name != n {
				continue
			}
			// A sample may carry a timestamp after its value.
			value, _, _ = strings.Cut(value, " ")
			f, err := strconv.ParseFloat(value, 64)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", name, err)
			}
			v[name] = f
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	for _, n := range names {
		if _, ok := v[n]; !ok {
			return nil, fmt.Errorf("no %s", n)
		}
	}
	return v, nil
}

// MetricsCPU reads a server's process_cpu_seconds_total from its /metrics:
// dlock's (with the dialer's credentials) or etcd's. The value comes from
// /proc/PID/stat, in steps of 10 ms: a window of a few seconds under load
// is counted to about 1 %.
func MetricsCPU(base string, d rawhttp.Dialer) CPUProbe {
	return func() (time.Duration, error) {
		v, err := scrape(base, d, "process_cpu_seconds_total")
		if err != nil {
			return 0, err
		}
		return time.Duration(v["process_cpu_seconds_total"] * 1e9), nil
	}
}

// RedisCPU reads Redis's CPU time from INFO cpu.
func RedisCPU(addr string) CPUProbe {
	return func() (time.Duration, error) {
		rc, err := dialRedis(addr)
		if err != nil {
			return 0, err
		}
		defer rc.Close()
		info, err := rc.do("INFO", "cpu")
		if err != nil {
			return 0, err
		}
		return parseRedisCPU(info)
	}
}

// parseRedisCPU sums used_cpu_user and used_cpu_sys of INFO cpu: the
// process's getrusage(RUSAGE_SELF), every thread (Redis 7's I/O and
// background threads included). The _main_thread fields are a part of it;
// the _children ones are forked saves, which a server without persistence
// never makes.
func parseRedisCPU(info string) (time.Duration, error) {
	var total float64
	found := 0
	for line := range strings.Lines(info) {
		k, v, ok := strings.Cut(strings.TrimRight(line, "\r\n"), ":")
		if !ok || (k != "used_cpu_user" && k != "used_cpu_sys") {
			continue
		}
		f, err := strconv.ParseFloat(v, 64)
		if err != nil {
			return 0, fmt.Errorf("redis INFO cpu: %s: %w", k, err)
		}
		total += f
		found++
	}
	if found != 2 {
		return 0, fmt.Errorf("redis INFO cpu has no used_cpu_user and used_cpu_sys: %q", info)
	}
	return time.Duration(total * 1e9), nil
}

// ProcCPU reads a process's CPU time (user + system, every thread) from
// /proc/PID/stat: for a server that bench started and that has no
// /metrics of its own to ask, or whose own count should not depend on
// one. Linux counts it in clock ticks of 10 ms (USER_HZ is 100).
func ProcCPU(pid int) CPUProbe {
	return func() (time.Duration, error) {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return 0, err
		}
		return parseProcStat(string(b))
	}
}

// parseProcStat reads utime and stime, the 14th and 15th fields of
// /proc/PID/stat, past the command name in parentheses (which may hold
// spaces).
func parseProcStat(stat string) (time.Duration, error) {
	i := strings.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc stat %q: no command", stat)
	}
	f := strings.Fields(stat[i+1:])
	// f[0] is the state, the 3rd field: utime is f[11], stime f[12].
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc stat %q: too few fields", stat)
	}
	var ticks int64
	for _, s := range f[11:13] {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc stat: %w", err)
		}
		ticks += v
	}
	return time.Duration(ticks) * 10 * time.Millisecond, nil
}
