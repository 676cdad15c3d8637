package apiserver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
	"syscall"

	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/timestamppb"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
	"github.com/tidepool-dev/tidepool/localapi"
	"github.com/tidepool-dev/tidepool/pool"
)

type poolsServer struct {
	apiv1.UnimplementedPoolsServer
	*Server
}

// streamWriter sends what the workload writes as stdout or stderr messages.
type streamWriter struct {
	mu     *sync.Mutex
	stream apiv1.Pools_RunServer
	stderr bool
}

func (w streamWriter) Write(p []byte) (int, error) {
	msg := &apiv1.RunResponse{}
	b := append([]byte(nil), p...)
	if w.stderr {
		msg.Msg = &apiv1.RunResponse_Stderr{Stderr: b}
	} else {
		msg.Msg = &apiv1.RunResponse_Stdout{Stdout: b}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if err := w.stream.Send(msg); err != nil {
		return 0, err
	}
	return len(p), nil
}

// Run serves one explicit claim: the first message starts it, later ones carry stdin
// and signals; the caller going away kills the workload (its changes still commit).
func (s poolsServer) Run(stream apiv1.Pools_RunServer) error {
	if s.Pools == nil {
		return errgrpc.ToGRPC(errors.New("this tidepoold has no pools"))
	}
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	start := first.GetStart()
	if start == nil {
		return errgrpc.ToGRPC(errdefs.ErrInvalidArgument.WithMessage("the first run message must be a start"))
	}
	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()
	stdinR, stdinW := io.Pipe()
	signals := make(chan syscall.Signal, 4)
	go func() {
		defer stdinW.Close()
		for {
			msg, err := stream.Recv()
			if err != nil {
				if err != io.EOF {
					cancel()
				}
				return
			}
			switch m := msg.Msg.(type) {
			case *apiv1.RunRequest_Stdin:
				if _, err := stdinW.Write(m.Stdin); err != nil {
					return
				}
			case *apiv1.RunRequest_StdinClose:
				stdinW.Close()
			case *apiv1.RunRequest_Signal:
				select {
				case signals <- syscall.Signal(m.Signal):
				default:
				}
			}
		}
	}()
	var (
		mu   sync.Mutex
		sent bool
	)
	send := func(res pool.RunResult) error {
		exit := &apiv1.RunExit{Status: int32(res.Status), Member: res.Member, ForkId: res.ForkID,
			ClaimMs: float64(res.ClaimLatency.Microseconds()) / 1000}
		if !res.Root.IsZero() {
			exit.Root = res.Root.String()
		}
		steps := make([]localapi.Step, len(res.Steps))
		for i, st := range res.Steps {
			steps[i] = localapi.Step{Name: st.Name, Duration: st.Duration}
		}
		stream.SetTrailer(metadata.Pairs(localapi.RunStepsTrailer, localapi.FormatSteps(steps)))
		mu.Lock()
		defer mu.Unlock()
		sent = true
		return stream.Send(&apiv1.RunResponse{Msg: &apiv1.RunResponse_Exit{Exit: exit}})
	}
	var sendErr error
	res, err := s.Pools.Run(ctx, pool.RunSpec{
		Pool: start.GetPool(), Fork: start.GetFork(), Env: start.GetEnv(), Workdir: start.GetWorkdir(),
		Args: start.GetArgs(), Discard: start.GetDiscard(),
	}, pool.RunIO{
		Stdin: stdinR, Stdout: streamWriter{&mu, stream, false}, Stderr: streamWriter{&mu, stream, true},
		Signals: signals,
		Started: func(member string) {
			mu.Lock()
			defer mu.Unlock()
			stream.Send(&apiv1.RunResponse{Msg: &apiv1.RunResponse_Started{Started: member}})
		},
		// The exit goes out before the member is torn down.
		Finished: func(res pool.RunResult) { sendErr = send(res) },
	})
	if err != nil && res.Member == "" {
		return errgrpc.ToGRPC(err)
	}
	if sent {
		return sendErr
	}
	return send(res)
}

func (s poolsServer) List(context.Context, *apiv1.ListPoolsRequest) (*apiv1.ListPoolsResponse, error) {
	out := &apiv1.ListPoolsResponse{}
	if s.Pools == nil {
		return out, nil
	}
	for _, st := range s.Pools.List() {
		out.Pools = append(out.Pools, &apiv1.PoolStatus{Name: st.Name, Image: st.Image, Idle: int32(st.Idle),
			Claimed: int32(st.Claimed), Starting: int32(st.Starting), Min: int32(st.Min), Target: int32(st.Target), Max: int32(st.Max)})
	}
	return out, nil
}

func (s poolsServer) Adopt(ctx context.Context, r *apiv1.AdoptRequest) (*apiv1.AdoptResponse, error) {
	if s.Pools == nil {
		return &apiv1.AdoptResponse{ColdReason: "no_pools"}, nil
	}
	var spec specs.Spec
	if err := json.Unmarshal(r.GetSpec(), &spec); err != nil {
		return nil, errgrpc.ToGRPC(fmt.Errorf("container spec: %v: %w", err, errdefs.ErrInvalidArgument))
	}
	a, err := s.Pools.Adopt(ctx, pool.AdoptRequest{
		Pool: r.GetPool(), ContainerID: r.GetContainerId(), Rootfs: localapi.MountsFromProto(r.GetRootfs()), Spec: &spec,
		Fork: r.GetFork(), Workdir: r.GetWorkdir(), Owner: r.GetOwner(), Discard: r.GetDiscard(), Runtime: r.GetRuntime(),
	})
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	resp := &apiv1.AdoptResponse{ColdReason: a.ColdReason, Member: a.Member, Pid: a.Pid, ControlSocket: a.ControlSocket, ForkId: a.ForkID}
	if !a.Root.IsZero() {
		resp.Root = a.Root.String()
	}
	return resp, nil
}

func (s poolsServer) StartMember(ctx context.Context, r *apiv1.MemberRequest) (*emptypb.Empty, error) {
	return s.member(func() error { return s.Pools.StartMember(ctx, r.GetMember()) })
}

func (s poolsServer) SignalMember(ctx context.Context, r *apiv1.SignalMemberRequest) (*emptypb.Empty, error) {
	return s.member(func() error {
		return s.Pools.SignalMember(ctx, r.GetMember(), syscall.Signal(r.GetSignal()), r.GetAll())
	})
}

func (s poolsServer) PauseMember(ctx context.Context, r *apiv1.PauseMemberRequest) (*emptypb.Empty, error) {
	return s.member(func() error { return s.Pools.PauseMember(ctx, r.GetMember(), r.GetPause()) })
}

func (s poolsServer) ReleaseMember(ctx context.Context, r *apiv1.MemberRequest) (*emptypb.Empty, error) {
	return s.member(func() error { return s.Pools.ReleaseMember(ctx, r.GetMember()) })
}

func (s poolsServer) WaitMember(ctx context.Context, r *apiv1.MemberRequest) (*apiv1.WaitMemberResponse, error) {
	if s.Pools == nil {
		return nil, errgrpc.ToGRPC(errdefs.ErrNotFound.WithMessage("this tidepoold has no pools"))
	}
	st, err := s.Pools.WaitMember(ctx, r.GetMember())
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return &apiv1.WaitMemberResponse{ExitStatus: st.ExitCode(), ExitedAt: timestamppb.New(st.ExitTime())}, nil
}

func (s poolsServer) member(fn func() error) (*emptypb.Empty, error) {
	if s.Pools == nil {
		return nil, errgrpc.ToGRPC(errdefs.ErrNotFound.WithMessage("this tidepoold has no pools"))
	}
	if err := fn(); err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return &emptypb.Empty{}, nil
}
