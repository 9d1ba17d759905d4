package etcdtest

import (
	"context"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(M(m), GoleakOptions()...)
}

func TestEmbeddedPutGet(t *testing.T) {
	start := time.Now()
	s := StartEmbedded(t)
	t.Logf("embedded etcd ready in %v at %v", time.Since(start), s.Endpoints())
	c := s.Client(t)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	p := Prefix(t)
	if _, err := c.Put(ctx, p+"k", "v"); err != nil {
		t.Fatal(err)
	}
	r, err := c.Get(ctx, p+"k")
	if err != nil || len(r.Kvs) != 1 || string(r.Kvs[0].Value) != "v" {
		t.Fatalf("get: %+v %v", r, err)
	}
}

func TestSharedPutGet(t *testing.T) {
	start := time.Now()
	s := Shared(t)
	t.Logf("shared etcd ready in %v at %v", time.Since(start), s.Endpoints())
	c := s.Client(t)
	p := Prefix(t)
	if _, err := c.Put(t.Context(), p+"k", "v"); err != nil {
		t.Fatal(err)
	}
}
