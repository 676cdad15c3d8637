package shim

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	taskapi "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types/task"
	"github.com/containerd/containerd/v2/core/runtime"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/fifo"
	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/timestamppb"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/pool/holder"
)

// AnnotationPool asks for a warm member of the named tidepoold pool.
const AnnotationPool = binding.AnnotationPool

// adoptedTask is a container whose task is a warm pool member: tidepoold re-keyed the
// member's snapshot to the container's, and this shim drives the member through
// tidepoold (start, signals, wait, delete) while answering containerd for the
// container, so that the task behaves as a cold one would: its pid, exit status,
// signals, kill, delete and stdio.
type adoptedTask struct {
	id, bundle string
	member     string
	pid        uint32
	sock       string
	spec       *specs.Spec
	io         *taskapi.CreateTaskRequest // the request's stdio paths

	pools apiv1.PoolsClient

	mu       sync.Mutex
	status   task.Status
	exit     uint32
	exitedAt time.Time
	exited   chan struct{}
	stdin    io.Closer
}

func (s *TaskService) adoptedTask(id string) *adoptedTask {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.adopted[id]
}

// adopt asks tidepoold for a member; nil (and no error) means create the container
// cold, the reason being logged and counted by tidepoold.
func (s *TaskService) adopt(ctx context.Context, cfg *Config, route string, spec *specs.Spec, r *taskapi.CreateTaskRequest) (*adoptedTask, error) {
	ann := spec.Annotations
	if _, _, err := binding.Parse(ann, binding.AnnotationKeys, binding.Defaults{}); err != nil {
		return nil, err
	}
	client, err := s.client(ctx, cfg.APIAddress)
	if err != nil {
		return nil, fmt.Errorf("%s=%q: cannot reach tidepoold: %w", AnnotationPool, ann[AnnotationPool], err)
	}
	raw, err := os.ReadFile(filepath.Join(r.Bundle, oci.ConfigFilename))
	if err != nil {
		return nil, err
	}
	req := &apiv1.AdoptRequest{
		Pool: ann[AnnotationPool], ContainerId: r.ID, Spec: raw,
		Fork: ann[binding.AnnotationFork], Workdir: ann[binding.AnnotationWorkdir], Owner: ann[binding.AnnotationOwner],
		Discard: ann[binding.AnnotationDiscard] == "true", Runtime: route,
	}
	for _, m := range r.Rootfs {
		req.Rootfs = append(req.Rootfs, &apiv1.Mount{Type: m.Type, Source: m.Source, Target: m.Target, Options: m.Options})
	}
	pools := client.Pools()
	resp, err := pools.Adopt(ctx, req)
	if err != nil {
		return nil, fmt.Errorf("%s=%q: %w", AnnotationPool, ann[AnnotationPool], errgrpc.ToNative(err))
	}
	if resp.GetColdReason() != "" {
		log.G(ctx).WithField("reason", resp.GetColdReason()).Info("not eligible for a warm member; creating the container cold")
		return nil, nil
	}
	return &adoptedTask{
		id: r.ID, bundle: r.Bundle, member: resp.GetMember(), pid: resp.GetPid(), sock: resp.GetControlSocket(),
		spec: spec, io: r, pools: pools, status: task.Status_CREATED, exited: make(chan struct{}),
	}, nil
}

func (s *TaskService) publish(ctx context.Context, topic string, event any) {
	if s.publisher == nil {
		return
	}
	if err := s.publisher.Publish(ctx, topic, event); err != nil {
		log.G(ctx).WithError(err).WithField("topic", topic).Warn("publish event")
	}
}

// start hands the holder the container's process and stdio, then thaws the member.
func (t *adoptedTask) start(ctx context.Context) error {
	stdio, closers, err := t.openStdio(ctx)
	if err != nil {
		return err
	}
	p := t.spec.Process
	// tidepoold moved the member's holder into this container's own cgroup at adopt;
	// only that process may receive the workload.
	peer := holder.Peer{Pid: int32(t.pid)}
	if t.spec.Linux != nil {
		peer.Cgroup = t.spec.Linux.CgroupsPath
	}
	err = holder.SendExec(t.sock, peer, holder.ExecRequest{Args: p.Args, Env: p.Env, Cwd: p.Cwd, Fds: true}, stdio)
	for _, f := range stdio {
		f.Close()
	}
	if err != nil {
		closers()
		return fmt.Errorf("hand the workload to member %s: %w", t.member, err)
	}
	if _, err := t.pools.StartMember(ctx, &apiv1.MemberRequest{Member: t.member}); err != nil {
		closers()
		return errgrpc.ToNative(err)
	}
	t.mu.Lock()
	t.status = task.Status_RUNNING
	t.mu.Unlock()
	return nil
}

