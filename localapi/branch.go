package localapi

import (
	"context"
	"encoding/json"

	"github.com/containerd/errdefs/pkg/errgrpc"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
	"github.com/tidepool-dev/tidepool/localapi/runwire"
)

// ForkContainer asks the daemon to branch a running container into new forks.
func (c *Client) ForkContainer(ctx context.Context, req *apiv1.ForkContainerRequest) (*apiv1.ForkContainerResponse, error) {
	r, err := apiv1.NewContainersClient(c.conn).Fork(ctx, req)
	return r, errgrpc.ToNative(err)
}

// Branched is the answer to a branch as both CLIs print it (runwire.Branched): the
// full CLI from the gRPC answer, tidepoold's run socket for the front binary.
func Branched(res *apiv1.ForkContainerResponse) (*runwire.Branched, error) {
	out := &runwire.Branched{
		Container: res.GetContainerId(), Namespace: res.GetNamespace(), SnapshotKey: res.GetSnapshotKey(),
		ForkID: res.GetForkId(), Base: res.GetBase(), Root: res.GetRoot(), Pause: res.GetPause(),
		PausedMs: res.GetPausedMs(), WalkMs: res.GetWalkMs(), TotalMs: res.GetTotalMs(), Files: res.GetFiles(),
		LookupMs: res.GetLookupMs(), FreezeMs: res.GetFreezeMs(), PublishMs: res.GetPublishMs(), RecordMs: res.GetRecordMs(),
		Forks: []json.RawMessage{},
	}
	for _, p := range res.GetForks() {
		f, err := ForkFromProto(p)
		if err != nil {
			return nil, err
		}
		b, err := json.Marshal(f)
		if err != nil {
			return nil, err
		}
		out.Forks = append(out.Forks, b)
	}
	return out, nil
}
