package snapshotter_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/errdefs"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/casstore/ingest"
	"github.com/tidepool-dev/tidepool/snapshotter"
)

// bindSlave binds slot at dir as a container does with the member's slot mount
// (rbind, rslave): what is later mounted onto the slot shows at dir.
func bindSlave(t testing.TB, slot, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(slot, dir, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("", dir, "", unix.MS_SLAVE|unix.MS_REC, ""); err != nil {
		t.Fatal(err)
	}
}

// TestSlotBind: a snapshot prepared with a slot has no view in its rootfs; binding a
// fork mounts it, writable, onto the slot, and so at the workdir of whatever binds
// the slot as a slave (a container). The workdir shows the fork and the image's own
// files under it, is owned by the owner, takes edits that leave metadata-only
// copy-ups and redirects, and survives a restart of the snapshotter; a branch and the
// commit on removal equal the merged workdir; removal leaves no mount and no slot.
func TestSlotBind(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	root := t.TempDir()
	detachOnFailure(t, root)
	e := newEnv(t, root)
	e.imageLayer(t, "layer1", imageFiles)
	src := ingestFiles(t, e.store, sourceFiles)
	mounts, err := e.sn.Prepare(ctx, "member", "layer1", labels(binding.LabelLateBind, "true", binding.LabelSlot, "true",
		binding.LabelWorkdir, "/app", binding.LabelOwner, "1000:1000"))
	if err != nil {
		t.Fatal(err)
	}
	if opts := strings.Join(mounts[0].Options, ","); strings.Contains(opts, "/views/") {
		t.Fatalf("a slot snapshot's rootfs has a view in it: %s", opts)
	}
	slot, err := e.sn.SlotDir(ctx, "member")
	if err != nil || slot != filepath.Join(root, "slots", filepath.Base(slot)) {
		t.Fatalf("slot %q: %v", slot, err)
	}
	if _, err := e.sn.SlotDir(ctx, "layer1"); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("slot of an image layer: %v", err)
	}
	rootfs := t.TempDir()
	if err := mount.All(mounts, rootfs); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mount.UnmountAll(rootfs, 0) })
	app := filepath.Join(rootfs, "app")
	bindSlave(t, slot, app)
	t.Cleanup(func() { mount.UnmountAll(app, unix.MNT_DETACH) })
	if ents, _ := os.ReadDir(app); len(ents) != 0 {
		t.Fatalf("an unbound slot shows %v", ents)
	}
	if err := e.sn.CheckLateBind(ctx, "member"); err != nil {
		t.Fatalf("an unbound slot snapshot: %v", err)
	}

	res, err := e.sn.Bind(ctx, snapshotter.BindRequest{Key: "member", Fork: src.String()})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.sn.CheckLateBind(ctx, "member"); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("a bound slot snapshot can be bound again: %v", err)
	}
	if got := readFile(t, filepath.Join(app, "src/main.js")); got != sourceFiles["src/main.js"] {
		t.Fatalf("fork file at the workdir: %q", got)
	}
	if got := readFile(t, filepath.Join(app, "node_modules/dep/index.js")); got != imageFiles["app/node_modules/dep/index.js"] {
		t.Fatalf("image file under the workdir: %q", got)
	}
	assertOwner(t, app, 1000, 1000)
	assertOwner(t, filepath.Join(app, "src/main.js"), 1000, 1000)

	// Edits: new, changed and deleted files, chmods of a fork file and of an image
	// file (metadata-only copy-ups with metacopy), a renamed directory (a redirect
	// with redirect_dir; a copy where the overlay has none).
	writeFiles(t, app, map[string]string{"new.txt": "new\n", "README.md": "# changed\n"})
	for _, f := range []string{"src/main.js", "node_modules/dep/index.js"} {
		if err := os.Chmod(filepath.Join(app, f), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Remove(filepath.Join(app, "src/old.js")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(app, "src"), filepath.Join(app, "lib")); err != nil && !errors.Is(err, unix.EXDEV) {
		t.Fatal(err)
	}
	want, _, err := ingest.Dir(ctx, e.store, app, ingest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	br, err := e.sn.Branch(ctx, snapshotter.BranchRequest{Key: "member"})
	if err != nil || br.Root != want {
		t.Fatalf("branch of a slot snapshot: %s %v, want %s (the merged workdir)", br.Root, err, want)
	}

	// A restart: a kernel view and the slot's overlay stay, and the workdir keeps
	// working. (A FUSE view's server would not exit while the overlay holds its
	// mount: the restart is for kernel views.)
	e2 := e
	if e.views.Kernel() != nil {
		e.close(t)
		e2 = newEnv(t, root)
		if got := readFile(t, filepath.Join(app, "new.txt")); got != "new\n" {
			t.Fatalf("workdir after a restart: %q", got)
		}
	}
	if m, err := e2.sn.Mounts(ctx, "member"); err != nil || strings.Contains(strings.Join(m[0].Options, ","), "/views/") {
		t.Fatalf("mounts after restart %+v %v", m, err)
	}
	if err := mount.UnmountAll(app, unix.MNT_DETACH); err != nil { // the container goes
		t.Fatal(err)
	}
	if err := mount.UnmountAll(rootfs, 0); err != nil {
		t.Fatal(err)
	}
	if err := e2.sn.Remove(ctx, "member"); err != nil {
		t.Fatal(err)
	}
	if got := forkOf(t, e2.db, res.ForkID).Root; got != want {
		t.Fatalf("commit %s, want %s (the merged workdir); changes %v", got, want, changes(t, e2.store, src, got))
	}
	if left := mountsUnder(t, root); len(left) != 0 {
		t.Fatalf("mounts left: %v", left)
	}
	for _, d := range []string{"slots", "views"} {
		if ents, _ := os.ReadDir(filepath.Join(root, d)); len(ents) != 0 {
			t.Errorf("%s left: %v", d, ents)
		}
	}
}

// TestSlotLayers: the image's content at the workdir shows in the slot's overlay as
// in a rootfs: a workdir deleted and made again in a higher layer (opaque) hides the
// lower layers' content there; and a slot whose snapshot is gone is unmounted and
// removed at the next start.
func TestSlotLayers(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	root := t.TempDir()
	detachOnFailure(t, root)
	e := newEnv(t, root)
	e.imageLayer(t, "base", map[string]string{"app/from-base": "base\n", "etc/x": "x\n"})
	// Layers over base: one deletes /app and recreates it (opaque), one only adds.
	for _, l := range []struct {
		name, parent string
		edit         func(dir string)
	}{
		{"opaque", "base", func(dir string) {
			if err := os.RemoveAll(filepath.Join(dir, "app")); err != nil {
				t.Fatal(err)
			}
			writeFiles(t, dir, map[string]string{"app/from-opaque": "opaque\n"})
		}},
		{"top", "opaque", func(dir string) { writeFiles(t, dir, map[string]string{"app/from-top": "top\n"}) }},
	} {
		mounts, err := e.sn.Prepare(ctx, l.name+"-active", l.parent)
		if err != nil {
			t.Fatal(err)
		}
		withMounted(t, mounts, l.edit)
		if err := e.sn.Commit(ctx, l.name, l.name+"-active"); err != nil {
			t.Fatal(err)
		}
	}
	src := ingestFiles(t, e.store, sourceFiles)
	if _, err := e.sn.Prepare(ctx, "m", "top", labels(binding.LabelLateBind, "true", binding.LabelSlot, "true", binding.LabelWorkdir, "/app")); err != nil {
		t.Fatal(err)
	}
	if _, err := e.sn.Bind(ctx, snapshotter.BindRequest{Key: "m", Fork: src.String()}); err != nil {
		t.Fatal(err)
	}
	slot, _ := e.sn.SlotDir(ctx, "m")
	ents, err := os.ReadDir(slot)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	if got := strings.Join(names, ","); got != "README.md,from-opaque,from-top,src" {
		t.Fatalf("the slot shows %s", got)
	}

	if err := e.sn.Remove(ctx, "m"); err != nil {
		t.Fatal(err)
	}
	if mounted, _ := mountinfo.Mounted(slot); mounted {
		t.Fatalf("slot %s still mounted after removal", slot)
	}
	if left := mountsUnder(t, root); len(left) != 0 {
		t.Fatalf("mounts left: %v", left)
	}

	// A slot whose snapshot went while no snapshotter ran is removed at the next start.
	e.close(t)
	orphan := filepath.Join(root, "slots", "999")
	if err := os.Mkdir(orphan, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(orphan, orphan, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	newEnv(t, root)
	if _, err := os.Stat(orphan); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("orphaned slot: %v", err)
	}
	if left := mountsUnder(t, root); len(left) != 0 {
		t.Fatalf("mounts left: %v", left)
	}
}

// detachOnFailure detaches whatever a failed test left mounted under dir, so that
// its temp dir can go.
func detachOnFailure(t testing.TB, dir string) {
	t.Cleanup(func() {
		left := mountsUnder(t, dir)
		for i := len(left) - 1; i >= 0; i-- {
			unix.Unmount(left[i], unix.MNT_DETACH)
		}
	})
}

func mountsUnder(t testing.TB, dir string) []string {
	t.Helper()
	ms, err := mountinfo.GetMounts(mountinfo.PrefixFilter(dir))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, m := range ms {
		out = append(out, m.Mountpoint)
	}
	return out
}

// TestSlotPrebuild: a view prebuilt for a root (the root a pool claim committed) is
// what the next slot bind of that root mounts: built once, found by the bind.
func TestSlotPrebuild(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	root := t.TempDir()
	detachOnFailure(t, root)
	e := newEnv(t, root)
	k := e.views.Kernel()
	if k == nil {
		t.Skip("no kernel views: nothing to prebuild")
	}
	e.imageLayer(t, "layer1", imageFiles)
	src := ingestFiles(t, e.store, sourceFiles)
	if err := e.sn.PrebuildSlotView(ctx, src, "1000:1000"); err != nil {
		t.Fatal(err)
	}
	if err := e.sn.PrebuildSlotView(ctx, src, "1000"); err == nil || !strings.Contains(err.Error(), "owner") {
		t.Fatalf("a bad owner: %v", err)
	}
	builds, hits := k.Stats().Builds.Load(), k.Stats().CacheHits.Load()
	if builds != 1 {
		t.Fatalf("%d images built, want 1", builds)
	}
	if _, err := e.sn.Prepare(ctx, "m", "layer1", labels(binding.LabelLateBind, "true", binding.LabelSlot, "true",
		binding.LabelWorkdir, "/app", binding.LabelOwner, "1000:1000")); err != nil {
		t.Fatal(err)
	}
	if _, err := e.sn.Bind(ctx, snapshotter.BindRequest{Key: "m", Fork: src.String()}); err != nil {
		t.Fatal(err)
	}
	if b, h := k.Stats().Builds.Load(), k.Stats().CacheHits.Load(); b != builds || h != hits+1 {
		t.Fatalf("the bind built %d images and found %d cached, want 0 and 1", b-builds, h-hits)
	}
	if err := e.sn.Remove(ctx, "m"); err != nil {
		t.Fatal(err)
	}
}
