package harness

import (
	"context"
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// CRI returns CRI runtime and image service clients on this instance's
// socket (started with Options.CRI), after a Version round trip. The
// connection closes with the instance. Pods should use a cgroup_parent the
// cleanup knows (TrackCgroup), e.g. "/" + Namespace + "-pods".
func (c *Containerd) CRI(ctx context.Context) (runtimeapi.RuntimeServiceClient, runtimeapi.ImageServiceClient, error) {
	conn, err := grpc.NewClient("unix://"+c.Address, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, nil, fmt.Errorf("CRI client: %w", err)
	}
	rt := runtimeapi.NewRuntimeServiceClient(conn)
	if _, err := rt.Version(ctx, &runtimeapi.VersionRequest{}); err != nil {
		conn.Close()
		return nil, nil, fmt.Errorf("CRI client (is Options.CRI set?): %w", err)
	}
	c.mu.Lock()
	c.closers = append(c.closers, conn.Close)
	c.mu.Unlock()
	return rt, runtimeapi.NewImageServiceClient(conn), nil
}
