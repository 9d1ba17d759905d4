package etcd_test

// Attacks on the etcd backend (attack_*_test.go): a hostile client and an
// operator who kills things at the worst moment. Each test waits for states
// (liveness bounds only) and fails when a rule of docs/DESIGN.md is broken.

import (
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dlock/dlock/lock"
	"github.com/dlock/dlock/lock/etcd"
)

var refsInEtcd = etcd.ReferencesInEtcd{}

// newBackend opens a backend on cli's etcd at prefix p, closed at cleanup.
func newBackend(t *testing.T, cli *clientv3.Client, p string, cfg lock.Config) *etcd.Backend {
	t.Helper()
	b, err := etcd.New(t.Context(), cli, p, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}
