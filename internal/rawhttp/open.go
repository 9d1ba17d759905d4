package rawhttp

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// Idle is a set of session streams opened by OpenIdle and held open,
// unread, as a fleet's idle nodes hold theirs.
type Idle struct {
	fds []int
}

// Len is the number of streams open.
func (s *Idle) Len() int { return len(s.fds) }

// Close closes every stream.
func (s *Idle) Close() {
	for _, fd := range s.fds {
		unix.Close(fd)
	}
	s.fds = nil
}

// ErrNotPlain is OpenIdle's error for a base it does not open streams to:
// an https:// one (TLS is net/http's and crypto/tls's, Subscribe's).
var ErrNotPlain = errors.New("rawhttp: OpenIdle opens plain http:// streams only")

// maxOpenAnswer bounds what OpenIdle reads of a stream before its
// subscribed event: dlock's servers send a head and the event in a few
// hundred bytes.
const maxOpenAnswer = 4096

// openPatience bounds how long OpenIdle waits for one stream's subscribed
// event: a server that takes connections and never answers is an error,
// not a load generator that waits for ever. A variable for the tests.
var openPatience = 30 * time.Second

// OpenIdle opens n session streams at base, of the nodes name(0) …
// name(n-1), at most conc connecting at once, and returns them once each
// has had its subscribed event, as Subscribe does. It is Subscribe for a
// fleet of idle nodes on the load generator's own cores: the sockets are
// its own, outside Go's netpoller, and one epoll set waits for all the
// openings. A connection through net.Dial and a goroutine that waits on
// it cost six more system calls and two wake-ups each, and the load
// generator, on the server's cores, spent two thirds of the CPU the server
// did (docs/BENCHMARKS.md, "The load generator's share, again"). On an
// error every stream it opened is closed. A host name is resolved once, to
// one address (IPv4 first), where net.Dial would try each in turn.
func (d Dialer) OpenIdle(ctx context.Context, base string, n, conc int, name func(i int) string) (*Idle, error) {
	if n < 0 {
		return nil, fmt.Errorf("rawhttp: %d streams to open", n)
	}
	u, addr, err := parseBase(base)
	if err != nil {
		return nil, err
	}
	if u.Scheme != "http" {
		return nil, ErrNotPlain
	}
	ta, err := net.ResolveTCPAddr("tcp", addr)
	if err != nil {
		return nil, err
	}
	domain, sa := unix.AF_INET, unix.Sockaddr(nil)
	if ip4 := ta.IP.To4(); ip4 != nil {
		s := &unix.SockaddrInet4{Port: ta.Port}
		copy(s.Addr[:], ip4)
		sa = s
	} else {
		domain = unix.AF_INET6
		s := &unix.SockaddrInet6{Port: ta.Port}
		copy(s.Addr[:], ta.IP.To16())
		if ta.Zone != "" {
			if i, err := strconv.ParseUint(ta.Zone, 10, 32); err == nil {
				s.ZoneId = uint32(i)
			} else if ifi, err := net.InterfaceByName(ta.Zone); err == nil {
				s.ZoneId = uint32(ifi.Index)
			} else {
				return nil, fmt.Errorf("rawhttp: the zone of %s: %w", addr, err)
			}
		}
		sa = s
	}
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("rawhttp: epoll: %w", err)
	}
	defer unix.Close(epfd)

	o := &opener{d: d, host: u.Host, epfd: epfd, domain: domain, sa: sa, name: name, open: map[int]*opening{}}
	idle := &Idle{fds: make([]int, 0, n)}
	err = o.run(ctx, n, max(conc, 1), idle)
	for fd := range o.open {
		unix.Close(fd)
	}
	if err != nil {
		idle.Close()
		return nil, err
	}
	return idle, nil
}

// opener is one OpenIdle's state.
type opener struct {
	d      Dialer
	host   string
	epfd   int
	domain int
	sa     unix.Sockaddr
	name   func(int) string
	open   map[int]*opening // by socket: the streams still opening
	req    []byte           // scratch: a request
}

// opening is a stream connecting, or waiting for its subscribed event.
type opening struct {
	i      int
	wrote  bool
	got    []byte
	giveUp time.Time // openPatience after it started
}

