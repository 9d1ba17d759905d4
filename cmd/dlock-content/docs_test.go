package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	contentapi "github.com/containerd/containerd/api/services/content/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/dlock/dlock/internal/dlocktest/kit"
	"github.com/dlock/dlock/internal/doctest"
)

// The page whose commands these tests run (docs/DEVELOPMENT.md, "Commands
// in the docs").
const containerdPage = "docs/CONTAINERD.md"

func containerdBlocks(t *testing.T, test string) []doctest.Block {
	t.Helper()
	all, err := doctest.Read(filepath.Join("..", "..", containerdPage))
	if err != nil {
		t.Fatal(err)
	}
	return doctest.Marked(all, test)
}

// TestDocsContainerd runs the start of docs/CONTAINERD.md as written: the
// shared dlock server with --refcount=server, then dlock-content on it,
// each in the background as on its machine; only the addresses and paths
// of the page's example (10.0.0.5:7380, /shared/content, /run/dlock-content)
// are replaced by the test's. The content store then answers on its socket.
func TestDocsContainerd(t *testing.T) {
	blocks := containerdBlocks(t, "TestDocsContainerd")
	if len(blocks) != 1 {
		t.Fatalf("%s: %d blocks marked TestDocsContainerd, want 1", containerdPage, len(blocks))
	}
	text := strings.ReplaceAll(blocks[0].Text, "\\\n", "")
	lines := strings.Split(strings.TrimSpace(text), "\n")
	if len(lines) != 2 || !strings.HasPrefix(lines[0], "dlock serve ") || !strings.HasPrefix(lines[1], "dlock-content ") {
		t.Fatalf("%s:%d: want a dlock serve line and a dlock-content line, got %q", containerdPage, blocks[0].Line, lines)
	}
	dir, err := os.MkdirTemp("", "dlcd") // short: unix socket paths are limited
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	bin := filepath.Join(dir, "bin")
	for pkg, name := range map[string]string{".": "dlock-content", "../dlock": "dlock"} {
		if out, err := exec.Command("go", "build", "-o", filepath.Join(bin, name), pkg).CombinedOutput(); err != nil {
			t.Fatalf("build %s: %v\n%s", name, err, out)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	start := func(line string) *kit.Buffer {
		out := &kit.Buffer{}
		cmd := exec.CommandContext(ctx, "bash", "-c", "exec "+line)
		cmd.Env = append(os.Environ(), "PATH="+bin+":"+os.Getenv("PATH"), "DLOCK_DATA_DIR="+filepath.Join(dir, "data"))
		cmd.Stdout, cmd.Stderr = out, out
		cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
		cmd.WaitDelay = time.Minute
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			cancel()
			_ = cmd.Wait()
		})
		return out
	}
	// The server on a port of its own: the one it reports is given to
	// dlock-content where the page names 10.0.0.5:7380.
	serve := start(strings.ReplaceAll(lines[0], "10.0.0.5:7380", "127.0.0.1:0"))
	var addr string
	serving := regexp.MustCompile(`msg="dlock serving" addr=(\S+)`)
	kit.WaitFor(t, "dlock serve to listen", func() bool {
		if m := serving.FindStringSubmatch(serve.String()); m != nil {
			addr = m[1]
		}
		return addr != ""
	})
	sock := filepath.Join(dir, "run", "content.sock")
	content := start(strings.NewReplacer(
		"10.0.0.5:7380", addr,
		"/shared/content", filepath.Join(dir, "shared"),
		"/run/dlock-content/content.sock", sock,
	).Replace(lines[1]))

	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	store := contentapi.NewContentClient(conn)
	kit.Await(t, "dlock-content to answer on its socket", func() error {
		_, err := store.Info(ctx, &contentapi.InfoRequest{Digest: "sha256:0000000000000000000000000000000000000000000000000000000000000000"})
		if status.Code(err) == codes.NotFound {
			return nil
		}
		return err
	})
	if s := content.String(); strings.Contains(s, "level=ERROR") {
		t.Errorf("dlock-content logged an error:\n%s", s)
	}
}
