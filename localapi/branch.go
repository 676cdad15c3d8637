package localapi

import (
	"context"

	"github.com/containerd/errdefs/pkg/errgrpc"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
)

// ForkContainer asks the daemon to branch a running container into new forks.
func (c *Client) ForkContainer(ctx context.Context, req *apiv1.ForkContainerRequest) (*apiv1.ForkContainerResponse, error) {
	r, err := apiv1.NewContainersClient(c.conn).Fork(ctx, req)
	return r, errgrpc.ToNative(err)
}