// openStdio opens the task's stdout and stderr FIFOs for the workload to write
// directly, and relays stdin through a pipe so that its end reaches the workload as EOF.
func (t *adoptedTask) openStdio(ctx context.Context) ([]*os.File, func(), error) {
	var files []*os.File
	var relays []io.Closer
	fail := func(err error) ([]*os.File, func(), error) {
		for _, f := range files {
			f.Close()
		}
		for _, c := range relays {
			c.Close()
		}
		return nil, nil, err
	}
	if t.io.Stdin == "" {
		f, err := os.Open(os.DevNull)
		if err != nil {
			return fail(err)
		}
		files = append(files, f)
	} else {
		in, err := fifo.OpenFifo(context.WithoutCancel(ctx), t.io.Stdin, syscall.O_RDONLY|syscall.O_NONBLOCK, 0)
		if err != nil {
			return fail(fmt.Errorf("open stdin: %w", err))
		}
		r, w, err := os.Pipe()
		if err != nil {
			in.Close()
			return fail(err)
		}
		go func() {
			io.Copy(w, in)
			w.Close()
			in.Close()
		}()
		files, relays = append(files, r), append(relays, w, in)
		t.mu.Lock()
		t.stdin = w
		t.mu.Unlock()
	}
	for _, path := range []string{t.io.Stdout, t.io.Stderr} {
		name, flag := path, os.O_WRONLY
		if name == "" {
			name = os.DevNull
		}
		f, err := os.OpenFile(name, flag, 0)
		if err != nil {
			return fail(fmt.Errorf("open %s: %w", name, err))
		}
		files = append(files, f)
	}
	return files, func() {
		for _, c := range relays {
			c.Close()
		}
	}, nil
}

// monitor waits for the workload's exit through tidepoold (again after a daemon
// restart) and reports it as the container's.
func (s *TaskService) monitor(t *adoptedTask) {
	ctx := context.Background()
	for {
		resp, err := t.pools.WaitMember(ctx, &apiv1.MemberRequest{Member: t.member})
		if err == nil {
			t.mu.Lock()
			t.exit, t.exitedAt, t.status = resp.GetExitStatus(), resp.GetExitedAt().AsTime(), task.Status_STOPPED
			t.mu.Unlock()
			close(t.exited)
			s.publish(ctx, runtime.TaskExitEventTopic, &eventstypes.TaskExit{
				ContainerID: t.id, ID: t.id, Pid: t.pid, ExitStatus: resp.GetExitStatus(), ExitedAt: resp.GetExitedAt(),
			})
			return
		}
		if errdefs.IsNotFound(errgrpc.ToNative(err)) {
			log.G(ctx).WithError(err).WithField("member", t.member).Error("tidepoold forgot the member; reporting it killed")
			t.mu.Lock()
			t.exit, t.exitedAt, t.status = 128+uint32(syscall.SIGKILL), time.Now(), task.Status_STOPPED
			t.mu.Unlock()
			close(t.exited)
			s.publish(ctx, runtime.TaskExitEventTopic, &eventstypes.TaskExit{
				ContainerID: t.id, ID: t.id, Pid: t.pid, ExitStatus: t.exit, ExitedAt: timestamppb.New(t.exitedAt),
			})
			return
		}
		time.Sleep(500 * time.Millisecond) // tidepoold restarting
	}
}

func (t *adoptedTask) state() *taskapi.StateResponse {
	t.mu.Lock()
	defer t.mu.Unlock()
	st := &taskapi.StateResponse{
		ID: t.id, Bundle: t.bundle, Pid: t.pid, Status: t.status,
		Stdin: t.io.Stdin, Stdout: t.io.Stdout, Stderr: t.io.Stderr, ExitStatus: t.exit,
	}
	if t.status == task.Status_STOPPED {
		st.ExitedAt = timestamppb.New(t.exitedAt)
	}
	return st
}

func notForAdopted(what string) error {
	return fmt.Errorf("%s is not supported for a container running in a warm pool member: %w", what, errdefs.ErrNotImplemented)
}

// The task API for adopted containers: each method below answers for an adopted
// container and hands every other container to containerd's runc task service.

