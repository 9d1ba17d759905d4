package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/dlock/dlock/internal/rawhttp"
)

// eventStream is a session stream as Fanout reads it.
type eventStream interface {
	Next() (name string, data []byte, err error)
	Close() error
}

// frameStream is a session stream that keeps the raw bytes of the last
// event it read, as the server wrote them: Floor writes the same bytes.
// It opens and reads the stream as rawhttp.Stream does (http.ReadResponse,
// a 4 KiB buffer on the body, rawhttp.ReadEvent), so its waiter costs what
// the others do.
type frameStream struct {
	conn  net.Conn
	r     *bufio.Reader
	frame []byte
	ev    rawhttp.Event
	// fr and pr read frame back to ReadEvent.
	fr bytes.Reader
	pr *bufio.Reader
}

func subscribeFrames(d rawhttp.Dialer, base, node string) (*frameStream, error) {
	c, resp, err := d.OpenSubscribe(base, node)
	if err != nil {
		return nil, err
	}
	s := &frameStream{conn: c, r: bufio.NewReaderSize(resp.Body, 4096)}
	for {
		name, _, err := s.Next()
		if err != nil {
			s.Close()
			return nil, err
		}
		if name == "subscribed" {
			return s, nil
		}
	}
}

// Next reads one event's lines, keeps them, and parses them with
// rawhttp.ReadEvent.
func (s *frameStream) Next() (string, []byte, error) {
	var err error
	if s.frame, err = readFrame(s.r, s.frame[:0]); err != nil {
		return "", nil, err
	}
	s.fr.Reset(s.frame)
	if s.pr == nil {
		s.pr = bufio.NewReaderSize(&s.fr, 4096)
	}
	s.pr.Reset(&s.fr)
	if err := rawhttp.ReadEvent(s.pr, &s.ev); err != nil {
		return "", nil, err
	}
	return s.ev.Name, s.ev.Data, nil
}

func (s *frameStream) Close() error { return s.conn.Close() }

// readFrame appends one event's raw lines to b, through the blank line
// that ends it. Comments (pings) and blank lines before the event's first
// field are dropped, as ReadEvent skips them.
func readFrame(r *bufio.Reader, b []byte) ([]byte, error) {
	fields := false
	for {
		line, err := r.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			return b, fmt.Errorf("an event line over %d bytes", r.Size())
		}
		if err != nil {
			return b, err
		}
		blank := len(bytes.TrimRight(line, "\r\n")) == 0
		switch {
		case blank && fields:
			return append(b, line...), nil
		case !fields && (blank || line[0] == ':'):
			continue
		}
		fields = true
		b = append(b, line...)
	}
}

// FloorWriter starts the floor's writing side for frame: it listens on
// 127.0.0.1 at addr, answers each connection's /subscribe as dlock does,
// and at each call of round writes frame to every connection it has, from
// runtime.NumCPU() goroutines, and returns how many once all are written.
// stop ends it and its connections.
type FloorWriter func(frame []byte) (addr string, round func() (int, error), stop func(), err error)