func (o *opener) run(ctx context.Context, n, conc int, idle *Idle) error {
	events := make([]unix.EpollEvent, 128)
	next := 0
	var looked time.Time
	for idle.Len() < n {
		for len(o.open) < conc && next < n {
			if err := o.start(next); err != nil {
				return err
			}
			next++
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		// At most conc openings, looked at every 100 ms at most.
		if now := time.Now(); now.Sub(looked) >= 100*time.Millisecond {
			looked = now
			for _, op := range o.open {
				if now.After(op.giveUp) {
					return fmt.Errorf("rawhttp: the stream of %s: no subscribed event within %v", o.name(op.i), openPatience)
				}
			}
		}
		k, err := unix.EpollWait(o.epfd, events, 100)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("rawhttp: epoll_wait: %w", err)
		}
		for _, ev := range events[:k] {
			fd := int(ev.Fd)
			op := o.open[fd]
			if op == nil {
				continue
			}
			done, err := o.serve(fd, op, ev.Events)
			if err != nil {
				return fmt.Errorf("rawhttp: the stream of %s: %w", o.name(op.i), err)
			}
			if done {
				delete(o.open, fd)
				idle.fds = append(idle.fds, fd)
				// Out of the set: the pings that follow wake no one.
				_ = unix.EpollCtl(o.epfd, unix.EPOLL_CTL_DEL, fd, nil)
			}
		}
	}
	return nil
}

// start connects the stream of node i.
func (o *opener) start(i int) error {
	fd, err := unix.Socket(o.domain, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("rawhttp: socket: %w", err)
	}
	if err := unix.Connect(fd, o.sa); err != nil && err != unix.EINPROGRESS {
		unix.Close(fd)
		return fmt.Errorf("rawhttp: connect: %w", err)
	}
	// Edge-triggered: once writable (connected), once for each arrival.
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(fd)}
	if err := unix.EpollCtl(o.epfd, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		unix.Close(fd)
		return fmt.Errorf("rawhttp: epoll_ctl: %w", err)
	}
	o.open[fd] = &opening{i: i, giveUp: time.Now().Add(openPatience)}
	return nil
}

// serve handles the events of op's socket: it sends the request once
// connected, and reads the answer up to the subscribed event.
func (o *opener) serve(fd int, op *opening, events uint32) (done bool, err error) {
	if events&unix.EPOLLERR != 0 {
		if serr, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR); err == nil && serr != 0 {
			return false, unix.Errno(serr)
		}
	}
	if !op.wrote && events&(unix.EPOLLOUT|unix.EPOLLERR|unix.EPOLLHUP) != 0 {
		o.req = appendRequest(o.req[:0], o.host, o.name(op.i), "", o.d.authLine())
		w, err := unix.Write(fd, o.req)
		if err != nil {
			return false, err
		}
		if w < len(o.req) {
			return false, fmt.Errorf("the socket took %d bytes of a request of %d", w, len(o.req))
		}
		op.wrote = true
	}
	if events&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) == 0 {
		return false, nil
	}
	ended := false
	for {
		if len(op.got) == cap(op.got) {
			if len(op.got) >= maxOpenAnswer {
				// What came may have it whole, or be an error answer
				// that says why, with more behind it.
				if done, err := opened(op.got); done || err != nil {
					return done, err
				}
				return false, fmt.Errorf("no subscribed event in the first %d bytes", maxOpenAnswer)
			}
			op.got = append(op.got, make([]byte, 512)...)[:len(op.got)]
		}
		r, err := unix.Read(fd, op.got[len(op.got):cap(op.got)])
		if err == unix.EINTR {
			continue
		}
		if err == unix.EAGAIN {
			break
		}
		if err != nil {
			return false, err
		}
		if r == 0 {
			ended = true
			break
		}
		op.got = op.got[:len(op.got)+r]
	}
	done, err = opened(op.got)
	if err == nil && !done && ended {
		err = fmt.Errorf("the server closed the connection before the subscribed event (%q)", op.got)
	}
	return done, err
}

// opened reports whether b, the start of an answer to GET /subscribe, has
// the subscribed event whole; an error when it is not a stream's answer.
func opened(b []byte) (bool, error) {
	n, complete, ok := leanHead(b)
	if !ok {
		// Not a lean 200: net/http reads the whole head for the reason
		// (cut short, a header line is malformed to it, not short).
		if !bytes.Contains(b, []byte("\r\n\r\n")) {
			return false, nil
		}
		resp, err := http.ReadResponse(bufio.NewReader(bytes.NewReader(b)), nil)
		switch {
		case err != nil:
			return false, err
		case resp.StatusCode != http.StatusOK:
			return false, fmt.Errorf("subscribe: %s", resp.Status)
		}
		return false, fmt.Errorf("subscribe: an answer whose body is framed (%q)", b)
	}
	if !complete {
		return false, nil
	}
	r := bufio.NewReaderSize(bytes.NewReader(b[n:]), 16)
	var ev Event
	for {
		if err := ReadEvent(r, &ev); errors.Is(err, io.EOF) {
			return false, nil
		} else if err != nil {
			return false, err
		}
		if ev.Name == "subscribed" {
			return true, nil
		}
	}
}
