package pool

import (
	"os/exec"
	"strings"
	"testing"
)

// TestNoShimDependency keeps the import graph pointing down: the daemon's pools share
// names with the shim only through binding, so tidepoold links neither the tidepool
// shim nor containerd's runc shim packages.
func TestNoShimDependency(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go toolchain on PATH")
	}
	out, err := exec.Command(goBin, "list", "-deps", "github.com/tidepool-dev/tidepool/pool/...", "github.com/tidepool-dev/tidepool/cmd/tidepoold").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, pkg := range strings.Fields(string(out)) {
		if pkg == "github.com/tidepool-dev/tidepool/shim" || strings.Contains(pkg, "containerd-shim-runc-v2") {
			t.Errorf("pool or tidepoold depends on %s", pkg)
		}
	}
}
