package main

import (
	"fmt"

	"github.com/containerd/errdefs"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/durationpb"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/internal/branchcmd"
	"github.com/tidepool-dev/tidepool/localapi"
)

// branchFlags are fork's flags for branching a running container.
type branchFlags struct {
	container, namespace string
	count                int
	json                 bool
}

func defaultNamespace() string { return branchcmd.DefaultNamespace() }

func (a *app) forkContainer(cmd *cobra.Command, req forks.CreateRequest, br branchFlags) error {
	ctx := cmd.Context()
	if br.count < 1 {
		return fmt.Errorf("--count %d: want at least 1: %w", br.count, errdefs.ErrInvalidArgument)
	}
	c, err := a.daemon(ctx)
	if err != nil {
		return fmt.Errorf("fork --container needs tidepoold: %w", err)
	}
	if req.RequestID == "" {
		req.RequestID = forks.NewRequestID()
	}
	r := &apiv1.ForkContainerRequest{
		Namespace: br.namespace, ContainerId: br.container, Count: int32(br.count),
		Label: req.Label, Labels: req.Labels, RequestId: req.RequestID,
	}
	if req.TTL != 0 {
		r.Ttl = durationpb.New(req.TTL)
	}
	res, err := c.ForkContainer(ctx, r)
	if err != nil {
		if errdefs.IsUnavailable(err) {
			return fmt.Errorf("%w: the forks may have been made; run again with --request-id %s to get them without making duplicates", err, req.RequestID)
		}
		return err
	}
	out, err := localapi.Branched(res)
	if err != nil {
		return err
	}
	return branchcmd.Print(cmd.OutOrStdout(), out, br.json)
}
