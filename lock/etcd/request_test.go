package etcd

import (
	"context"
	"testing"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// capture is a KV remote that keeps the request clientv3 made.
type capture struct {
	pb.KVClient
	got *pb.TxnRequest
}

func (c *capture) Txn(_ context.Context, in *pb.TxnRequest, _ ...grpc.CallOption) (*pb.TxnResponse, error) {
	c.got = in
	return &pb.TxnResponse{Header: &pb.ResponseHeader{}}, nil
}

// TestGroupRequestAsClientv3: the request groupRequest makes, and the one
// sendRequest sends, is the one clientv3's builders make of the same guards
// and operations, for every kind of guard and operation this package puts
// in a transaction; a kind it cannot make leaves the request to clientv3.
func TestGroupRequestAsClientv3(t *testing.T) {
	cmps := []clientv3.Cmp{
		clientv3.Compare(clientv3.ModRevision("/p/k/pull/a"), "=", 12),
		clientv3.Compare(clientv3.CreateRevision("/p/dropped"), "=", 0),
		clientv3.Compare(clientv3.ModRevision("/p/dropped"), "<", 13),
		clientv3.Compare(clientv3.Value("/p/n/x/pull/a"), "=", "7f"),
		clientv3.Compare(clientv3.Version("/p/s/x"), ">", 0),
	}
	ops := []clientv3.Op{
		clientv3.OpPut("/p/k/pull/a", `{"h":"x","t":3}`),
		clientv3.OpPut("/p/q/pull/a/0000000000000001/x", ""),
		clientv3.OpDelete("/p/q/pull/a/0000000000000001/x"),
		clientv3.OpDelete("/p/q/pull/a/", clientv3.WithPrefix()),
		clientv3.OpDelete("/p/r/a", clientv3.WithPrevKV()),
		clientv3.OpGet("/p/k/pull/a", clientv3.WithCountOnly()),
	}
	els := []clientv3.Op{
		clientv3.OpGet("/p/k/pull/a"),
		clientv3.OpGet("/p/q/pull/a/", clientv3.WithPrefix(), clientv3.WithLimit(7), clientv3.WithRev(9)),
		clientv3.OpGet("/p/q/pull/a/", clientv3.WithRange("/p/q/pull/a/0000000000000009"), clientv3.WithCountOnly(), clientv3.WithKeysOnly(), clientv3.WithSerializable()),
		clientv3.OpGet("/p/n/x/", clientv3.WithPrefix(), clientv3.WithMinModRev(3), clientv3.WithMaxModRev(8), clientv3.WithMinCreateRev(2), clientv3.WithMaxCreateRev(7)),
	}
	group := []*pending{
		newPending(cmps, ops, els),
		newPending(cmps[:1], ops[:1], nil),
		newPending(nil, nil, els[:1]),
	}

	want := &capture{}
	nested := make([]clientv3.Op, len(group))
	for i, p := range group {
		nested[i] = clientv3.OpTxn(p.cmps, p.ops, p.els)
	}
	if _, err := clientv3.NewKVFromKVClient(want, nil).Txn(context.Background()).Then(nested...).Commit(); err != nil {
		t.Fatal(err)
	}
	req, ok := groupRequest(group)
	if !ok {
		t.Fatal("groupRequest left a request of its kinds to clientv3")
	}
	if !proto.Equal(req, want.got) {
		t.Fatalf("groupRequest made\n%v\nclientv3 makes\n%v", req, want.got)
	}
	sent := &capture{}
	if _, err := sendRequest(context.Background(), nil, sent, req); err != nil || sent.got != req {
		t.Fatalf("sendRequest sent %v (%v), not the request made", sent.got, err)
	}

	one := &capture{}
	p := group[0]
	if _, err := clientv3.NewKVFromKVClient(one, nil).Txn(context.Background()).If(p.cmps...).Then(p.ops...).Else(p.els...).Commit(); err != nil {
		t.Fatal(err)
	}
	if r, ok := txnRequest(p); !ok || !proto.Equal(r, one.got) {
		t.Fatalf("txnRequest made\n%v\nclientv3 makes\n%v", r, one.got)
	}

	// The transactions of txnLeased: their one put attaches its lease, and
	// a group of them (sessions put on the home lease) is made as clientv3
	// makes it, lease and all.
	homed := []*pending{
		newLeasedPending(cmps[:1], "/p/s/x", `{"l":"7","h":"5"}`, 0x5, els[:1]),
		newLeasedPending(cmps[1:2], "/p/s/y", `{"l":"7"}`, 0x7fffffffffffffff, nil),
		newLeasedPending(nil, "/p/s/z", "", 0, els[:1]),
	}
	for _, p := range homed {
		p.leased = true
	}
	wantHomed := &capture{}
	nestedHomed := []clientv3.Op{
		clientv3.OpTxn(cmps[:1], []clientv3.Op{clientv3.OpPut("/p/s/x", `{"l":"7","h":"5"}`, clientv3.WithLease(0x5))}, els[:1]),
		clientv3.OpTxn(cmps[1:2], []clientv3.Op{clientv3.OpPut("/p/s/y", `{"l":"7"}`, clientv3.WithLease(0x7fffffffffffffff))}, nil),
		clientv3.OpTxn(nil, []clientv3.Op{clientv3.OpPut("/p/s/z", "")}, els[:1]),
	}
	if _, err := clientv3.NewKVFromKVClient(wantHomed, nil).Txn(context.Background()).Then(nestedHomed...).Commit(); err != nil {
		t.Fatal(err)
	}
	if req, ok := groupRequest(homed); !ok || !proto.Equal(req, wantHomed.got) {
		t.Fatalf("groupRequest made of leased puts (%v)\n%v\nclientv3 makes\n%v", ok, req, wantHomed.got)
	}
	if req := wantHomed.got.Success[0].GetRequestTxn().Success[0].GetRequestPut(); req.Lease != 0x5 {
		t.Fatalf("clientv3's put attaches lease %x, want 5: the comparison above would not see a lost lease", req.Lease)
	}

	for _, odd := range []*pending{
		newPending(nil, []clientv3.Op{clientv3.OpGet("/p/q/", clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend))}, nil),
		newPending(nil, []clientv3.Op{clientv3.OpTxn(nil, nil, nil)}, nil),
		{leased: true, ops: []clientv3.Op{clientv3.OpPut("/p/s/x", "", clientv3.WithLease(5))}},
	} {
		if _, ok := groupRequest([]*pending{group[1], odd}); ok {
			t.Errorf("groupRequest made a request of %v, whose kind it does not make", odd.ops)
		}
		// Beside a leased put whose lease it knows, too: the group is
		// clientv3's, which carries both leases.
		if _, ok := groupRequest([]*pending{homed[0], odd}); ok {
			t.Errorf("groupRequest made a request of %v beside a put of known lease", odd.ops)
		}
	}
}
