package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"

	"github.com/containerd/errdefs"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/durationpb"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/localapi"
)

// branchFlags are fork's flags for branching a running container.
type branchFlags struct {
	container, namespace string
	count                int
	json                 bool
}

func defaultNamespace() string {
	if ns := os.Getenv("CONTAINERD_NAMESPACE"); ns != "" {
		return ns
	}
	return "default"
}

// branchJSON is `tidepool fork --container --json`'s output.
type branchJSON struct {
	Container   string        `json:"container"`
	Namespace   string        `json:"namespace"`
	SnapshotKey string        `json:"snapshot_key"`
	ForkID      string        `json:"fork_id"`
	Base        string        `json:"base"`
	Root        string        `json:"root"`
	Forks       []*forks.Fork `json:"forks"`
	Pause       string        `json:"pause"`
	PausedMs    float64       `json:"paused_ms"`
	WalkMs      float64       `json:"walk_ms"`
	TotalMs     float64       `json:"total_ms"`
	Files       int64         `json:"files"`
	LookupMs    float64       `json:"lookup_ms"`
	FreezeMs    float64       `json:"freeze_ms"`
	PublishMs   float64       `json:"publish_ms"`
	RecordMs    float64       `json:"record_ms"`
}

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
	out := branchJSON{
		Container: res.GetContainerId(), Namespace: res.GetNamespace(), SnapshotKey: res.GetSnapshotKey(),
		ForkID: res.GetForkId(), Base: res.GetBase(), Root: res.GetRoot(), Pause: res.GetPause(),
		PausedMs: res.GetPausedMs(), WalkMs: res.GetWalkMs(), TotalMs: res.GetTotalMs(), Files: res.GetFiles(),
		LookupMs: res.GetLookupMs(), FreezeMs: res.GetFreezeMs(), PublishMs: res.GetPublishMs(), RecordMs: res.GetRecordMs(),
	}
	for _, p := range res.GetForks() {
		f, err := localapi.ForkFromProto(p)
		if err != nil {
			return err
		}
		out.Forks = append(out.Forks, f)
	}
	w := cmd.OutOrStdout()
	if br.json {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(out)
	}
	for _, f := range out.Forks {
		fmt.Fprintln(w, strings.TrimSpace(fmt.Sprintf("%s %s %s", f.ID, f.Root, f.Label)))
	}
	return nil
}
