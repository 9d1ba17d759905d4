package content

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/metadata"
	"github.com/containerd/containerd/v2/plugins/content/local"
	bolt "go.etcd.io/bbolt"

	"github.com/dlock/dlock/internal/dlocktest"
	"github.com/dlock/dlock/internal/dlocktest/kit"
)

// BenchmarkSharedPull: N nodes pull one image of 8 × 8 MiB layers from a
// registry whose uplink is 4 MiB/s, through dlock (one shared store) and
// independently (a store each). Reports the registry's bytes and the time
// until the slowest node is done. Run it alone, once:
//
//	go test -run '^$' -bench SharedPull -benchtime 1x -timeout 30m ./content
func BenchmarkSharedPull(b *testing.B) {
	reg := newRegistry()
	uplink := kit.NewUplink(4 << 20)
	var mu sync.Mutex
	var served int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.Contains(r.URL.Path, "/blobs/") || r.Method != http.MethodGet {
			reg.ServeHTTP(w, r)
			return
		}
		pw := &kit.PacedWriter{ResponseWriter: w, Uplink: uplink}
		reg.ServeHTTP(pw, r)
		mu.Lock()
		served += pw.N
		mu.Unlock()
	})
	rs := httptest.NewServer(h)
	defer rs.Close()
	host := strings.TrimPrefix(rs.URL, "http://")
	ref, _, _ := pushImage(b, host, "bench/img", 8, 8<<20)
	for _, mode := range []string{"dlock", "independent"} {
		for _, n := range []int{1, 2, 4, 8} {
			b.Run(fmt.Sprintf("%s/nodes=%d", mode, n), func(b *testing.B) {
				for b.Loop() {
					b.StopTimer()
					nodes := benchNodes(b, mode, n)
					mu.Lock()
					served = 0
					mu.Unlock()
					b.StartTimer()
					start := time.Now()
					for i, err := range pullAll(context.Background(), nodes, ref) {
						if err != nil {
							b.Fatalf("node %d: %v", i, err)
						}
					}
					wall := time.Since(start)
					b.StopTimer()
					mu.Lock()
					b.ReportMetric(float64(served)/(1<<20), "registry-MiB")
					mu.Unlock()
					b.ReportMetric(wall.Seconds(), "slowest-node-s")
					b.StartTimer()
				}
			})
		}
	}
}

// puller is a node that can pull an image.
type puller interface {
	pull(ctx context.Context, ref string) error
}

// benchNodes makes n fresh nodes: sharing one store through dlock, or each
// with a local store of its own.
func benchNodes(b *testing.B, mode string, n int) []puller {
	var out []puller
	if mode == "independent" {
		for i := range n {
			dir := b.TempDir()
			ls, err := local.NewStore(dir)
			if err != nil {
				b.Fatal(err)
			}
			bdb, err := bolt.Open(filepath.Join(dir, "meta.db"), 0o600, nil)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { bdb.Close() })
			db := metadata.NewDB(bdb, ls, nil)
			if err := db.Init(context.Background()); err != nil {
				b.Fatal(err)
			}
			out = append(out, &node{name: fmt.Sprint("node-", i), db: db})
		}
		return out
	}
	srv := dlocktest.Start(b, dlocktest.Options{RefCount: true})
	root := b.TempDir()
	for i := range n {
		out = append(out, newNode(b, fmt.Sprint("node-", i), root, srv.URL()))
	}
	return out
}