// Start implements the task API.
func (s *TaskService) Start(ctx context.Context, r *taskapi.StartRequest) (*taskapi.StartResponse, error) {
	t := s.adoptedTask(r.ID)
	if t == nil {
		return s.TTRPCTaskService.Start(ctx, r)
	}
	if r.ExecID != "" {
		return nil, notForAdopted("exec")
	}
	if err := t.start(ctx); err != nil {
		return nil, err
	}
	go s.monitor(t)
	s.publish(ctx, runtime.TaskStartEventTopic, &eventstypes.TaskStart{ContainerID: t.id, Pid: t.pid})
	return &taskapi.StartResponse{Pid: t.pid}, nil
}

// State implements the task API.
func (s *TaskService) State(ctx context.Context, r *taskapi.StateRequest) (*taskapi.StateResponse, error) {
	if t := s.adoptedTask(r.ID); t != nil && r.ExecID == "" {
		return t.state(), nil
	}
	return s.TTRPCTaskService.State(ctx, r)
}

// Kill implements the task API.
func (s *TaskService) Kill(ctx context.Context, r *taskapi.KillRequest) (*emptypb.Empty, error) {
	t := s.adoptedTask(r.ID)
	if t == nil {
		return s.TTRPCTaskService.Kill(ctx, r)
	}
	if r.ExecID != "" {
		return nil, notForAdopted("exec")
	}
	t.mu.Lock()
	st := t.status
	t.mu.Unlock()
	if st == task.Status_STOPPED {
		return nil, fmt.Errorf("process already finished: %w", errdefs.ErrNotFound)
	}
	if _, err := t.pools.SignalMember(ctx, &apiv1.SignalMemberRequest{Member: t.member, Signal: r.Signal, All: r.All}); err != nil {
		return nil, errgrpc.ToNative(err)
	}
	return &emptypb.Empty{}, nil
}

