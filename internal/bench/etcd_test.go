package bench

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

const mountinfo = `22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
23 22 0:21 / /proc rw,nosuid shared:2 - proc proc rw
24 22 0:22 / /tmp rw,nosuid shared:3 - tmpfs tmpfs rw,size=1024k
25 22 0:23 / /tmpdisk rw shared:4 - xfs /dev/vdb rw
26 22 0:24 / /data\040dir rw shared:5 - btrfs /dev/vdc rw
`

// The data dir's disk is the longest mount point above it.
func TestDiskOf(t *testing.T) {
	for path, want := range map[string]string{
		"/var/lib/etcd":     "/dev/vda (ext4 at /)",
		"/tmp/etcd123":      "tmpfs (tmpfs at /tmp)",
		"/tmp":              "tmpfs (tmpfs at /tmp)",
		"/tmpdisk/x":        "/dev/vdb (xfs at /tmpdisk)",
		"/tmpdiskette/x":    "/dev/vda (ext4 at /)",
		"/data dir/etcd":    "/dev/vdc (btrfs at /data dir)",
		"/proc/self/status": "proc (proc at /proc)",
	} {
		if got := diskOf(path, mountinfo); got != want {
			t.Errorf("diskOf(%q) = %q, want %q", path, got, want)
		}
	}
	if got := diskOf("/x", "garbage\n"); got != "an unknown disk" {
		t.Errorf("no mounts: %q", got)
	}
}

const etcdMetrics = `# HELP grpc_server_handled_total Total number of RPCs completed on the server, regardless of success or failure.
# TYPE grpc_server_handled_total counter
grpc_server_handled_total{grpc_code="OK",grpc_method="Range",grpc_service="etcdserverpb.KV",grpc_type="unary"} 400
grpc_server_handled_total{grpc_code="Canceled",grpc_method="Range",grpc_service="etcdserverpb.KV",grpc_type="unary"} 2
grpc_server_handled_total{grpc_code="OK",grpc_method="Txn",grpc_service="etcdserverpb.KV",grpc_type="unary"} 200
grpc_server_handled_total{grpc_code="OK",grpc_method="Put",grpc_service="etcdserverpb.KV",grpc_type="unary"} 0
etcd_disk_wal_fsync_duration_seconds_sum 0.5
etcd_disk_wal_fsync_duration_seconds_count 41
etcd_disk_wal_fsync_duration_seconds_bucket{le="0.001"} 3
`

func TestEtcdCalls(t *testing.T) {
	got := parseEtcdCalls(etcdMetrics)
	if len(got) != 4 || got["Range"] != 402 || got["Txn"] != 200 || got["Put"] != 0 || got["fsync"] != 41 {
		t.Fatalf("parsed %v", got)
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			http.NotFound(w, r)
			return
		}
		w.Write([]byte(strings.ReplaceAll(etcdMetrics, "} 400", "} 800")))
	}))
	defer srv.Close()
	after, err := EtcdCalls(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	per := EtcdCallsPerOp(got, after, 100)
	if len(per) != 1 || per["Range"] != 4 {
		t.Fatalf("per op %v, want only Range 4", per)
	}
	if EtcdCallsPerOp(got, after, 0) != nil {
		t.Fatal("per op of no ops")
	}
	if s := EtcdCallsText(map[string]float64{"Txn": 2, "Range": 4, "fsync": 0.4, "DeleteRange": 2}); s != "Range 4.00, DeleteRange 2.00, Txn 2.00, fsync 0.40" {
		t.Fatalf("text %q", s)
	}
	if _, err := EtcdCalls(srv.URL + "/nothing"); err == nil {
		t.Fatal("a 404 /metrics: no error")
	}
}
