package etcd

import (
	"context"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
)

// A grouped request made with clientv3's own builders copies every guard
// three times, each by reflection (clientv3.Compare, OpTxn, and again when
// the request is made): a fifth of the server's CPU on a busy key's path.
// groupRequest makes the same request from the guards and operations as
// they are, for the kinds of operation a group holds.

// groupRequest is the request of group, one nested transaction each; ok
// false when an operation is of a kind it does not make, and the request
// must be made by clientv3 (OpTxn).
func groupRequest(group []*pending) (*pb.TxnRequest, bool) {
	nested := make([]*pb.RequestOp, len(group))
	for i, p := range group {
		t, ok := txnRequest(p)
		if !ok {
			return nil, false
		}
		nested[i] = &pb.RequestOp{Request: &pb.RequestOp_RequestTxn{RequestTxn: t}}
	}
	return &pb.TxnRequest{Success: nested}, true
}

// txnRequest is p's transaction as a request of its own, or nested in a
// group's.
func txnRequest(p *pending) (*pb.TxnRequest, bool) {
	if p.leased && !p.madeLeased {
		return nil, false // a put's lease cannot be read from its Op
	}
	t := &pb.TxnRequest{Compare: make([]*pb.Compare, len(p.cmps))}
	for j := range p.cmps {
		t.Compare[j] = p.cmps[j].GetCompare() // read only, as the request is sent
	}
	var ok bool
	if t.Success, ok = requestOps(p.ops, p.lease); !ok {
		return nil, false
	}
	if t.Failure, ok = requestOps(p.els, 0); !ok {
		return nil, false
	}
	return t, true
}

// requestOps is ops as clientv3 sends them, every put attaching lease (0:
// none).
func requestOps(ops []clientv3.Op, lease int64) ([]*pb.RequestOp, bool) {
	out := make([]*pb.RequestOp, len(ops))
	for i, op := range ops {
		var ok bool
		if out[i], ok = requestOp(op, lease); !ok {
			return nil, false
		}
	}
	return out, true
}

// requestOp is op as clientv3 sends it, for a put (attaching lease, which
// clientv3.Op does not show: the caller knows it, txnLeased), a delete,
// and a range read without a sort order, whose fields clientv3.Op shows.
// The ops this package makes of each kind are checked against clientv3's
// request in TestGroupRequestAsClientv3.
func requestOp(op clientv3.Op, lease int64) (*pb.RequestOp, bool) {
	switch {
	case op.IsPut():
		r := &pb.PutRequest{Key: op.KeyBytes(), Value: op.ValueBytes(), PrevKv: op.IsPrevKV(), Lease: lease}
		return &pb.RequestOp{Request: &pb.RequestOp_RequestPut{RequestPut: r}}, true
	case op.IsDelete():
		r := &pb.DeleteRangeRequest{Key: op.KeyBytes(), RangeEnd: op.RangeBytes(), PrevKv: op.IsPrevKV()}
		return &pb.RequestOp{Request: &pb.RequestOp_RequestDeleteRange{RequestDeleteRange: r}}, true
	case op.IsGet() && !op.IsSortSet():
		r := &pb.RangeRequest{
			Key:               op.KeyBytes(),
			RangeEnd:          op.RangeBytes(),
			Limit:             op.Limit(),
			Revision:          op.Rev(),
			Serializable:      op.IsSerializable(),
			KeysOnly:          op.IsKeysOnly(),
			CountOnly:         op.IsCountOnly(),
			MinModRevision:    op.MinModRev(),
			MaxModRevision:    op.MaxModRev(),
			MinCreateRevision: op.MinCreateRev(),
			MaxCreateRevision: op.MaxCreateRev(),
		}
		return &pb.RequestOp{Request: &pb.RequestOp_RequestRange{RequestRange: r}}, true
	}
	return nil, false
}

// sendRequest commits req as clientv3's Txn().Commit() does (its client's
// call options, its retry policy, its errors): through clientv3's KV, with
// a remote that sends req in place of the empty request the KV makes.
func sendRequest(ctx context.Context, cli *clientv3.Client, remote pb.KVClient, req *pb.TxnRequest) (*clientv3.TxnResponse, error) {
	return clientv3.NewKVFromKVClient(madeRequest{remote, req}, cli).Txn(ctx).Commit()
}

type madeRequest struct {
	pb.KVClient
	req *pb.TxnRequest
}

func (m madeRequest) Txn(ctx context.Context, _ *pb.TxnRequest, opts ...grpc.CallOption) (*pb.TxnResponse, error) {
	return m.KVClient.Txn(ctx, m.req, opts...)
}
