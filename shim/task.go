package shim

import (
	"context"
	"fmt"
	"path/filepath"
	"sync"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	taskapi "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types"
	"github.com/containerd/containerd/api/types/runc/options"
	"github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/task"
	"github.com/containerd/containerd/v2/core/runtime"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/containerd/v2/pkg/shim"
	"github.com/containerd/containerd/v2/pkg/shutdown"
	"github.com/containerd/containerd/v2/plugins"
	"github.com/containerd/errdefs"
	"github.com/containerd/plugin"
	"github.com/containerd/plugin/registry"
	"github.com/containerd/ttrpc"
	"github.com/containerd/typeurl/v2"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"google.golang.org/protobuf/types/known/anypb"

	apiv1 "github.com/tidepool-dev/tidepool/api/v1"
	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/localapi"
)

// criContainerType is the annotation CRI sets to "sandbox" on a pod's pause container.
const criContainerType = "io.kubernetes.cri.container-type"

// RegisterTaskPlugin registers the task service with the shim's plugin registry. It
// takes the place of containerd's task/plugin package, which must not be imported as
// well: two ("io.containerd.ttrpc.v1", "task") registrations panic. The shim must be
// run with WithConcurrentReaper: the task service reaps children itself (reap.go).
func RegisterTaskPlugin() {
	registry.Register(&plugin.Registration{
		Type:     plugins.TTRPCPlugin,
		ID:       "task",
		Requires: []plugin.Type{plugins.EventPlugin, plugins.InternalPlugin},
		InitFn: func(ic *plugin.InitContext) (any, error) {
			pp, err := ic.GetByID(plugins.EventPlugin, "publisher")
			if err != nil {
				return nil, err
			}
			ss, err := ic.GetByID(plugins.InternalPlugin, "shutdown")
			if err != nil {
				return nil, err
			}
			// RunShim was given WithConcurrentReaper: the reaping is ours (reap.go).
			serveChildExits()
			local, err := task.NewTaskService(ic.Context, pp.(shim.Publisher), ss.(shutdown.Service))
			if err != nil {
				return nil, err
			}
			return &TaskService{TTRPCTaskService: local, publisher: pp.(shim.Publisher), self: selfAddress()}, nil
		},
	})
}

// TaskService is containerd's runc task service with tidepool's Create in front.
type TaskService struct {
	taskapi.TTRPCTaskService

	publisher shim.Publisher

	mu      sync.Mutex
	clients map[string]*localapi.Client // by API address
	bundles map[string]string           // container id -> bundle, for Delete
	adopted map[string]*adoptedTask     // containers running in warm pool members

	// A grouped shim (group.go) serves many pool members and leaves on its own.
	self      string     // this shim's address
	group     *shimGroup // nil: not grouped
	inflight  int        // creates under way
	exiting   bool
	idleTimer *time.Timer
	logBundle string // whose log FIFO stderr is (grouplog.go)
}

func (s *TaskService) bundle(id string) (string, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.bundles[id]
	return b, ok
}

// RegisterTTRPC serves the wrapped service.
func (s *TaskService) RegisterTTRPC(server *ttrpc.Server) error {
	taskapi.RegisterTTRPCTaskService(server, s)
	return nil
}

// Create routes, normalises the runtime options and binds the requested fork before
// handing the container to runc.
func (s *TaskService) Create(ctx context.Context, r *taskapi.CreateTaskRequest) (_ *taskapi.CreateTaskResponse, retErr error) {
	s.mu.Lock()
	s.inflight++
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.inflight--
		s.mu.Unlock()
		if retErr != nil {
			s.idle(time.Second)
		}
	}()
	spec, err := oci.ReadSpec(filepath.Join(r.Bundle, oci.ConfigFilename))
	if err != nil {
		return nil, fmt.Errorf("read bundle spec: %w", err)
	}
	// First, so that a failing create still leaves a grouped shim to its keep-alive.
	if group, _, err := groupName(spec.Annotations); err != nil {
		return nil, err
	} else if group != "" {
		if err := s.joinGroup(ctx, r.ID, r.Bundle); err != nil {
			return nil, err
		}
	}
	cfg, err := LoadConfig(r.Options)
	if err != nil {
		return nil, err
	}
	name, route, err := cfg.RouteFor(spec.Annotations)
	if err != nil {
		return nil, err
	}
	if route.Kind != KindRunc {
		return nil, fmt.Errorf("%s=%q names a delegate shim, but this container was sent to a tidepool runc shim; under CRI the runtime is chosen once per pod, by the sandbox's annotations: %w", AnnotationRuntime, name, errdefs.ErrFailedPrecondition)
	}
	if r.Options, err = runcOptions(r.Options, route); err != nil {
		return nil, err
	}
	if _, ok := spec.Annotations[AnnotationPool]; ok {
		t, err := s.adopt(ctx, cfg, name, spec, r)
		if err != nil {
			return nil, err
		}
		if t != nil {
			s.mu.Lock()
			if s.adopted == nil {
				s.adopted = map[string]*adoptedTask{}
			}
			s.adopted[r.ID] = t
			s.mu.Unlock()
			s.publish(ctx, runtime.TaskCreateEventTopic, &eventstypes.TaskCreate{
				ContainerID: r.ID, Bundle: r.Bundle, Rootfs: r.Rootfs, Pid: t.pid,
				IO: &eventstypes.TaskIO{Stdin: r.Stdin, Stdout: r.Stdout, Stderr: r.Stderr, Terminal: r.Terminal},
			})
			return &taskapi.CreateTaskResponse{Pid: t.pid}, nil
		}
	}
	if err := s.bindFork(ctx, cfg, spec, r); err != nil {
		return nil, err
	}
	if route.CreateNetns {
		if err := ensureNetns(r.Bundle); err != nil {
			return nil, err
		}
	}
	resp, err := s.TTRPCTaskService.Create(ctx, r)
	if err != nil {
		if route.CreateNetns {
			releaseNetns(r.Bundle)
		}
		return nil, err
	}
	s.mu.Lock()
	if s.bundles == nil {
		s.bundles = map[string]string{}
	}
	s.bundles[r.ID] = r.Bundle
	s.mu.Unlock()
	return resp, nil
}

