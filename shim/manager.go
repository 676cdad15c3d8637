package shim

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"

	bootapi "github.com/containerd/containerd/api/runtime/bootstrap/v1"
	"github.com/containerd/containerd/api/types"
	"github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/manager"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/containerd/v2/pkg/shim"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/tidepool-dev/tidepool/binding"
)

// RuntimeName is the runtime type containerd resolves to containerd-shim-tidepool-v1
// (the name is shared with the pools: binding).
const RuntimeName = binding.RuntimeName

// routeFile records, in the bundle, which route a container took, so that delete (a
// separate invocation, possibly after containerd restarted) goes the same way.
const routeFile = "tidepool-route.json"

type routeRecord struct {
	Name  string `json:"name"`
	Route Route  `json:"route"`
	// ShimPath is the delegate binary resolved at start.
	ShimPath string `json:"shim_path,omitempty"`
}

// Manager implements pkg/shim's Shim: it routes each container at start.
type Manager struct {
	runc shim.Shim
}

// NewManager returns the tidepool shim manager.
func NewManager() *Manager {
	return &Manager{runc: manager.NewShimManager(RuntimeName)}
}

// Name implements shim.Shim.
func (m *Manager) Name() string { return RuntimeName }

// Start runs in the bundle directory. A runc route starts (or reuses, for a pod) this
// binary as the task server; a shim route execs the delegate's start and returns its
// address, so containerd talks to the delegate from then on.
func (m *Manager) Start(ctx context.Context, params *bootapi.BootstrapParams) (*bootapi.BootstrapResult, error) {
	spec, err := oci.ReadSpec(oci.ConfigFilename)
	if err != nil {
		return nil, fmt.Errorf("read bundle spec: %w", err)
	}
	cfg, err := LoadConfig(runtimeOptions(params))
	if err != nil {
		return nil, err
	}
	name, route, err := cfg.RouteFor(spec.Annotations)
	if err != nil {
		return nil, err
	}
	_, wantsFork, err := binding.Parse(spec.Annotations, binding.AnnotationKeys, binding.Defaults{})
	if err != nil {
		return nil, err
	}
	if wantsFork && route.Kind == KindShim {
		return nil, fmt.Errorf("%s=%q hands the container to another shim, which cannot take a fork from %s; use the %s snapshot label, whose mounts reach any shim: %w",
			AnnotationRuntime, name, binding.AnnotationFork, binding.LabelFork, errdefs.ErrNotImplemented)
	}
	rec := routeRecord{Name: name, Route: route}
	if route.Kind == KindShim {
		if rec.ShimPath, err = findShim(route.Shim); err != nil {
			return nil, fmt.Errorf("runtime %q: %w", name, err)
		}
	}
	if err := writeRoute(rec); err != nil {
		return nil, err
	}
	log.G(ctx).WithField("runtime", name).Debug("routing container")
	if route.Kind == KindShim {
		return startDelegate(ctx, rec, params)
	}
	group, grace, err := groupName(spec.Annotations)
	if err != nil {
		return nil, err
	}
	if group != "" {
		return m.startGrouped(ctx, params, group, grace)
	}
	return m.runc.Start(ctx, params)
}

// Stop implements shim.Shim (the delete action): forwarded to the delegate for a shim
// route, containerd's runc cleanup otherwise.
func (m *Manager) Stop(ctx context.Context, id string) (shim.StopStatus, error) {
	rec, err := readRoute()
	if err == nil && rec.Route.Kind == KindShim {
		return deleteDelegate(ctx, rec)
	}
	if err != nil && !os.IsNotExist(err) {
		log.G(ctx).WithError(err).Warn("unreadable route record; cleaning up as runc")
	}
	st, err := m.runc.Stop(ctx, id)
	if cwd, cerr := os.Getwd(); cerr == nil {
		releaseNetns(cwd)
	}
	return st, err
}

// Info implements shim.Shim.
func (m *Manager) Info(ctx context.Context, optionsR io.Reader) (*types.RuntimeInfo, error) {
	info, err := m.runc.Info(ctx, optionsR)
	if err != nil {
		return nil, err
	}
	info.Name = RuntimeName
	return info, nil
}

func runtimeOptions(params *bootapi.BootstrapParams) *anypb.Any {
	for _, ext := range params.GetExtensions() {
		if v := ext.GetValue(); v != nil {
			return v
		}
	}
	return nil
}

func writeRoute(rec routeRecord) error {
	b, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	if err := os.WriteFile(routeFile, b, 0o600); err != nil {
		return fmt.Errorf("record route: %w", err)
	}
	return nil
}

func readRoute() (routeRecord, error) {
	var rec routeRecord
	b, err := os.ReadFile(routeFile)
	if err != nil {
		return rec, err
	}
	return rec, json.Unmarshal(b, &rec)
}

// findShim resolves a delegate shim: an absolute path, else beside this binary, else PATH.
func findShim(name string) (string, error) {
	if filepath.IsAbs(name) {
		if _, err := os.Stat(name); err != nil {
			return "", fmt.Errorf("delegate shim: %w", err)
		}
		return name, nil
	}
	if self, err := os.Executable(); err == nil {
		p := filepath.Join(filepath.Dir(self), name)
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	p, err := lookPath(name)
	if err != nil {
		return "", fmt.Errorf("delegate shim %q is not installed (not beside %s, not in PATH)", name, os.Args[0])
	}
	return p, nil
}
