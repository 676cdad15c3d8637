package apiserver

import (
	"context"
	"errors"
	"io"
	"sync"
	"syscall"

	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
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
	var mu sync.Mutex
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
	})
	if err != nil && res.Member == "" {
		return errgrpc.ToGRPC(err)
	}
	exit := &apiv1.RunExit{Status: int32(res.Status), Member: res.Member, ForkId: res.ForkID,
		ClaimMs: float64(res.ClaimLatency.Microseconds()) / 1000}
	if !res.Root.IsZero() {
		exit.Root = res.Root.String()
	}
	mu.Lock()
	defer mu.Unlock()
	return stream.Send(&apiv1.RunResponse{Msg: &apiv1.RunResponse_Exit{Exit: exit}})
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
