package e2e

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/tidepool-dev/tidepool/integration/harness"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/kview"
)

// TestKernelViewOutlivesASwitchToFUSE: an operator switches tidepoold from kernel
// views to views.mode = "fuse" and restarts it while a container runs on a kernel
// view. The container keeps reading and writing through it; a new container on the
// same fork gets a FUSE view; when the first container goes, its commit equals its
// merged workdir and its kernel view is unmounted: nothing is left mounted.
func TestKernelViewOutlivesASwitchToFUSE(t *testing.T) {
	requireKernelViews(t)
	s := stack.Start(t, stack.Options{Metrics: true})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	files := map[string]string{"src/a.txt": "alpha\n", "src/sub/b.txt": strings.Repeat("beta\n", 100)}
	root := s.Ingest(t, writeTree(t, files))

	live := startLooper(t, s, "switch-live", root, files)
	viewsDir := filepath.Join(s.Root, "views")
	if v, err := kview.List(viewsDir); err != nil || len(v) != 1 {
		t.Fatalf("%d kernel views before the switch, want 1: %v %v", len(v), v, err)
	}

	s.RestartDaemonWith(t, `views.mode = "fuse"`)
	out := runRm(t, s, "switch-fuse", forkLabels(root, "/app"), imagebuild.BusyboxRef, "cat", "/app/src/a.txt")
	if out != "alpha\n" {
		t.Fatalf("a container started after the switch read %q", out)
	}
	if n := s.Metric(t, "tidepool_views_operations_total", `op="lookup"`); n == 0 {
		t.Error("the container started after the switch was not served by a FUSE view (no lookups counted)")
	}
	if v, err := kview.List(viewsDir); err != nil || len(v) != 1 {
		t.Fatalf("%d kernel views after the switch, want the running container's: %v %v", len(v), v, err)
	}

	live.stopAndCheckCommit(t)
	if left, _ := kview.List(viewsDir); len(left) != 0 {
		t.Errorf("kernel views left after the container went: %v", left)
	}
	if left, _ := harness.MountsUnder(s.Root); len(left) != 0 {
		t.Errorf("mounts left under the root: %v", left)
	}
}
