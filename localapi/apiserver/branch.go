package apiserver

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	tasktypes "github.com/containerd/containerd/api/types/task"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/identifiers"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/log"
	"github.com/moby/locker"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/internal/freezer"
	"github.com/tidepool-dev/tidepool/localapi"
	"github.com/tidepool-dev/tidepool/snapshotter"
)

// freezeTimeout bounds how long a branch waits for a container's tasks to stop
// (tasks in an uninterruptible sleep delay the freezer); past it the container is
// thawed and the branch fails.
const freezeTimeout = 2 * time.Second

// containerdConn is the API server's own connection to containerd, made on first
// use (the pools' connection exists only when pools are configured).
type containerdConn struct {
	mu     sync.Mutex
	client *containerd.Client
	// branching serialises branches of one container: a second freeze would be
	// refused, and a thaw must not end another branch's pause.
	branching locker.Locker
}

func (s *Server) containerd() (*containerd.Client, error) {
	s.ctrd.mu.Lock()
	defer s.ctrd.mu.Unlock()
	if s.ctrd.client != nil {
		return s.ctrd.client, nil
	}
	if s.ContainerdAddress == "" {
		return nil, fmt.Errorf("tidepoold has no containerd_address to find containers at: %w", errdefs.ErrUnavailable)
	}
	cl, err := containerd.New(s.ContainerdAddress)
	if err != nil {
		return nil, fmt.Errorf("containerd at %s: %w", s.ContainerdAddress, errdefs.ErrUnavailable)
	}
	s.ctrd.client = cl
	return cl, nil
}

// Close releases the API server's containerd connection.
func (s *Server) Close() error {
	s.ctrd.mu.Lock()
	defer s.ctrd.mu.Unlock()
	if s.ctrd.client == nil {
		return nil
	}
	err := s.ctrd.client.Close()
	s.ctrd.client = nil
	return err
}

type containersServer struct {
	apiv1.UnimplementedContainersServer
	*Server
}

// Fork branches a running container (see api/v1 Containers.Fork).
func (s containersServer) Fork(ctx context.Context, r *apiv1.ForkContainerRequest) (*apiv1.ForkContainerResponse, error) {
	res, err := s.forkContainer(ctx, r)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return res, nil
}