// Floor is the least time the fan-out of frame to n readers takes on this
// machine, with no lock server: n loopback connections from this process,
// each read by its own goroutine as a dlock waiter reads its stream
// (rawhttp.Stream, the same parser, the same release of the readers as in
// Fanout), and write, a program that does nothing but write frame to them.
// One op is one reader having the frame, timed from just before the
// writers are told to start; a round's max is when the last one had it.
// It runs rounds rounds on the same connections.
//
// The writers are a process of their own (ExecFloor) as dlock's server
// is, on the same cores: what differs from Fanout is only the server's
// work. A floor with both ends in this process would also need two open
// files per waiter, over the usual limit at 10,000 waiters.
func Floor(ctx context.Context, frame []byte, n, rounds int, write FloorWriter) (Result, error) {
	var want rawhttp.Event
	if err := rawhttp.ReadEvent(bufio.NewReader(bytes.NewReader(frame)), &want); err != nil {
		return Result{}, fmt.Errorf("floor: the frame is not an event: %w (%q)", err, frame)
	}
	if n < 1 || rounds < 1 {
		return Result{}, fmt.Errorf("floor: %d readers, %d rounds", n, rounds)
	}
	addr, round, stop, err := write(frame)
	if err != nil {
		return Result{}, fmt.Errorf("floor: starting the writers: %w", err)
	}
	streams := make([]*rawhttp.Stream, n)
	defer func() {
		for _, s := range streams {
			if s != nil {
				s.Close()
			}
		}
		stop()
	}()
	base := "http://" + addr
	if err := parallel(min(64, n), n, func(i int) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		s, err := rawhttp.Subscribe(base, "floor-"+strconv.Itoa(i))
		streams[i] = s
		return err
	}); err != nil {
		return Result{}, fmt.Errorf("floor: opening %d loopback streams: %w", n, err)
	}
	lat := &latencies{}
	var elapsed time.Duration
	roundMax := make([]time.Duration, 0, rounds)
	for range rounds {
		if err := ctx.Err(); err != nil {
			return Result{}, err
		}
		told := make([]time.Duration, n)
		var t0 time.Time
		ready := make(chan struct{})
		var wg sync.WaitGroup
		for i, s := range streams {
			wg.Go(func() {
				<-ready
				name, data, err := s.Next()
				switch {
				case err != nil:
					told[i] = -1
				case name != want.Name || !bytes.Equal(data, want.Data):
					told[i] = -2
				default:
					told[i] = time.Since(t0)
				}
			})
		}
		t0 = time.Now()
		close(ready)
		written, err := round()
		if err != nil {
			// The readers still waiting end with their streams.
			for _, s := range streams {
				s.Close()
			}
			wg.Wait()
			return Result{}, fmt.Errorf("floor: write: %w", err)
		}
		wg.Wait()
		if written != n {
			return Result{}, fmt.Errorf("floor: the frame went to %d connections, not %d", written, n)
		}
		if slices.Contains(told, -1) {
			return Result{}, errors.New("floor: a reader's connection broke")
		}
		if slices.Contains(told, -2) {
			return Result{}, errors.New("floor: a reader read another event than the frame")
		}
		m := slices.Max(told)
		roundMax = append(roundMax, m)
		elapsed += m
		lat.add(told)
	}
	r := lat.result("fanout-floor", "loopback", "reader has it", n, elapsed)
	r.Rate = float64(r.Ops) / elapsed.Seconds()
	r.Rounds, r.RoundMedian = rounds, median(roundMax)
	r.Note = fmt.Sprintf("%d rounds: the %d-byte event written by %d goroutines of a process of their own to %d loopback sockets, each read and parsed by its own goroutine; max = all have it",
		rounds, len(frame), runtime.NumCPU(), n)
	return r, nil
}

// floorWriter is the writing side of the floor, in the process that runs
// it.
type floorWriter struct {
	ln        net.Listener
	frame     []byte
	accepting sync.WaitGroup
	mu        sync.Mutex
	conns     []net.Conn
	acceptErr error
}

func listenFloor(frame []byte) (*floorWriter, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	w := &floorWriter{ln: ln, frame: frame}
	w.accepting.Go(func() {
		var answering sync.WaitGroup
		defer answering.Wait()
		for {
			c, err := ln.Accept()
			if err != nil {
				// Out of open files, say. Closing the listener resets
				// the connections not yet accepted: their readers fail
				// instead of waiting.
				if !errors.Is(err, net.ErrClosed) {
					w.mu.Lock()
					w.acceptErr = err
					w.mu.Unlock()
					ln.Close()
				}
				return
			}
			answering.Go(func() {
				// Counted before the answer: once a reader has its
				// subscribed event, its connection is in conns.
				w.mu.Lock()
				w.conns = append(w.conns, c)
				w.mu.Unlock()
				if err := answerSubscribe(c); err != nil {
					c.Close()
				}
			})
		}
	})
	return w, nil
}

