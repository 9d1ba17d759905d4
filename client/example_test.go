package client_test

import (
	"context"
	"fmt"
	"net"
	"net/http"

	"github.com/dlock/dlock/client"
	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/memory"
	"github.com/dlock/dlock/server"
)

// startDlock runs an in-memory dlock server on 127.0.0.1, as
// `dlock serve --listen 127.0.0.1:0` would, and returns its URL.
func startDlock() (url string, stop func()) {
	m, _ := memory.New(context.Background(), memory.DefaultConfig())
	url, stopServer := serveDlock(m)
	return url, func() { stopServer(); m.Close() }
}

// serveDlock runs a dlock server of b's lock state on 127.0.0.1.
func serveDlock(b lock.Backend) (url string, stop func()) {
	srv := server.New(b, server.Options{})
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	hs := &http.Server{Handler: srv}
	go hs.Serve(ln)
	return "http://" + ln.Addr().String(), func() { srv.Drain(); hs.Close() }
}

func ExampleClient_Lock() {
	url, stop := startDlock()
	defer stop()

	c := &client.Client{Server: url, Node: "node-1"}
	defer c.Close()
	ctx := context.Background()
	req := client.Request{Type: lock.Pull, Resource: "sha256:4f53cda18c2baa0c0354bb5f9a3ecbe5ed12ab4d8e11ba873c2f11161202b945"}

	res, err := c.Lock(ctx, req)
	if err != nil {
		fmt.Println("lock:", err)
		return
	}
	if res.Skipped {
		fmt.Println("another node pulled it")
		return
	}
	fmt.Println("acquired:", res.Acquired)
	// ... download the blob; fence writes with res.Token ...
	var downloadErr error
	if err := c.Unlock(ctx, req, downloadErr); err != nil {
		fmt.Println("unlock:", err)
	}
	// Output: acquired: true
}

func ExampleClient_Do() {
	url, stop := startDlock()
	defer stop()

	c := &client.Client{Server: url, Node: "node-1"}
	defer c.Close()
	req := client.Request{Type: lock.Pull, Resource: "sha256:4f53cda18c2baa0c0354bb5f9a3ecbe5ed12ab4d8e11ba873c2f11161202b945"}

	skipped, err := c.Do(context.Background(), req, func(ctx context.Context) error {
		// ctx is cancelled if the lock is lost while this runs.
		fmt.Println("downloading")
		return nil // success: every node waiting for this blob skips it
	})
	fmt.Println("skipped:", skipped, "err:", err)
	// Output:
	// downloading
	// skipped: false err: <nil>
}

// A client of two servers of one lock service (here two servers of one
// in-memory lock state): when the first stops, its requests and its
// session stream move to the second, and its hold lives on.
func ExampleClient_servers() {
	m, _ := memory.New(context.Background(), memory.DefaultConfig())
	defer m.Close()
	first, stopFirst := serveDlock(m)
	second, stopSecond := serveDlock(m)
	defer stopSecond()

	c := &client.Client{Servers: client.SplitServers(first + "," + second), Node: "node-1"}
	defer c.Close()
	ctx := context.Background()
	req := client.Request{Type: lock.Pull, Resource: "sha256:4f53cda18c2baa0c0354bb5f9a3ecbe5ed12ab4d8e11ba873c2f11161202b945"}

	res, err := c.Lock(ctx, req)
	if err != nil {
		fmt.Println("lock:", err)
		return
	}
	fmt.Println("acquired:", res.Acquired)
	stopFirst()
	st, err := c.Status(ctx, req.Type, req.Resource)
	fmt.Println("holder, through the second server:", st.Holder, err)
	fmt.Println("unlock:", c.Unlock(ctx, req, nil))
	// Output:
	// acquired: true
	// holder, through the second server: node-1 <nil>
	// unlock: <nil>
}
