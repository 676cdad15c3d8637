package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

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

	script := `set -e
touch /app/started
r=0
until [ -e /app/stop ]; do
  r=$((r+1))
  [ "$(cat /app/src/a.txt)" = alpha ] || { echo "round $r: read failed"; exit 1; }
  echo "round $r" > /app/r$r
  [ $r -lt 1500 ] || { echo "never told to stop"; exit 1; }
  sleep 0.2
done
echo "ok $r"`
	done := make(chan error, 1)
	var runOut string
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		var err error
		runOut, err = s.C.CtrContext(ctx, "", append(append([]string{"run", "--rm", "--fifo-dir", s.C.FIFODir}, forkLabels(root, "/app")...), imagebuild.BusyboxRef, "switch-live", "sh", "-c", script)...)
		done <- err
	}()
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(100 * time.Millisecond) {
		if out, _ := s.Ctr("task", "ls"); strings.Contains(out, "RUNNING") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("container did not start")
		}
	}
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

	if out, err := s.Ctr("task", "exec", "--exec-id", "stop", "--fifo-dir", s.C.FIFODir, "switch-live", "touch", "/app/stop"); err != nil {
		t.Fatalf("tell the container to stop: %v\n%s", err, out)
	}
	if err := <-done; err != nil {
		t.Fatalf("container: %v, output %q", err, runOut)
	}
	var rounds int
	i := strings.LastIndex(runOut, "ok ")
	if i < 0 {
		t.Fatalf("container output %q: no rounds", runOut)
	}
	if _, err := fmt.Sscanf(runOut[i:], "ok %d", &rounds); err != nil || rounds < 1 {
		t.Fatalf("container output %q: %v", runOut, err)
	}
	f := forkOfContainer(t, s, "switch-live", root)
	expect := map[string]string{"started": "", "stop": ""}
	for p, c := range files {
		expect[p] = c
	}
	for r := 1; r <= rounds; r++ {
		expect[fmt.Sprintf("r%d", r)] = fmt.Sprintf("round %d\n", r)
	}
	if re := s.Ingest(t, writeTree(t, expect)); re != f.Root.String() {
		t.Errorf("commit %s, re-ingest of the merged workdir %s", f.Root, re)
	}
	if left, _ := kview.List(viewsDir); len(left) != 0 {
		t.Errorf("kernel views left after the container went: %v", left)
	}
	if left, _ := harness.MountsUnder(s.Root); len(left) != 0 {
		t.Errorf("mounts left under the root: %v", left)
	}
}