// Wait implements the task API.
func (s *TaskService) Wait(ctx context.Context, r *taskapi.WaitRequest) (*taskapi.WaitResponse, error) {
	t := s.adoptedTask(r.ID)
	if t == nil {
		return s.TTRPCTaskService.Wait(ctx, r)
	}
	select {
	case <-t.exited:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return &taskapi.WaitResponse{ExitStatus: t.exit, ExitedAt: timestamppb.New(t.exitedAt)}, nil
}

// Pids implements the task API.
func (s *TaskService) Pids(ctx context.Context, r *taskapi.PidsRequest) (*taskapi.PidsResponse, error) {
	if t := s.adoptedTask(r.ID); t != nil {
		return &taskapi.PidsResponse{Processes: []*task.ProcessInfo{{Pid: t.pid}}}, nil
	}
	return s.TTRPCTaskService.Pids(ctx, r)
}

// Pause implements the task API.
func (s *TaskService) Pause(ctx context.Context, r *taskapi.PauseRequest) (*emptypb.Empty, error) {
	t := s.adoptedTask(r.ID)
	if t == nil {
		return s.TTRPCTaskService.Pause(ctx, r)
	}
	return t.pause(ctx, s, true)
}

// Resume implements the task API.
func (s *TaskService) Resume(ctx context.Context, r *taskapi.ResumeRequest) (*emptypb.Empty, error) {
	t := s.adoptedTask(r.ID)
	if t == nil {
		return s.TTRPCTaskService.Resume(ctx, r)
	}
	return t.pause(ctx, s, false)
}

func (t *adoptedTask) pause(ctx context.Context, s *TaskService, pause bool) (*emptypb.Empty, error) {
	if _, err := t.pools.PauseMember(ctx, &apiv1.PauseMemberRequest{Member: t.member, Pause: pause}); err != nil {
		return nil, errgrpc.ToNative(err)
	}
	t.mu.Lock()
	if pause {
		t.status = task.Status_PAUSED
	} else {
		t.status = task.Status_RUNNING
	}
	t.mu.Unlock()
	if pause {
		s.publish(ctx, runtime.TaskPausedEventTopic, &eventstypes.TaskPaused{ContainerID: t.id})
	} else {
		s.publish(ctx, runtime.TaskResumedEventTopic, &eventstypes.TaskResumed{ContainerID: t.id})
	}
	return &emptypb.Empty{}, nil
}

// CloseIO implements the task API.
func (s *TaskService) CloseIO(ctx context.Context, r *taskapi.CloseIORequest) (*emptypb.Empty, error) {
	t := s.adoptedTask(r.ID)
	if t == nil {
		return s.TTRPCTaskService.CloseIO(ctx, r)
	}
	t.mu.Lock()
	in := t.stdin
	t.mu.Unlock()
	if in != nil && r.Stdin {
		in.Close()
	}
	return &emptypb.Empty{}, nil
}

// Exec implements the task API.
func (s *TaskService) Exec(ctx context.Context, r *taskapi.ExecProcessRequest) (*emptypb.Empty, error) {
	if s.adoptedTask(r.ID) != nil {
		return nil, notForAdopted("exec")
	}
	return s.TTRPCTaskService.Exec(ctx, r)
}

// Update implements the task API.
func (s *TaskService) Update(ctx context.Context, r *taskapi.UpdateTaskRequest) (*emptypb.Empty, error) {
	if s.adoptedTask(r.ID) != nil {
		return nil, notForAdopted("update")
	}
	return s.TTRPCTaskService.Update(ctx, r)
}

// Stats implements the task API.
func (s *TaskService) Stats(ctx context.Context, r *taskapi.StatsRequest) (*taskapi.StatsResponse, error) {
	if s.adoptedTask(r.ID) != nil {
		return nil, notForAdopted("stats")
	}
	return s.TTRPCTaskService.Stats(ctx, r)
}

// Checkpoint implements the task API.
func (s *TaskService) Checkpoint(ctx context.Context, r *taskapi.CheckpointTaskRequest) (*emptypb.Empty, error) {
	if s.adoptedTask(r.ID) != nil {
		return nil, notForAdopted("checkpoint")
	}
	return s.TTRPCTaskService.Checkpoint(ctx, r)
}

// ResizePty implements the task API.
func (s *TaskService) ResizePty(ctx context.Context, r *taskapi.ResizePtyRequest) (*emptypb.Empty, error) {
	if s.adoptedTask(r.ID) != nil {
		return nil, notForAdopted("a terminal")
	}
	return s.TTRPCTaskService.ResizePty(ctx, r)
}

// Connect implements the task API.
func (s *TaskService) Connect(ctx context.Context, r *taskapi.ConnectRequest) (*taskapi.ConnectResponse, error) {
	if t := s.adoptedTask(r.ID); t != nil {
		return &taskapi.ConnectResponse{ShimPid: uint32(os.Getpid()), TaskPid: t.pid}, nil
	}
	return s.TTRPCTaskService.Connect(ctx, r)
}

// Shutdown implements the task API: the shim stays while it answers for an adopted
// container, which the runc service does not know about; a grouped shim leaves on
// its own, once its keep-alive has run out (group.go).
func (s *TaskService) Shutdown(ctx context.Context, r *taskapi.ShutdownRequest) (*emptypb.Empty, error) {
	s.mu.Lock()
	n, grouped := len(s.adopted), s.group != nil
	s.mu.Unlock()
	if grouped {
		s.idle(0)
		return &emptypb.Empty{}, nil
	}
	if n > 0 {
		return &emptypb.Empty{}, nil
	}
	return s.TTRPCTaskService.Shutdown(ctx, r)
}

// deleteAdopted deletes an adopted container's task: tidepoold destroys the member,
// whose data stays as the container's snapshot.
func (s *TaskService) deleteAdopted(ctx context.Context, t *adoptedTask) (*taskapi.DeleteResponse, error) {
	t.mu.Lock()
	st := t.status
	t.mu.Unlock()
	if st == task.Status_RUNNING || st == task.Status_PAUSED {
		return nil, fmt.Errorf("cannot delete a running task %s: %w", t.id, errdefs.ErrFailedPrecondition)
	}
	if _, err := t.pools.ReleaseMember(ctx, &apiv1.MemberRequest{Member: t.member}); err != nil && !errdefs.IsNotFound(errgrpc.ToNative(err)) {
		return nil, errgrpc.ToNative(err)
	}
	s.mu.Lock()
	delete(s.adopted, t.id)
	s.mu.Unlock()
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.exitedAt.IsZero() {
		t.exitedAt = time.Now()
	}
	resp := &taskapi.DeleteResponse{Pid: t.pid, ExitStatus: t.exit, ExitedAt: timestamppb.New(t.exitedAt)}
	s.publish(ctx, runtime.TaskDeleteEventTopic, &eventstypes.TaskDelete{ContainerID: t.id, ID: t.id, Pid: t.pid, ExitStatus: t.exit, ExitedAt: resp.ExitedAt})
	return resp, nil
}
