package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/integration/harness"
	"github.com/tidepool-dev/tidepool/integration/imagebuild"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/kview"
)

// TestRootThroughSymlink: tidepoold given its root through a symbolic link (as on a
// host whose /var/lib links to a data disk) finds its mounts in the kernel's mount
// table, which shows real paths: a container reads its fork through the view, a
// restarted daemon adopts the view instead of mounting another over it, and the
// container's commit and removal leave nothing mounted.
func TestRootThroughSymlink(t *testing.T) {
	s := stack.Start(t, stack.Options{RootLink: true})
	s.C.ImportImage(t, imagebuild.BusyboxArchive(t).Path, imagebuild.BusyboxRef, "tidepool")
	files := map[string]string{"src/a.txt": "alpha\n", "src/sub/b.txt": strings.Repeat("beta\n", 100)}
	root := s.Ingest(t, writeTree(t, files))
	real := s.Root + ".real"

	out := runRm(t, s, "link-read", forkLabels(root, "/app"), imagebuild.BusyboxRef, "sh", "-c", "cat /app/src/a.txt /app/src/sub/b.txt | md5sum")
	if want := catSum(files); !strings.HasPrefix(out, want) {
		t.Fatalf("container read %q through the view, want md5 %s", out, want)
	}
	if os.Getenv("TIDEPOOL_VIEWS_MODE") == "fuse" || kview.Probe(t.TempDir()) != nil {
		return // the rest is about kernel views, which outlive tidepoold
	}

	// The container reads and writes until the test, its restarts done, tells it to
	// stop; it prints how many rounds it ran.
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
		runOut, err = s.C.CtrContext(ctx, "", append(append([]string{"run", "--rm", "--fifo-dir", s.C.FIFODir}, forkLabels(root, "/app")...), imagebuild.BusyboxRef, "link-live", "sh", "-c", script)...)
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
	views := func() []kview.Mounted {
		v, err := kview.List(filepath.Join(real, "views"))
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	if v := views(); len(v) != 1 {
		t.Fatalf("%d kernel views mounted under the real root, want 1: %v", len(v), v)
	}
	for i := range 2 {
		if err := s.Daemon.Kill(); err != nil {
			t.Fatal(err)
		}
		if err := s.Daemon.Start(context.Background()); err != nil {
			t.Fatalf("restart tidepoold: %v\n%s", err, s.Daemon.LogTail(40))
		}
		// A container's Mounts after the restart mounts the view if it is not found.
		if out, err := s.Ctr("snapshots", "--snapshotter", "tidepool", "mounts", "/tmp", "link-live"); err != nil {
			t.Fatalf("mounts after restart %d: %v\n%s", i, err, out)
		}
		if v := views(); len(v) != 1 {
			t.Fatalf("after restart %d: %d kernel views mounted, want the one adopted: %v", i, len(v), v)
		}
	}
	if out, err := s.Ctr("task", "exec", "--exec-id", "stop", "--fifo-dir", s.C.FIFODir, "link-live", "touch", "/app/stop"); err != nil {
		t.Fatalf("tell the container to stop: %v\n%s", err, out)
	}
	var rounds int
	if err := <-done; err != nil {
		t.Fatalf("container: %v, output %q", err, runOut)
	}
	i := strings.LastIndex(runOut, "ok ")
	if i < 0 {
		t.Fatalf("container output %q: no rounds", runOut)
	}
	if _, err := fmt.Sscanf(runOut[i:], "ok %d", &rounds); err != nil || rounds < 1 {
		t.Fatalf("container output %q: %v", runOut, err)
	}
	f := forkOfContainer(t, s, "link-live", root)
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
	if left, _ := kview.List(filepath.Join(real, "views")); len(left) != 0 {
		t.Errorf("kernel views left after the container went: %v", left)
	}
	if left, _ := harness.MountsUnder(real); len(left) != 0 {
		t.Errorf("mounts left under the root: %v", left)
	}
}
