package client

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/netfault"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/memory"
)

// The paused holder: a process using this client is stopped (SIGSTOP: a
// long GC pause, a VM frozen) past its lease and the server hands the key
// on; then it runs again. docs/DESIGN.md ("A paused client") says its
// lease timer fires when it runs again, possibly after the hand-over; this
// checks what the holder then believes and does.

const pausedChildEnv = "DLOCK_TEST_PAUSED_CHILD"

// TestAttackPausedHolderChild is the holder process of
// TestAttackPausedHolder; it does nothing in a normal run. It takes a ttl
// lease on the key, prints "acquired TOKEN", and then answers commands on
// stdin: "check" asks Held (the first thing it does when it reads the
// line) and prints then whether Lost is closed and what Held said, "wait" waits for Lost, "unlock"
// unlocks with success and prints the answer.
func TestAttackPausedHolderChild(t *testing.T) {
	url := os.Getenv(pausedChildEnv)
	if url == "" {
		t.Skip("the holder process of TestAttackPausedHolder")
	}
	c := &Client{Server: url, Node: "paused", RenewInterval: 100 * time.Millisecond}
	defer c.Close()
	req := Request{Type: lock.Pull, Resource: "sha256:paused", Lease: lock.LeaseTTL}
	res, err := c.Lock(context.Background(), req)
	if err != nil || !res.Acquired {
		fmt.Printf("failed %v\n", err)
		return
	}
	fmt.Printf("acquired %d\n", res.Token)
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		switch in.Text() {
		case "check":
			// Held first: the first instruction after resuming.
			held := c.Held(req)
			select {
			case <-res.Lost:
				fmt.Println("lost", held)
			default:
				fmt.Println("held", held)
			}
		case "wait":
			select {
			case <-res.Lost:
				fmt.Println("lost")
			case <-time.After(kit.Patience):
				fmt.Println("never lost")
			}
		case "unlock":
			err := c.Unlock(context.Background(), req, nil)
			fmt.Printf("unlock %v\n", err)
			return
		}
	}
}

// TestAttackPausedHolder: the holder process (ttl lease, 2 s) is frozen;
// the server hands the key on to a waiter once the ttl runs out; the
// holder is thawed. It must take the hold as lost (at once: its lease
// timer is long due), and the success unlock it then sends must be
// refused by its token, leaving the waiter's hold alone. At its very first
// instruction after resuming (the "check" written before the thaw) it asks
// Held, which must say no: a look at Lost alone raced the lease timer
// there, and said "held" in 2 runs of 5 before Held existed.
func TestAttackPausedHolder(t *testing.T) {
	srv := startServer(t, func(c *memory.Config) { c.LockTTL = 2 * time.Second })
	child := exec.Command(os.Args[0], "-test.run=^TestAttackPausedHolderChild$", "-test.count=1")
	child.Env = append(os.Environ(), pausedChildEnv+"="+srv.URL())
	stdin, err := child.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	child.Stderr = os.Stderr
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		stdin.Close()
		child.Process.Kill()
		child.Wait()
	}()
	lines := make(chan string, 16)
	go func() {
		r := bufio.NewScanner(stdout)
		for r.Scan() {
			lines <- r.Text()
		}
		close(lines)
	}()
	line := func() string {
		select {
		case l := <-lines:
			return l
		case <-time.After(kit.Patience):
			t.Fatal("the holder process said nothing")
			return ""
		}
	}
	first := line()
	tok, ok := strings.CutPrefix(first, "acquired ")
	if !ok {
		t.Fatalf("the holder: %q", first)
	}
	token, _ := strconv.ParseUint(tok, 10, 64)

	b := newClient(t, srv, "b")
	key := Request{Type: lock.Pull, Resource: "sha256:paused"}
	got := make(chan Result, 1)
	go func() {
		r, err := b.Lock(t.Context(), key)
		if err != nil {
			t.Error(err)
		}
		got <- r
	}()
	srv.WaitQueued(t, key.key(), 1)
	netfault.Freeze(t, child.Process.Pid)
	var rb Result
	select {
	case rb = <-got:
	case <-time.After(kit.Patience):
		t.Fatal("the waiter was not granted the key while the holder was frozen")
	}
	if !rb.Acquired || rb.Token <= token {
		t.Fatalf("the waiter: %+v (holder's token %d)", rb, token)
	}
	// The first thing the holder reads when it runs again.
	if _, err := io.WriteString(stdin, "check\n"); err != nil {
		t.Fatal(err)
	}
	if err := netfault.Thaw(child.Process.Pid); err != nil {
		t.Fatal(err)
	}
	// "held false": Held saw the lease's end passed, and closed Lost.
	if l := line(); l != "lost false" {
		t.Errorf("the holder, asked first thing after resuming with the key handed on meanwhile: %q (Lost's state, Held), want \"lost false\"", l)
	}
	io.WriteString(stdin, "wait\n")
	if l := line(); l != "lost" {
		t.Fatalf("after resuming, the holder's Lost: %s", l)
	}
	io.WriteString(stdin, "unlock\n")
	l := line()
	if !strings.Contains(l, "not_holder") && !strings.Contains(l, "stale") {
		t.Errorf("the resumed holder's unlock: %q, want a refusal", l)
	}
	if l == "unlock <nil>" {
		t.Fatalf("the resumed holder's success unlock was accepted")
	}
	st, err := b.Status(t.Context(), key.Type, key.Resource)
	if err != nil || st.Holder != "b" || st.Token != rb.Token {
		t.Fatalf("the waiter's hold after the resumed holder's unlock: %+v %v", st, err)
	}
	select {
	case <-rb.Lost:
		t.Fatal("the waiter's hold lost after the resumed holder's unlock")
	default:
	}
	b.Unlock(t.Context(), key, nil)
}
