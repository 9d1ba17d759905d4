package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"sync/atomic"
	"time"
)

// The usual single-instance Redis lock: SET key token NX PX ttl to take it,
// and a compare-and-delete script to release it.
const redisUnlock = `if redis.call("get", KEYS[1]) == ARGV[1] then return redis.call("del", KEYS[1]) else return 0 end`

// redisConn speaks just enough RESP for SET and EVAL.
type redisConn struct {
	c   net.Conn
	r   *bufio.Reader
	buf []byte
}

func dialRedis(addr string) (*redisConn, error) {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return nil, err
	}
	return &redisConn{c: c, r: bufio.NewReader(c)}, nil
}

func (rc *redisConn) do(args ...string) (string, error) {
	rc.buf = append(rc.buf[:0], '*')
	rc.buf = strconv.AppendInt(rc.buf, int64(len(args)), 10)
	rc.buf = append(rc.buf, "\r\n"...)
	for _, a := range args {
		rc.buf = append(rc.buf, '$')
		rc.buf = strconv.AppendInt(rc.buf, int64(len(a)), 10)
		rc.buf = append(rc.buf, "\r\n"...)
		rc.buf = append(rc.buf, a...)
		rc.buf = append(rc.buf, "\r\n"...)
	}
	if _, err := rc.c.Write(rc.buf); err != nil {
		return "", err
	}
	line, err := rc.r.ReadString('\n')
	if err != nil {
		return "", err
	}
	switch line[0] {
	case '+', ':':
		return line[1 : len(line)-2], nil
	case '$': // bulk: nil ($-1), or INFO's text
		n, err := strconv.Atoi(line[1 : len(line)-2])
		if err != nil {
			return "", fmt.Errorf("unexpected redis answer %q", line)
		}
		if n < 0 {
			return "", nil
		}
		b := make([]byte, n+2)
		if _, err := io.ReadFull(rc.r, b); err != nil {
			return "", err
		}
		return string(b[:n]), nil
	case '-':
		return "", errors.New(line[1 : len(line)-2])
	}
	return "", fmt.Errorf("unexpected redis answer %q", line)
}

func (rc *redisConn) Close() error { return rc.c.Close() }

// StartRedis runs redis-server on a free 127.0.0.1 port, without
// persistence, until stop is called.
func StartRedis() (addr string, stop func(), err error) {
	addr, err = freeAddr()
	if err != nil {
		return "", nil, err
	}
	_, port, _ := net.SplitHostPort(addr)
	cmd := exec.Command("redis-server", "--bind", "127.0.0.1", "--port", port, "--save", "", "--appendonly", "no")
	cmd.Stdout, cmd.Stderr = nil, os.Stderr
	if err := cmd.Start(); err != nil {
		return "", nil, err
	}
	stop = func() { cmd.Process.Kill(); cmd.Wait() }
	if err := waitFor(func() bool {
		rc, err := dialRedis(addr)
		if err != nil {
			return false
		}
		defer rc.Close()
		v, err := rc.do("PING")
		return err == nil && v == "PONG"
	}); err != nil {
		stop()
		return "", nil, fmt.Errorf("redis-server did not start: %w", err)
	}
	return addr, stop, nil
}

// RedisPairs: SET NX PX + compare-and-delete on distinct keys.
func RedisPairs(ctx context.Context, addr string, opts Options) (Result, error) {
	id := runID()
	lat, elapsed, err := runWorkers(ctx, opts, opts.Concurrency, func(ctx context.Context, w int, ops *atomic.Int64, lat *[]time.Duration) error {
		rc, err := dialRedis(addr)
		if err != nil {
			return err
		}
		defer rc.Close()
		token := fmt.Sprint("w", w)
		for i := 0; ctx.Err() == nil; i++ {
			key := fmt.Sprintf("bench-%s-%d-%d", id, w, i%4096)
			t0 := time.Now()
			if v, err := rc.do("SET", key, token, "NX", "PX", "60000"); err != nil || v != "OK" {
				return fmt.Errorf("redis SET: %q %v", v, err)
			}
			if _, err := rc.do("EVAL", redisUnlock, "1", key, token); err != nil {
				return err
			}
			*lat = append(*lat, time.Since(t0))
			ops.Add(1)
		}
		return nil
	})
	return lat.result("pairs", "redis", "lock+unlock", opts.Concurrency, elapsed), err
}

// RedisHandoff: W clients on one key. Redis has no queue and no
// notification, so a waiter retries SET NX until it gets the key (with a
// 50 µs pause, as a client must or it starves the server on two cores).
func RedisHandoff(ctx context.Context, addr string, opts Options) (Result, error) {
	key := "bench-handoff-" + runID()
	var sentAt atomic.Int64
	start := time.Now()
	lat, elapsed, err := runWorkers(ctx, opts, opts.Concurrency, func(ctx context.Context, w int, ops *atomic.Int64, lat *[]time.Duration) error {
		rc, err := dialRedis(addr)
		if err != nil {
			return err
		}
		defer rc.Close()
		token := fmt.Sprint("w", w)
		for ctx.Err() == nil {
			v, err := rc.do("SET", key, token, "NX", "PX", "60000")
			if err != nil {
				return err
			}
			if v != "OK" {
				time.Sleep(50 * time.Microsecond)
				continue
			}
			if at := sentAt.Load(); at > 0 {
				*lat = append(*lat, time.Duration(time.Since(start).Nanoseconds()-at))
				ops.Add(1)
			}
			sentAt.Store(time.Since(start).Nanoseconds())
			if _, err := rc.do("EVAL", redisUnlock, "1", key, token); err != nil {
				return err
			}
		}
		return nil
	})
	r := lat.result("handoff", "redis", "hand-off", opts.Concurrency, elapsed)
	r.Note = "polling SET NX every 50µs: no FIFO, no notification"
	return r, err
}

func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

func waitFor(cond func() bool) error {
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			return errors.New("timed out")
		}
		time.Sleep(50 * time.Millisecond)
	}
	return nil
}