func (s containersServer) forkContainer(ctx context.Context, r *apiv1.ForkContainerRequest) (*apiv1.ForkContainerResponse, error) {
	start := time.Now()
	id, ns := r.GetContainerId(), r.GetNamespace()
	if ns == "" {
		ns = namespaces.Default
	}
	if id == "" {
		return nil, fmt.Errorf("fork of a container: no container id: %w", errdefs.ErrInvalidArgument)
	}
	if err := forks.CheckLabel(r.GetLabel()); err != nil {
		return nil, err
	}
	if err := identifiers.Validate(ns); err != nil {
		return nil, fmt.Errorf("container %s: namespace %q: %w", id, ns, err)
	}
	name := ns + "/" + id
	cl, err := s.containerd()
	if err != nil {
		return nil, fmt.Errorf("container %s: %w", name, err)
	}
	cctx := namespaces.WithNamespace(ctx, ns)
	c, err := cl.ContainerService().Get(cctx, id)
	if err != nil {
		if errdefs.IsNotFound(err) {
			return nil, fmt.Errorf("container %s: no such container in containerd: %w", name, errdefs.ErrNotFound)
		}
		return nil, fmt.Errorf("container %s: %w", name, err)
	}
	if c.SnapshotKey == "" {
		return nil, fmt.Errorf("container %s has no snapshot (its rootfs is not a tidepool fork): %w", name, errdefs.ErrFailedPrecondition)
	}
	mounts, err := cl.SnapshotService(c.Snapshotter).Mounts(cctx, c.SnapshotKey)
	if err != nil {
		return nil, fmt.Errorf("container %s: mounts of snapshot %s in snapshotter %s: %w", name, c.SnapshotKey, c.Snapshotter, err)
	}
	key, err := s.Snapshotter.KeyFromMounts(ctx, mounts)
	if err != nil {
		return nil, fmt.Errorf("container %s: its rootfs (snapshotter %s) is not a tidepool snapshot: %v: %w", name, c.Snapshotter, err, errdefs.ErrFailedPrecondition)
	}

	lookup := time.Since(start)
	s.ctrd.branching.Lock(name)
	defer s.ctrd.branching.Unlock(name)
	tr, err := cl.TaskService().Get(cctx, &tasksapi.GetRequest{ContainerID: id})
	if err != nil {
		err = errgrpc.ToNative(err)
		if errdefs.IsNotFound(err) {
			return nil, fmt.Errorf("container %s is not running (no task): %w", name, errdefs.ErrFailedPrecondition)
		}
		return nil, fmt.Errorf("container %s: task: %w", name, err)
	}
	if st := tr.GetProcess().GetStatus(); st != tasktypes.Status_RUNNING {
		return nil, fmt.Errorf("container %s is not running (task %s): %w", name, strings.ToLower(st.String()), errdefs.ErrFailedPrecondition)
	}
	pause := "freezer"
	freeze := func(context.Context) (func() error, error) {
		cg, err := freezer.Of(int(tr.GetProcess().GetPid()))
		if err == nil {
			thaw, err := cg.Freeze(freezeTimeout)
			if err != nil {
				return nil, fmt.Errorf("container %s: %w", name, err)
			}
			return thaw, nil
		}
		if !errors.Is(err, freezer.ErrNoFreezer) {
			return nil, fmt.Errorf("container %s: %w", name, err)
		}
		// No freezer cgroup of its own to freeze (cgroup v2, a VM): containerd pauses it.
		pause = "task"
		if _, err := cl.TaskService().Pause(cctx, &tasksapi.PauseTaskRequest{ContainerID: id}); err != nil {
			return nil, fmt.Errorf("container %s: pause: %w", name, errgrpc.ToNative(err))
		}
		return func() error {
			// Resume even if the caller went away.
			rctx := namespaces.WithNamespace(context.WithoutCancel(ctx), ns)
			_, err := cl.TaskService().Resume(rctx, &tasksapi.ResumeTaskRequest{ContainerID: id})
			return errgrpc.ToNative(err)
		}, nil
	}
	req := snapshotter.BranchRequest{
		Key: key, Count: int(r.GetCount()), Label: r.GetLabel(), Labels: map[string]string{},
		RequestID: r.GetRequestId(), Reason: "branch of container " + name, Freeze: freeze,
	}
	for k, v := range r.GetLabels() {
		req.Labels[k] = v
	}
	req.Labels[LabelBranchOfContainer] = name
	if r.GetTtl() != nil {
		req.TTL = r.GetTtl().AsDuration()
	}
	res, err := s.Snapshotter.Branch(ctx, req)
	if err != nil {
		return nil, fmt.Errorf("container %s: %w", name, err)
	}
	out := &apiv1.ForkContainerResponse{
		ContainerId: id, Namespace: ns, SnapshotKey: res.Key, ForkId: res.ForkID, Base: res.Base.String(),
		Root: res.Root.String(), Pause: pause, Files: res.Stats.Files,
		PausedMs: ms(res.Paused), WalkMs: ms(res.Walk), TotalMs: ms(time.Since(start)),
		LookupMs: ms(lookup), FreezeMs: ms(res.Freeze), PublishMs: ms(res.Publish), RecordMs: ms(res.Record),
	}
	for _, f := range res.Forks {
		out.Forks = append(out.Forks, localapi.ForkToProto(f))
	}
	log.G(ctx).WithField("container", name).WithField("root", res.Root.Short()).WithField("forks", len(res.Forks)).
		WithField("paused", res.Paused).WithField("pause", pause).WithField("lookup", lookup).
		WithField("total", time.Since(start)).Info("branched a running container")
	return out, nil
}

// LabelBranchOfContainer is the fork label naming the container (namespace/id) a
// branch was taken from.
const LabelBranchOfContainer = "tidepool.dev/branch-of-container"

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
