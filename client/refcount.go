package client

import (
	"context"
	"net/url"

	"github.com/dlock/dlock/api"
	"github.com/dlock/dlock/lock"
)

// Status describes a key. As the client's node, it also gets this node's
// queue position and renews its ttl lease on the key.
func (c *Client) Status(ctx context.Context, t lock.Type, resource string) (api.StatusResponse, error) {
	if err := c.init(); err != nil {
		return api.StatusResponse{}, err
	}
	return c.status(ctx, lock.Key{Type: t, Resource: resource}, true)
}

// RefCount returns a resource's references.
func (c *Client) RefCount(ctx context.Context, resource string) (api.RefCountResponse, error) {
	if err := c.init(); err != nil {
		return api.RefCountResponse{}, err
	}
	var rc api.RefCountResponse
	err := c.call(ctx, "GET", "/refcount", url.Values{"resource_id": {resource}}, nil, &rc)
	return rc, err
}

// AddRef records that this node uses resource (one it did not pull itself).
func (c *Client) AddRef(ctx context.Context, resource string) (api.RefCountResponse, error) {
	if err := c.init(); err != nil {
		return api.RefCountResponse{}, err
	}
	var rc api.RefCountResponse
	err := c.call(ctx, "POST", "/refcount/add", nil, api.RefRequest{ResourceID: resource, NodeID: c.Node}, &rc)
	return rc, err
}

// ReleaseRef records that this node no longer uses resource.
func (c *Client) ReleaseRef(ctx context.Context, resource string) (api.RefCountResponse, error) {
	if err := c.init(); err != nil {
		return api.RefCountResponse{}, err
	}
	var rc api.RefCountResponse
	err := c.call(ctx, "POST", "/refcount/release", nil, api.RefRequest{ResourceID: resource, NodeID: c.Node}, &rc)
	return rc, err
}

// ReleaseAllRefs releases every reference of this node (a decommissioned
// node) and returns how many there were.
func (c *Client) ReleaseAllRefs(ctx context.Context) (int, error) {
	if err := c.init(); err != nil {
		return 0, err
	}
	var res api.ReleaseNodeResponse
	err := c.call(ctx, "POST", "/refcount/release", nil, api.RefRequest{NodeID: c.Node}, &res)
	return res.Released, err
}
