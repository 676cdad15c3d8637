package snapshotter_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/casstore/ingest"
	"github.com/tidepool-dev/tidepool/kview"
	"github.com/tidepool-dev/tidepool/snapshotter"
)

// kernelEnv is a snapshotter whose views are kernel views, on a kernel that has them
// (the test is skipped otherwise).
func kernelEnv(t *testing.T) (context.Context, *env) {
	t.Helper()
	requireRoot(t)
	if err := kview.Probe(t.TempDir()); err != nil {
		t.Skip(err)
	}
	t.Setenv("TIDEPOOL_VIEWS_MODE", "kernel")
	return context.Background(), newEnv(t, t.TempDir())
}

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
	ctx, e := kernelEnv(t)
	root := e.root
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
	direct := os.Getenv("TIDEPOOL_VIEWS_LAYERING") != snapshotter.LayeringNested
	if opts := strings.Join(mounts[0].Options, ","); kv[0].Image != direct || strings.Contains(opts, "::") != direct || strings.Contains(opts, "metacopy=on") != direct || (len(mounts) == 2) != direct {
		t.Fatalf("direct layering %v: view %+v, overlay options %s", direct, kv[0], opts)
	}

	rootfs := t.TempDir()
	if err := mount.All(mounts, rootfs); err != nil {
		t.Fatal(err)
	}
	defer mount.UnmountAll(rootfs, 0)
	writeFiles(t, rootfs, map[string]string{"app/before.txt": "1\n"})
	// Edits that leave metadata-only copy-ups (of a fork file, of an image file under
	// the workdir, of an image file moved in) and a renamed directory in a direct
	// upper; the commit must still equal the merged workdir.
	for _, f := range []string{"app/README.md", "app/node_modules/dep/index.js"} {
		if err := os.Chmod(filepath.Join(rootfs, f), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	srcDir := "app/lib"
	if err := os.Rename(filepath.Join(rootfs, "app/src"), filepath.Join(rootfs, srcDir)); err != nil {
		if direct || !errors.Is(err, unix.EXDEV) { // nested: no redirect_dir, so mv would copy
			t.Fatal(err)
		}
		srcDir = "app/src"
	}
	if err := os.Rename(filepath.Join(rootfs, "bin/tool"), filepath.Join(rootfs, srcDir, "tool")); err != nil {
		t.Fatal(err)
	}

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
	if !slices.EqualFunc(m2, mounts, func(a, b mount.Mount) bool {
		return a.Type == b.Type && a.Source == b.Source && slices.Equal(a.Options, b.Options)
	}) {
		t.Errorf("mounts after restart %+v, before %+v", m2, mounts)
	}
	want, _, err := ingest.Dir(ctx, e2.store, filepath.Join(rootfs, "app"), ingest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := mount.UnmountAll(rootfs, 0); err != nil {
		t.Fatal(err)
	}
	if err := e2.sn.Remove(ctx, "c1"); err != nil {
		t.Fatal(err)
	}
	if got := forkOf(t, e2.db, "c1").Root; got != want {
		t.Errorf("commit %s, want %s (the merged workdir)", got, want)
	}
	if left, _ := kview.List(views); len(left) != 0 {
		t.Errorf("kernel views left: %v", left)
	}
}

// TestKernelViewManyLayers: a fork over 128 image layers (containerd's suite's deepest
// case) gets a nested view, since containerd cannot shorten a lowerdir with a
// data-only layer; its overlay mounts through containerd's mount code and shows both
// the fork and the deepest layer.
func TestKernelViewManyLayers(t *testing.T) {
	ctx, e := kernelEnv(t)
	parent := ""
	for i := range 128 {
		name, key := fmt.Sprintf("layer-%d", i), fmt.Sprintf("layer-%d-active", i)
		mounts, err := e.sn.Prepare(ctx, key, parent)
		if err != nil {
			t.Fatal(err)
		}
		withMounted(t, mounts, func(dir string) { writeFiles(t, dir, map[string]string{fmt.Sprintf("layers/%d", i): "x\n"}) })
		if err := e.sn.Commit(ctx, name, key); err != nil {
			t.Fatal(err)
		}
		parent = name
	}
	src := ingestFiles(t, e.store, sourceFiles)
	for _, c := range []struct{ key, parent string }{{"shallow", "layer-0"}, {"deep", parent}} {
		mounts, err := e.sn.Prepare(ctx, c.key, c.parent, labels(binding.LabelFork, src.String(), binding.LabelWorkdir, "/app"))
		if err != nil {
			t.Fatal(err)
		}
		direct := os.Getenv("TIDEPOOL_VIEWS_LAYERING") != snapshotter.LayeringNested && c.key == "shallow"
		if got := strings.Contains(strings.Join(mounts[0].Options, ","), "::"); got != direct {
			t.Errorf("%s: direct layering %v, want %v: %v", c.key, got, direct, mounts[0].Options)
		}
		withMounted(t, mounts, func(dir string) {
			if got := readFile(t, filepath.Join(dir, "app/README.md")); got != sourceFiles["README.md"] {
				t.Errorf("%s: fork file %q", c.key, got)
			}
			if got := readFile(t, filepath.Join(dir, "layers/0")); got != "x\n" {
				t.Errorf("%s: deepest layer's file %q", c.key, got)
			}
		})
		if err := e.sn.Remove(ctx, c.key); err != nil {
			t.Fatal(err)
		}
	}
}

// TestKernelViewPrebuilt: Prepare starts a kernel view's image as soon as it knows the
// root (kview.Host.Prebuild), and the mount finds that build instead of building
// again; a Prepare that fails after the build started (its parent does not exist)
// still waits for the build, so nothing of it outlives the call.
func TestKernelViewPrebuilt(t *testing.T) {
	ctx, e := kernelEnv(t)
	e.imageLayer(t, "layer1", imageFiles)
	src := ingestFiles(t, e.store, sourceFiles)
	stats := e.views.Kernel().Stats()
	if _, err := e.sn.Prepare(ctx, "c1", "layer1", labels(binding.LabelFork, src.String(), binding.LabelWorkdir, "/app")); err != nil {
		t.Fatal(err)
	}
	if b, h := stats.Builds.Load(), stats.CacheHits.Load(); b != 1 || h != 1 {
		t.Fatalf("after one Prepare: %d image builds and %d cache hits, want 1 build (the prebuild) and 1 hit (the mount)", b, h)
	}
	if _, err := e.sn.Prepare(ctx, "c2", "no-such-parent", labels(binding.LabelFork, src.String(), binding.LabelWorkdir, "/app", binding.LabelOwner, "7:7")); err == nil {
		t.Fatal("Prepare over a missing parent succeeded")
	}
	if b, d := stats.Builds.Load(), stats.Derived.Load(); b != 1 || d != 1 {
		t.Fatalf("%d image builds and %d derived after a failed Prepare of a new owner's view, want 1 and 1: the prebuild (derived from the first owner's image) ran to its end before Prepare returned", b, d)
	}
	ents, err := os.ReadDir(e.views.Kernel().Cache().Dir())
	if err != nil {
		t.Fatal(err)
	}
	for _, de := range ents {
		if strings.HasPrefix(de.Name(), ".tmp-") {
			t.Errorf("image cache holds %s after Prepare returned", de.Name())
		}
	}
	if err := e.sn.Remove(ctx, "c1"); err != nil {
		t.Fatal(err)
	}
}

// TestKernelViewPreparedOnArrival: a container's commit builds the image of its
// fork's next root, for that container's workdir and owner, in the background; a root
// that arrives through RootArrived (a fork made or moved through the local API) is
// built for the shapes of recent views. The containers that then run on those roots
// find their images cached: no build on their create path.
func TestKernelViewPreparedOnArrival(t *testing.T) {
	ctx, e := kernelEnv(t)
	e.imageLayer(t, "layer1", imageFiles)
	src := ingestFiles(t, e.store, sourceFiles)
	stats := e.views.Kernel().Stats()
	builds := func(want int64) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for stats.Builds.Load()+stats.Derived.Load() < want && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		if got := stats.Builds.Load() + stats.Derived.Load(); got != want {
			t.Fatalf("%d images built, want %d", got, want)
		}
	}
	view := labels(binding.LabelFork, src.String(), binding.LabelWorkdir, "/app", binding.LabelOwner, "5:5")
	mounts, err := e.sn.Prepare(ctx, "c1", "layer1", view)
	if err != nil {
		t.Fatal(err)
	}
	withMounted(t, mounts, func(dir string) { writeFiles(t, dir, map[string]string{"app/new.txt": "new\n"}) })
	if err := e.sn.Remove(ctx, "c1"); err != nil {
		t.Fatal(err)
	}
	f := forkOf(t, e.db, "c1")
	if f.Root == src {
		t.Fatal("the commit did not move the fork")
	}
	builds(2) // c1's view, then the commit's root
	hits := stats.CacheHits.Load()
	if _, err := e.sn.Prepare(ctx, "c2", "layer1", labels(binding.LabelFork, f.ID, binding.LabelWorkdir, "/app", binding.LabelOwner, "5:5")); err != nil {
		t.Fatal(err)
	}
	builds(2)
	if got := stats.CacheHits.Load() - hits; got < 1 {
		t.Fatalf("container on the committed root: %d cache hits, want its image found cached", got)
	}

	other := ingestFiles(t, e.store, map[string]string{"other/file": "other\n"})
	e.sn.RootArrived(other)
	builds(3)
	if _, err := e.sn.Prepare(ctx, "c3", "layer1", labels(binding.LabelFork, other.String(), binding.LabelWorkdir, "/app", binding.LabelOwner, "5:5")); err != nil {
		t.Fatal(err)
	}
	builds(3)
	for _, k := range []string{"c2", "c3"} {
		if err := e.sn.Remove(ctx, k); err != nil {
			t.Fatal(err)
		}
	}
}
