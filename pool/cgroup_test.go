package pool

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/containerd/cgroups/v3"
	"github.com/containerd/cgroups/v3/cgroup1"
	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// TestV1CgroupsDeleteHybrid: on a hybrid host (v1 controllers and the v2 hierarchy
// at /sys/fs/cgroup/unified) runc makes a container's cgroup in both; deleting a
// member's cgroup removes it from both, and a cgroup already gone is no error.
// Needs root and a hybrid host.
func TestV1CgroupsDeleteHybrid(t *testing.T) {
	if os.Geteuid() != 0 || cgroups.Mode() != cgroups.Hybrid {
		t.Skip("needs root on a hybrid cgroup host")
	}
	path := fmt.Sprintf("/tidepool-test-%d", time.Now().UnixNano())
	cg, err := cgroup1.New(cgroup1.StaticPath(path), &specs.LinuxResources{})
	if err != nil {
		t.Fatal(err)
	}
	unified := filepath.Join(hybridUnified, path)
	if err := os.Mkdir(unified, 0o755); err != nil {
		cg.Delete()
		t.Fatal(err)
	}
	t.Cleanup(func() { cg.Delete(); os.Remove(unified) })

	if err := (v1Cgroups{}).Delete(path); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(unified); !os.IsNotExist(err) {
		t.Fatalf("the unified hierarchy's %s is left (stat: %v)", unified, err)
	}
	if _, err := os.Stat(filepath.Join("/sys/fs/cgroup/freezer", path)); !os.IsNotExist(err) {
		t.Fatalf("the freezer's cgroup is left (stat: %v)", err)
	}
	if err := (v1Cgroups{}).Delete(path); err != nil {
		t.Fatalf("deleting a deleted cgroup: %v", err)
	}
}
