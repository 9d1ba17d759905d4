package etcd

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/dlock/dlock/lock"
)

// TestEtcdErrUnavailable: etcd's answers during an election, which the
// client hands over as rpctypes.EtcdError rather than as a gRPC status,
// are lock.ErrUnavailable (503: try again), not an internal error.
func TestEtcdErrUnavailable(t *testing.T) {
	b := &Backend{}
	for _, err := range []error{
		rpctypes.ErrTimeout, rpctypes.ErrTimeoutDueToLeaderFail, rpctypes.ErrNoLeader,
		rpctypes.ErrLeaderChanged, rpctypes.ErrGRPCNoLeader, fmt.Errorf("wrapped: %w", rpctypes.ErrTimeout),
		// A member without a quorum, when the request's deadline passes.
		status.Error(codes.Unknown, context.DeadlineExceeded.Error()),
	} {
		if got := b.etcdErr("x", err); !errors.Is(got, lock.ErrUnavailable) {
			t.Errorf("%v: %v, want lock.ErrUnavailable", err, got)
		}
	}
	if got := b.etcdErr("x", context.Canceled); !errors.Is(got, context.Canceled) {
		t.Errorf("context.Canceled: %v", got)
	}
	if got := b.etcdErr("x", status.Error(codes.Unknown, "something else")); errors.Is(got, lock.ErrUnavailable) {
		t.Errorf("Unknown: %v, want no ErrUnavailable", got)
	}
	if got := b.etcdErr("x", rpctypes.ErrKeyNotFound); errors.Is(got, lock.ErrUnavailable) {
		t.Errorf("ErrKeyNotFound: %v, want no ErrUnavailable", got)
	}
}
