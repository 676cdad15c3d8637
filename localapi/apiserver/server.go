// Package apiserver serves tidepoold's local API (api/v1) over the daemon's
// components; localapi is its client.
package apiserver

import (
	"context"
	"os"

	"github.com/containerd/errdefs/pkg/errgrpc"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/localapi"
	"github.com/tidepool-dev/tidepool/pool"
	"github.com/tidepool-dev/tidepool/snapshotter"
)

// Version is reported by Info; set by the linker for releases.
var Version = "dev"

// Roots supplies the fork records and every live root.
type Roots interface {
	forks.Service
	LiveRoots() ([]casstore.Hash, error)
}

// Server implements the api/v1 services over the daemon's components.
type Server struct {
	Forks       Roots
	Snapshotter *snapshotter.Snapshotter
	// Pools serves warm-pool claims; nil when pools are not in use.
	Pools *pool.Controller
	Info  *apiv1.InfoResponse
	// ContainerdAddress is where containers are found for Containers.Fork.
	ContainerdAddress string

	ctrd containerdConn
}

// Register adds every service to g. It also makes Server a containerd gRPC plugin
// instance, so a containerd with Tidepool built in serves the API on its own socket.
func (s *Server) Register(g *grpc.Server) error {
	apiv1.RegisterForksServer(g, forksServer{Server: s})
	apiv1.RegisterSnapshotsServer(g, snapshotsServer{Server: s})
	apiv1.RegisterDaemonServer(g, daemonServer{Server: s})
	apiv1.RegisterPoolsServer(g, poolsServer{Server: s})
	apiv1.RegisterContainersServer(g, containersServer{Server: s})
	return nil
}

type forksServer struct {
	apiv1.UnimplementedForksServer
	*Server
}

func (s forksServer) Create(ctx context.Context, r *apiv1.CreateForkRequest) (*apiv1.Fork, error) {
	base, err := localapi.ParseHash("base", r.GetBase())
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	req := forks.CreateRequest{Base: base, Label: r.GetLabel(), Labels: r.GetLabels()}
	if r.GetTtl() != nil {
		req.TTL = r.GetTtl().AsDuration()
	}
	f, err := s.Forks.Create(ctx, req)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	s.arrived(f)
	return localapi.ForkToProto(f), nil
}

func (s forksServer) Get(ctx context.Context, r *apiv1.GetForkRequest) (*apiv1.Fork, error) {
	f, err := s.Forks.Get(ctx, r.GetRef())
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return localapi.ForkToProto(f), nil
}

func (s forksServer) List(ctx context.Context, _ *apiv1.ListForksRequest) (*apiv1.ListForksResponse, error) {
	list, err := s.Forks.List(ctx)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	out := &apiv1.ListForksResponse{}
	for _, f := range list {
		out.Forks = append(out.Forks, localapi.ForkToProto(f))
	}
	return out, nil
}

func (s forksServer) Remove(ctx context.Context, r *apiv1.RemoveForkRequest) (*emptypb.Empty, error) {
	if err := s.Forks.Remove(ctx, r.GetId()); err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return &emptypb.Empty{}, nil
}

func (s forksServer) Advance(ctx context.Context, r *apiv1.AdvanceForkRequest) (*apiv1.Fork, error) {
	expect, err := localapi.ParseOptionalHash("expect", r.GetExpect())
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	root, err := localapi.ParseHash("root", r.GetRoot())
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	f, err := s.Forks.Advance(ctx, r.GetId(), expect, root, r.GetReason())
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	s.arrived(f)
	return localapi.ForkToProto(f), nil
}

// arrived tells the snapshotter of the root a fork made or moved through the API now
// holds (a pulled ref, a CLI commit), so that containers run on it find its view
// prepared.
func (s forksServer) arrived(f *forks.Fork) {
	if s.Snapshotter != nil {
		s.Snapshotter.RootArrived(f.Root)
	}
}

func (s forksServer) LiveRoots(context.Context, *apiv1.LiveRootsRequest) (*apiv1.LiveRootsResponse, error) {
	roots, err := s.Forks.LiveRoots()
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	out := &apiv1.LiveRootsResponse{}
	for _, h := range roots {
		out.Roots = append(out.Roots, h.String())
	}
	return out, nil
}

type snapshotsServer struct {
	apiv1.UnimplementedSnapshotsServer
	*Server
}

func (s snapshotsServer) Bind(ctx context.Context, r *apiv1.BindRequest) (*apiv1.BindResponse, error) {
	res, err := s.Snapshotter.Bind(ctx, snapshotter.BindRequest{
		Key: r.GetKey(), Rootfs: localapi.MountsFromProto(r.GetRootfs()),
		Fork: r.GetFork(), Workdir: r.GetWorkdir(), Owner: r.GetOwner(), Discard: r.GetDiscard(),
	})
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return &apiv1.BindResponse{Key: res.Key, ForkId: res.ForkID, Root: res.Root.String(), Mounts: localapi.MountsToProto(res.Mounts)}, nil
}

func (s snapshotsServer) List(ctx context.Context, _ *apiv1.ListSnapshotsRequest) (*apiv1.ListSnapshotsResponse, error) {
	list, err := s.Snapshotter.List(ctx)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	out := &apiv1.ListSnapshotsResponse{}
	for _, b := range list {
		p := &apiv1.Snapshot{Key: b.Key, Id: b.ID, Kind: b.Kind, Parent: b.Parent, ForkId: b.ForkID,
			Workdir: b.Workdir, Owner: b.Owner, ViewMounted: b.ViewMounted, Discard: b.Discard}
		if !b.Root.IsZero() {
			p.Root = b.Root.String()
		}
		out.Snapshots = append(out.Snapshots, p)
	}
	return out, nil
}

type daemonServer struct {
	apiv1.UnimplementedDaemonServer
	*Server
}

func (s daemonServer) Info(context.Context, *apiv1.InfoRequest) (*apiv1.InfoResponse, error) {
	info := proto.Clone(s.Server.Info).(*apiv1.InfoResponse)
	info.Version = Version
	info.Pid = int32(os.Getpid())
	return info, nil
}

// RootArrived prepares the views of a root a client put in the store itself, as
// forksServer does for the roots of forks made or moved through the API. It only
// queues work, so it answers at once.
func (s daemonServer) RootArrived(_ context.Context, r *apiv1.RootArrivedRequest) (*emptypb.Empty, error) {
	root, err := localapi.ParseHash("root", r.GetRoot())
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	if s.Snapshotter != nil {
		s.Snapshotter.RootArrived(root)
	}
	return &emptypb.Empty{}, nil
}