// Delete releases what Create made for the container besides what runc made.
func (s *TaskService) Delete(ctx context.Context, r *taskapi.DeleteRequest) (*taskapi.DeleteResponse, error) {
	if t := s.adoptedTask(r.ID); t != nil && r.ExecID == "" {
		return s.deleteAdopted(ctx, t)
	}
	resp, err := s.TTRPCTaskService.Delete(ctx, r)
	if err == nil && r.ExecID == "" {
		if b, ok := s.bundle(r.ID); ok {
			releaseNetns(b)
			s.mu.Lock()
			delete(s.bundles, r.ID)
			s.moveLogLocked(b)
			s.mu.Unlock()
			s.idle(time.Second)
		}
	}
	return resp, err
}

// runcOptions turns whatever options arrived (none, CRI's runtimeoptions, runc's own)
// into runc options carrying the route's binary: the runc service reads them unchecked.
func runcOptions(in *anypb.Any, route Route) (*anypb.Any, error) {
	opts := &options.Options{}
	if in != nil && in.GetValue() != nil {
		if v, err := typeurl.UnmarshalAny(in); err == nil {
			if ro, ok := v.(*options.Options); ok {
				opts = ro
			}
		}
	}
	if route.BinaryName != "" {
		opts.BinaryName = route.BinaryName
	}
	if route.Root != "" {
		opts.Root = route.Root
	}
	out, err := typeurl.MarshalAnyToProto(opts)
	if err != nil {
		return nil, fmt.Errorf("marshal runc options: %w", err)
	}
	return out, nil
}

// bindFork applies dev.tidepool.fork/workdir/owner/discard: tidepoold binds the fork to
// the container's snapshot and returns the rootfs mounts with the fork view in them.
func (s *TaskService) bindFork(ctx context.Context, cfg *Config, spec *specs.Spec, r *taskapi.CreateTaskRequest) error {
	ann := spec.Annotations
	_, ok, err := binding.Parse(ann, binding.AnnotationKeys, binding.Defaults{})
	if err != nil || !ok {
		return err
	}
	if ann[criContainerType] == "sandbox" {
		// CRI copies pod annotations to the pause container too; the fork is for the
		// pod's app containers, which get the same annotations.
		return nil
	}
	owner := ann[binding.AnnotationOwner]
	if owner == "" && spec.Process != nil {
		owner = fmt.Sprintf("%d:%d", spec.Process.User.UID, spec.Process.User.GID)
	}
	client, err := s.client(ctx, cfg.APIAddress)
	if err != nil {
		return fmt.Errorf("%s=%q: cannot reach tidepoold to bind the fork: %w", binding.AnnotationFork, ann[binding.AnnotationFork], err)
	}
	req := &apiv1.BindRequest{
		Fork: ann[binding.AnnotationFork], Workdir: ann[binding.AnnotationWorkdir], Owner: owner,
		Discard: ann[binding.AnnotationDiscard] == "true",
	}
	for _, m := range r.Rootfs {
		req.Rootfs = append(req.Rootfs, &apiv1.Mount{Type: m.Type, Source: m.Source, Target: m.Target, Options: m.Options})
	}
	res, err := client.Bind(ctx, req)
	if err != nil {
		return fmt.Errorf("%s=%q: %w", binding.AnnotationFork, ann[binding.AnnotationFork], err)
	}
	r.Rootfs = r.Rootfs[:0]
	for _, m := range res.GetMounts() {
		r.Rootfs = append(r.Rootfs, &types.Mount{Type: m.GetType(), Source: m.GetSource(), Target: m.GetTarget(), Options: m.GetOptions()})
	}
	return nil
}

func (s *TaskService) client(ctx context.Context, address string) (*localapi.Client, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if c, ok := s.clients[address]; ok {
		return c, nil
	}
	c, err := localapi.Dial(ctx, address, 3*time.Second)
	if err != nil {
		return nil, err
	}
	if s.clients == nil {
		s.clients = map[string]*localapi.Client{}
	}
	s.clients[address] = c
	return c, nil
}
