package snapshotter_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/moby/sys/mountinfo"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/kview"
)

func mountID(t testing.TB, dir string) int {
	t.Helper()
	ms, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(dir))
	if err != nil || len(ms) == 0 {
		t.Fatalf("no mount at %s: %v", dir, err)
	}
	return ms[len(ms)-1].ID
}

// TestKernelViewOutlivesHost: with views.mode = kernel a fork-bearing snapshot's view is
// a kernel view; it keeps serving a mounted container rootfs after the snapshotter and
// its view host close (a daemon exit), the next snapshotter adopts it as it is (same
// mount), removes a view no snapshot owns, and the commit on Remove equals the
// container's merged workdir.
func TestKernelViewOutlivesHost(t *testing.T) {
	requireRoot(t)
	if err := kview.Probe(t.TempDir()); err != nil {
		t.Skip(err)
	}
	t.Setenv("TIDEPOOL_VIEWS_MODE", "kernel")
	ctx := context.Background()
	root := t.TempDir()
	e := newEnv(t, root)
	e.imageLayer(t, "layer1", imageFiles)
	src := ingestFiles(t, e.store, sourceFiles)
	mounts, err := e.sn.Prepare(ctx, "c1", "layer1", labels(binding.LabelFork, src.String(), binding.LabelWorkdir, "/app"))
	if err != nil {
		t.Fatal(err)
	}
	views := filepath.Join(root, "views")
	kv, err := kview.List(views)
	if err != nil || len(kv) != 1 {
		t.Fatalf("kernel views %v (%v), want one", kv, err)
	}
	id := mountID(t, kv[0].Dir)

	rootfs := t.TempDir()
	if err := mount.All(mounts, rootfs); err != nil {
		t.Fatal(err)
	}
	defer mount.UnmountAll(rootfs, 0)
	writeFiles(t, rootfs, map[string]string{"app/before.txt": "1\n"})

	// A kernel view nobody owns, as a snapshot removed while no daemon ran leaves.
	orphan := filepath.Join(views, "999")
	if err := os.Mkdir(orphan, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := e.views.Kernel().Mount(ctx, orphan, kview.Spec{Root: src}); err != nil {
		t.Fatal(err)
	}

	e.close(t) // the daemon exits
	if got := readFile(t, filepath.Join(rootfs, "app/README.md")); got != sourceFiles["README.md"] {
		t.Fatalf("container read after the host closed: %q", got)
	}
	writeFiles(t, rootfs, map[string]string{"app/after.txt": "2\n"})

	e2 := newEnv(t, root) // the daemon starts again
	if got := mountID(t, kv[0].Dir); got != id {
		t.Errorf("view mount %d replaced by %d: want it adopted as it is", id, got)
	}
	if kview.IsMounted(orphan) {
		t.Error("a kernel view no snapshot owns is still mounted after the restart")
	}
	if _, err := os.Stat(orphan); !os.IsNotExist(err) {
		t.Errorf("orphan view dir: %v", err)
	}
	m2, err := e2.sn.Mounts(ctx, "c1")
	if err != nil {
		t.Fatal(err)
	}
	if len(m2) != 1 || len(mounts) != 1 || m2[0].Type != mounts[0].Type || len(m2[0].Options) != len(mounts[0].Options) {
		t.Errorf("mounts after restart %+v, before %+v", m2, mounts)
	}
	if err := mount.UnmountAll(rootfs, 0); err != nil {
		t.Fatal(err)
	}
	if err := e2.sn.Remove(ctx, "c1"); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"before.txt": "1\n", "after.txt": "2\n"}
	for p, c := range sourceFiles {
		want[p] = c
	}
	if got, exp := forkOf(t, e2.db, "c1").Root, ingestFiles(t, e2.store, want); got != exp {
		t.Errorf("commit %s, want %s (the merged workdir)", got, exp)
	}
	if left, _ := kview.List(views); len(left) != 0 {
		t.Errorf("kernel views left: %v", left)
	}
}
