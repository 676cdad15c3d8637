package apiserver

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"google.golang.org/protobuf/types/known/durationpb"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
	"github.com/tidepool-dev/tidepool/localapi"
	"github.com/tidepool-dev/tidepool/localapi/runwire"
	"github.com/tidepool-dev/tidepool/pool"
)

// ServeRun serves the run socket (package runwire) on l until l is closed: the fast
// path of `tidepool run`, which hands its stdio pipes over with the request. l must
// already refuse untrusted peers (peercred.Listener).
func (s *Server) ServeRun(ctx context.Context, l net.Listener) error {
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		c, err := l.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			return err
		}
		uc, ok := c.(*net.UnixConn)
		if !ok {
			c.Close()
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer uc.Close()
			s.serveRun(ctx, uc)
		}()
	}
}

func (s *Server) serveRun(ctx context.Context, c *net.UnixConn) {
	log := log.G(ctx).WithField("socket", "run")
	var first runwire.Request
	stdio, err := runwire.ReadFrame(c, &first, 3)
	if err != nil {
		log.WithError(err).Warn("run socket: unreadable request")
		return
	}
	defer closeFiles(stdio)
	fail := func(err error) {
		if werr := runwire.WriteFrame(c, runwire.Response{Error: wireError(err)}, nil); werr != nil {
			log.WithError(werr).Debug("run socket: the caller went away before the error")
		}
	}
	if first.Branch != nil {
		s.serveBranch(ctx, c, first.Branch, len(stdio))
		return
	}
	switch {
	case s.Pools == nil:
		fail(errdefs.ErrNotImplemented.WithMessage("this tidepoold has no pools"))
		return
	case first.Start == nil:
		fail(errdefs.ErrInvalidArgument.WithMessage("the first run frame must be a start"))
		return
	case len(stdio) != 3:
		fail(errdefs.ErrInvalidArgument.WithMessage("a run start carries the workload's stdin, stdout and stderr"))
		return
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	signals := make(chan syscall.Signal, 4)
	go func() {
		// Signals until the caller closes; a caller gone before the exit ends the run.
		for {
			var req runwire.Request
			if _, err := runwire.ReadFrame(c, &req, 0); err != nil {
				cancel()
				return
			}
			if req.Signal > 0 {
				select {
				case signals <- syscall.Signal(req.Signal):
				default:
				}
			}
		}
	}()
	var (
		mu   sync.Mutex
		sent bool
	)
	send := func(res pool.RunResult) {
		exit := &runwire.Exit{Status: res.Status, Member: res.Member, ForkID: res.ForkID,
			ClaimMs: float64(res.ClaimLatency.Microseconds()) / 1000}
		if !res.Root.IsZero() {
			exit.Root = res.Root.String()
		}
		for _, st := range res.Steps {
			exit.Steps = append(exit.Steps, runwire.Step{Name: st.Name, Ms: float64(st.Duration.Microseconds()) / 1000})
		}
		mu.Lock()
		defer mu.Unlock()
		sent = true
		if err := runwire.WriteFrame(c, runwire.Response{Exit: exit}, nil); err != nil {
			log.WithError(err).WithField("member", res.Member).Warn("run socket: the caller went away before the result")
		}
	}
	st := first.Start
	res, err := s.Pools.Run(ctx, pool.RunSpec{
		Pool: st.Pool, Fork: st.Fork, Env: st.Env, Workdir: st.Workdir, Args: st.Args, Discard: st.Discard,
	}, pool.RunIO{
		Stdio:   stdio,
		Signals: signals,
		Started: func(member string) {
			mu.Lock()
			defer mu.Unlock()
			runwire.WriteFrame(c, runwire.Response{Started: member}, nil)
		},
		// The exit goes out before the member is torn down.
		Finished: send,
	})
	switch {
	case err != nil && res.Member == "":
		fail(err)
	case !sent:
		send(res)
	}
}

// serveBranch answers a Branch frame, the front binary's `tidepool fork --container`,
// exactly as the API's Containers.Fork would.
func (s *Server) serveBranch(ctx context.Context, c *net.UnixConn, b *runwire.Branch, fds int) {
	resp := runwire.Response{}
	res, err := func() (*runwire.Branched, error) {
		if fds != 0 {
			return nil, errdefs.ErrInvalidArgument.WithMessage("a branch request carries no descriptors")
		}
		req := &apiv1.ForkContainerRequest{Namespace: b.Namespace, ContainerId: b.Container, Count: int32(b.Count),
			Label: b.Label, Labels: b.Labels, RequestId: b.RequestID}
		if b.Count < 1 || b.Count > math.MaxInt32 {
			return nil, fmt.Errorf("count %d: want at least 1: %w", b.Count, errdefs.ErrInvalidArgument)
		}
		if b.TTLSeconds < 0 {
			return nil, fmt.Errorf("ttl %vs: must not be negative: %w", b.TTLSeconds, errdefs.ErrInvalidArgument)
		}
		if b.TTLSeconds > 0 {
			req.Ttl = durationpb.New(time.Duration(b.TTLSeconds * float64(time.Second)))
		}
		out, err := containersServer{Server: s}.forkContainer(ctx, req)
		if err != nil {
			return nil, err
		}
		return localapi.Branched(out)
	}()
	if err != nil {
		resp.Error = wireError(err)
	} else {
		resp.Branched = res
	}
	if werr := runwire.WriteFrame(c, resp, nil); werr != nil {
		log.G(ctx).WithError(werr).WithField("socket", "run").Warn("run socket: the caller went away before the branch's answer")
	}
}

// wireError carries an error with its errdefs class, as gRPC's status would.
func wireError(err error) *runwire.Error {
	e := &runwire.Error{Message: err.Error()}
	for _, c := range []struct {
		is   func(error) bool
		code string
	}{
		{errdefs.IsNotFound, "not found"}, {errdefs.IsInvalidArgument, "invalid argument"},
		{errdefs.IsFailedPrecondition, "failed precondition"}, {errdefs.IsUnavailable, "unavailable"},
		{errdefs.IsResourceExhausted, "resource exhausted"}, {errdefs.IsNotImplemented, "not implemented"},
		{errdefs.IsAlreadyExists, "already exists"}, {errdefs.IsPermissionDenied, "permission denied"},
	} {
		if c.is(err) {
			e.Code = c.code
			break
		}
	}
	return e
}

func closeFiles(fs []*os.File) {
	for _, f := range fs {
		f.Close()
	}
}
