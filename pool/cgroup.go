package pool

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/containerd/cgroups/v3"
	"github.com/containerd/cgroups/v3/cgroup1"
	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// cgroupHost makes and drives the cgroup a container asked for, when the container
// adopts a member: runc made the member's cgroup from the template, so at claim the
// member's processes move into one at the container's own path, with its resources,
// before the workload starts. The workload then has the limits and the accounting
// (a pod's cgroup, under Kubernetes) the container asked for, as a cold start would.
type cgroupHost interface {
	// Supported says why claims cannot move members on this host, or "".
	Supported() string
	// Move creates the cgroup at path with res, frozen, and moves pids into it (they
	// stay frozen until Thaw). The cgroup must not exist with processes in it.
	Move(path string, res *specs.LinuxResources, pids []int) error
	Freeze(path string) error
	Thaw(path string) error
	// Signal signals every process in the cgroup.
	Signal(path string, sig syscall.Signal) error
	// Delete removes the cgroup once it is empty.
	Delete(path string) error
}

// errCgroupInUse says the container's cgroup already holds processes.
var errCgroupInUse = errors.New("cgroup already has processes")

// v1Cgroups is cgroupHost on cgroup v1 (legacy or hybrid), through containerd's cgroups
// library, which applies a spec's resources the way runc does.
type v1Cgroups struct{}

func (v1Cgroups) Supported() string {
	if cgroups.Mode() == cgroups.Unified {
		return "cgroup_v2"
	}
	return ""
}

func (v1Cgroups) Move(path string, res *specs.LinuxResources, pids []int) error {
	if old, err := cgroup1.Load(cgroup1.StaticPath(path)); err == nil {
		if procs, _ := old.Processes(cgroup1.Freezer, true); len(procs) > 0 {
			return fmt.Errorf("%s: %w", path, errCgroupInUse)
		}
	}
	if res == nil {
		res = &specs.LinuxResources{}
	}
	cg, err := cgroup1.New(cgroup1.StaticPath(path), res)
	if err != nil {
		return fmt.Errorf("create cgroup %s: %w", path, err)
	}
	if err := cg.Freeze(); err != nil {
		cg.Delete()
		return fmt.Errorf("freeze cgroup %s: %w", path, err)
	}
	for _, pid := range pids {
		if err := cg.AddProc(uint64(pid)); err != nil {
			return fmt.Errorf("move pid %d into cgroup %s: %w", pid, path, err)
		}
	}
	return nil
}

func load(path string) (cgroup1.Cgroup, error) {
	cg, err := cgroup1.Load(cgroup1.StaticPath(path))
	if err != nil {
		return nil, fmt.Errorf("cgroup %s: %w", path, err)
	}
	return cg, nil
}

func (v1Cgroups) Freeze(path string) error {
	cg, err := load(path)
	if err != nil {
		return err
	}
	return cg.Freeze()
}

func (v1Cgroups) Thaw(path string) error {
	cg, err := load(path)
	if err != nil {
		return err
	}
	return cg.Thaw()
}

func (v1Cgroups) Signal(path string, sig syscall.Signal) error {
	cg, err := load(path)
	if err != nil {
		return err
	}
	procs, err := cg.Processes(cgroup1.Freezer, true)
	if err != nil {
		return err
	}
	for _, p := range procs {
		if err := syscall.Kill(p.Pid, sig); err != nil && !errors.Is(err, syscall.ESRCH) {
			return fmt.Errorf("signal pid %d: %w", p.Pid, err)
		}
	}
	return nil
}

func (v1Cgroups) Delete(path string) error {
	cg, err := cgroup1.Load(cgroup1.StaticPath(path))
	switch {
	case errors.Is(err, cgroup1.ErrCgroupDeleted) || os.IsNotExist(err):
	case err != nil:
		return err
	default:
		cg.Thaw()
		if err := cg.Delete(); err != nil {
			return err
		}
	}
	return deleteHybridUnified(path)
}

// hybridUnified is where a hybrid host mounts the v2 hierarchy beside the v1 ones.
const hybridUnified = "/sys/fs/cgroup/unified"

// deleteHybridUnified removes path's directory in the v2 hierarchy of a hybrid host:
// runc makes the container's cgroup there too (the v1 library knows only the v1
// hierarchies), and its own delete removes it; a member whose runc never got to
// that delete leaves it. Its processes are gone once the v1 cgroups are.
func deleteHybridUnified(path string) error {
	if cgroups.Mode() != cgroups.Hybrid {
		return nil
	}
	dir := filepath.Join(hybridUnified, filepath.Clean("/"+path))
	if err := os.Remove(dir); err != nil && !os.IsNotExist(err) {
		return fmt.Errorf("remove cgroup %s: %w", dir, err)
	}
	return nil
}

// removeCgroup removes a cgroup of a member once it is empty, waiting a moment for
// the last exits; with kill, whatever still runs in it is killed first (a
// member's own cgroup that no task owns any more: a runc init left by a create
// that was cut short). A cgroupsPath in systemd's form (slice:prefix:name) is not a
// cgroupfs path and is left to systemd.
func removeCgroup(cg cgroupHost, path string, kill bool) error {
	if strings.Contains(path, ":") {
		return nil
	}
	var err error
	for i := 0; i < 50; i++ {
		if kill {
			cg.Signal(path, syscall.SIGKILL)
			cg.Thaw(path) // a frozen cgroup holds the signal until it thaws
		}
		if err = cg.Delete(path); err == nil {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return err
}
