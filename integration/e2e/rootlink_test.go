package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

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
	// stop.
	live := startLooper(t, s, "link-live", root, files)
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
	live.stopAndCheckCommit(t)
	if left, _ := kview.List(filepath.Join(real, "views")); len(left) != 0 {
		t.Errorf("kernel views left after the container went: %v", left)
	}
	if left, _ := harness.MountsUnder(real); len(left) != 0 {
		t.Errorf("mounts left under the root: %v", left)
	}
}