// round writes the frame to every connection, from runtime.NumCPU()
// goroutines, each on its share.
func (w *floorWriter) round() (int, error) {
	w.mu.Lock()
	conns, acceptErr := w.conns, w.acceptErr
	w.mu.Unlock()
	if acceptErr != nil {
		return 0, fmt.Errorf("accept: %w", acceptErr)
	}
	writers := runtime.NumCPU()
	errs := make(chan error, writers)
	var wg sync.WaitGroup
	for k := range writers {
		share := conns[k*len(conns)/writers : (k+1)*len(conns)/writers]
		wg.Go(func() {
			for _, c := range share {
				if _, err := c.Write(w.frame); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	return len(conns), <-errs
}

func (w *floorWriter) stop() {
	w.ln.Close()
	w.accepting.Wait()
	for _, c := range w.conns {
		c.Close()
	}
}

// InProcessFloor runs the floor's writers in this process (tests: its
// readers then share the Go scheduler with them).
func InProcessFloor(frame []byte) (string, func() (int, error), func(), error) {
	w, err := listenFloor(frame)
	if err != nil {
		return "", nil, nil, err
	}
	return w.ln.Addr().String(), w.round, w.stop, nil
}

// ServeFloor is the floor's writing side as a process of its own, driven
// by ExecFloor: it reads the frame (a line of hex) from in, listens and
// prints its address on out, then, for every line it reads, writes a
// round and prints "ok N" (N connections written) or "error TEXT". It
// returns at the end of in.
func ServeFloor(in io.Reader, out io.Writer) error {
	br := bufio.NewReader(in)
	line, err := br.ReadString('\n')
	if err != nil {
		return fmt.Errorf("floor writer: reading the frame: %w", err)
	}
	frame, err := hex.DecodeString(strings.TrimSpace(line))
	if err != nil {
		return fmt.Errorf("floor writer: the frame: %w", err)
	}
	w, err := listenFloor(frame)
	if err != nil {
		return err
	}
	defer w.stop()
	if _, err := fmt.Fprintln(out, w.ln.Addr()); err != nil {
		return err
	}
	for {
		if _, err := br.ReadString('\n'); err != nil {
			return nil
		}
		n, err := w.round()
		if err != nil {
			fmt.Fprintln(out, "error", err)
			continue
		}
		if _, err := fmt.Fprintln(out, "ok", n); err != nil {
			return err
		}
	}
}

// ExecFloor runs the floor's writers as the command bin args..., which
// calls ServeFloor on its standard input and output. Its standard error
// goes to stderr.
func ExecFloor(stderr io.Writer, bin string, args ...string) FloorWriter {
	return func(frame []byte) (string, func() (int, error), func(), error) {
		cmd := exec.Command(bin, args...)
		cmd.Stderr = stderr
		in, err := cmd.StdinPipe()
		if err != nil {
			return "", nil, nil, err
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			return "", nil, nil, err
		}
		if err := cmd.Start(); err != nil {
			return "", nil, nil, err
		}
		return driveFloor(frame, in, out, func() {
			// A writer stuck in a write does not see its input end.
			t := time.AfterFunc(10*time.Second, func() { cmd.Process.Kill() })
			cmd.Wait()
			t.Stop()
		})
	}
}

// driveFloor is ExecFloor's side of ServeFloor's protocol, over the
// writer's input and output; wait waits for the writer to end once its
// input is closed.
func driveFloor(frame []byte, in io.WriteCloser, outPipe io.Reader, wait func()) (string, func() (int, error), func(), error) {
	stop := func() {
		in.Close()
		wait()
	}
	out := bufio.NewReader(outPipe)
	if _, err := fmt.Fprintf(in, "%x\n", frame); err != nil {
		stop()
		return "", nil, nil, err
	}
	addr, err := out.ReadString('\n')
	if err != nil {
		stop()
		return "", nil, nil, fmt.Errorf("the floor writer printed no address: %w", err)
	}
	round := func() (int, error) {
		if _, err := io.WriteString(in, "go\n"); err != nil {
			return 0, err
		}
		line, err := out.ReadString('\n')
		if err != nil {
			return 0, fmt.Errorf("the floor writer: %w", err)
		}
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "ok "); ok {
			return strconv.Atoi(v)
		}
		return 0, fmt.Errorf("the floor writer: %s", strings.TrimSpace(line))
	}
	return strings.TrimSpace(addr), round, stop, nil
}

// answerSubscribe reads a request's head and answers it as dlock answers
// /subscribe on HTTP/1.1.
func answerSubscribe(c net.Conn) error {
	br := bufio.NewReader(c)
	for {
		line, err := br.ReadSlice('\n')
		if err != nil {
			return err
		}
		if len(bytes.TrimRight(line, "\r\n")) == 0 {
			break
		}
	}
	_, err := c.Write([]byte("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n" +
		"event: subscribed\ndata: {\"event\":\"subscribed\"}\n\n"))
	return err
}
