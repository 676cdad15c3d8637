package e2e

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/integration/stack"
	"github.com/tidepool-dev/tidepool/kview"
)

// TestDaemonGCKeepsKernelViews: tidepoold's periodic garbage collection keeps the
// objects of a kernel view that `tidepool mount --mode kernel` mounted of a root no
// fork names, whatever views.mode tidepoold itself runs with: the default (it serves
// kernel views), and views.mode = "fuse" (an operator switched modes, as after a
// kernel probe that failed at start), where tidepoold serves none but must still find
// the view in the mount table. A root nothing shows is collected by the same runs.
func TestDaemonGCKeepsKernelViews(t *testing.T) {
	requireKernelViews(t)
	s := stack.Start(t, stack.Options{Metrics: true, TidepooldConfig: func(*stack.Stack) string {
		return "[maintenance]\ngc_interval = \"300ms\"\ngc_grace = \"1ns\"\n"
	}})
	// The trees enter the store, and the view is mounted, while no tidepoold runs:
	// its first collection already finds them.
	if err := s.Daemon.Stop(); err != nil {
		t.Fatal(err)
	}
	// One file per mode, read first after that mode's collections: a file read once
	// through an overlay stays readable from the dentry overlayfs keeps, even if its
	// object is removed.
	files := map[string]string{"default.txt": "read while tidepoold serves kernel views\n", "fuse.txt": "read while tidepoold serves FUSE views\n"}
	shown := s.Ingest(t, writeTree(t, files))
	s.Ingest(t, writeTree(t, map[string]string{"lone.txt": "shown by nothing\n"}))
	dir := t.TempDir()
	s.MustTidepool(t, "mount", "--mode", "kernel", shown, dir)
	t.Cleanup(func() {
		if kview.IsMounted(dir) {
			if _, err := s.Tidepool("umount", dir); err != nil {
				t.Errorf("umount %s: %v", dir, err)
			}
		}
	})
	if !kview.IsMounted(dir) {
		t.Fatal("tidepool mount --mode kernel left no kernel view")
	}
	store, err := casstore.Open(filepath.Join(s.Root, "cas"))
	if err != nil {
		t.Fatal(err)
	}
	loneObject := store.Path(casstore.Sum([]byte("shown by nothing\n")))
	if _, err := os.Stat(loneObject); err != nil {
		t.Fatalf("the lone tree's file object: %v", err)
	}

	for _, mode := range []string{"", `views.mode = "fuse"`} {
		name := mode
		if name == "" {
			name = "default mode"
		}
		if mode == "" {
			if err := s.Daemon.Start(context.Background()); err != nil {
				t.Fatalf("start tidepoold: %v\n%s", err, s.Daemon.LogTail(40))
			}
		} else {
			s.RestartDaemonWith(t, mode)
		}
		// Two runs: the second began after the first had swept.
		for deadline := time.Now().Add(time.Minute); s.Metric(t, "tidepool_gc_runs_total", `result="ok"`) < 2; {
			if time.Now().After(deadline) {
				t.Fatalf("%s: fewer than two garbage collections in a minute (%v skipped, %v failed)\n%s", name,
					s.Metric(t, "tidepool_gc_runs_total", `result="skipped"`), s.Metric(t, "tidepool_gc_runs_total", `result="failed"`),
					s.Daemon.LogTail(40))
			}
			time.Sleep(50 * time.Millisecond)
		}
		if got := s.Metric(t, "tidepool_gc_kernel_view_roots"); got != 1 {
			t.Errorf("%s: the collection marked from %v kernel view roots, want 1", name, got)
		}
		for _, c := range files {
			if _, err := os.Stat(store.Path(casstore.Sum([]byte(c)))); err != nil {
				t.Errorf("%s: an object the kernel view shows: %v", name, err)
			}
		}
		file := "default.txt"
		if mode != "" {
			file = "fuse.txt"
		}
		b, err := os.ReadFile(filepath.Join(dir, file))
		if err != nil || string(b) != files[file] {
			t.Fatalf("%s: read through the kernel view after tidepoold's collections: %q %v", name, b, err)
		}
		if _, err := os.Stat(loneObject); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s: the object of a root nothing shows was not collected (%v)", name, err)
		}
		if !kview.IsMounted(dir) {
			t.Fatalf("%s: tidepoold unmounted the kernel view", name)
		}
	}
}
