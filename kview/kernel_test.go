package kview

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"testing"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/casstoretest"
	"github.com/tidepool-dev/tidepool/casstore/ingest"
)

// requireKernel skips tests that mount unless running as root on a kernel where the
// probe passes; with TIDEPOOL_REQUIRE_KVIEW=1 (CI on a known-good host) a failing
// probe fails the test instead.
func requireKernel(t testing.TB) {
	t.Helper()
	if testing.Short() {
		t.Skip("mounts EROFS and overlayfs: skipped with -short")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts EROFS and overlayfs")
	}
	if err := Probe(t.TempDir()); err != nil {
		if os.Getenv("TIDEPOOL_REQUIRE_KVIEW") == "1" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
}

func newHost(t testing.TB, s *casstore.Store) *Host {
	t.Helper()
	h, err := NewHost(s, filepath.Join(t.TempDir(), "images"))
	if err != nil {
		t.Fatal(err)
	}
	return h
}

func mountT(t testing.TB, h *Host, spec Spec) string {
	t.Helper()
	dir := t.TempDir()
	if err := h.Mount(context.Background(), dir, spec); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
			t.Errorf("cleanup unmount %s: %v", dir, err)
		}
	})
	return dir
}

func TestProbe(t *testing.T) {
	requireKernel(t) // the probe passing is the test; a failure says what is missing
}

// TestKernelViewGoTree mounts the Go source tree as a kernel view and re-ingests it
// through the view: the same root, so every name, mode, link and byte is the same.
func TestKernelViewGoTree(t *testing.T) {
	requireKernel(t)
	s := casstoretest.NewStore(t)
	src := filepath.Join(runtime.GOROOT(), "src")
	root, _, err := ingest.Dir(context.Background(), s, src, ingest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	h := newHost(t, s)
	dir := mountT(t, h, Spec{Root: root, Prefix: "work/app", UID: 4242, GID: 4343})
	got, _, err := ingest.Dir(context.Background(), casstoretest.NewStore(t), filepath.Join(dir, "work/app"), ingest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if got != root {
		t.Fatalf("re-ingest through the kernel view gives %s, want %s", got, root)
	}
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(dir, "work/app/go/ast/ast.go"), &st); err != nil {
		t.Fatal(err)
	}
	if st.Uid != 4242 || st.Gid != 4343 || st.Mtim.Sec != Mtime || st.Nlink != 1 {
		t.Errorf("file uid %d gid %d mtime %d nlink %d", st.Uid, st.Gid, st.Mtim.Sec, st.Nlink)
	}
	if err := unix.Lstat(filepath.Join(dir, "work"), &st); err != nil || st.Uid != 0 || st.Gid != 0 {
		t.Errorf("prefix parent: uid %d gid %d err %v, want 0:0", st.Uid, st.Gid, err)
	}
	if err := os.WriteFile(filepath.Join(dir, "work/app/x"), nil, 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("write into the view: %v, want EROFS", err)
	}
}

// TestMountedSeesTheTopMount: only the topmost mount at a directory counts. A view
// with something mounted over it is not what a walk of the directory finds: it is not
// mounted there for IsMounted, and unmountView leaves the cover alone, until the cover
// goes.
func TestMountedSeesTheTopMount(t *testing.T) {
	requireKernel(t)
	s := casstoretest.NewStore(t)
	dir := mountT(t, newHost(t, s), Spec{Root: fixture(t, s)})
	if !IsMounted(dir) {
		t.Fatal("a mounted view is not seen as mounted")
	}
	if err := unix.Mount("cover", dir, "tmpfs", 0, "size=64k"); err != nil {
		t.Fatal(err)
	}
	covered := true
	t.Cleanup(func() {
		if covered {
			unix.Unmount(dir, unix.MNT_DETACH)
		}
	})
	if IsMounted(dir) {
		t.Error("a view under a tmpfs is seen as mounted")
	}
	if err := unmountView(dir); err != nil {
		t.Fatal(err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil || st.Type != unix.TMPFS_MAGIC {
		t.Fatalf("after unmountView: statfs %v, magic %#x: it unmounted the tmpfs over the view", err, st.Type)
	}
	if err := unix.Unmount(dir, 0); err != nil {
		t.Fatal(err)
	}
	covered = false
	if !IsMounted(dir) {
		t.Error("the view is not seen again once uncovered")
	}
}

// TestKernelRootReadDir is the kernel side of TestRootInodeNotZero: the mounted image's
// root has a non-zero inode and os.ReadDir lists every entry.
func TestKernelRootReadDir(t *testing.T) {
	requireKernel(t)
	s := casstoretest.NewStore(t)
	root := fixture(t, s)
	tr, err := Scan(context.Background(), s, Spec{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(t.TempDir(), "i.erofs")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	if err := tr.WriteImage(f); err != nil {
		t.Fatal(err)
	}
	f.Close()
	mfd, err := fsmount("erofs", map[string]string{"source": img}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(mfd)
	dir := t.TempDir()
	if err := unix.MoveMount(mfd, "", unix.AT_FDCWD, dir, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(dir, unix.MNT_DETACH)
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil || st.Ino == 0 {
		t.Fatalf("root of the mounted image: ino %d, %v", st.Ino, err)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 6 { // README.md bin empty link nothing src
		t.Errorf("os.ReadDir of the mounted image root: %d entries, want 6: %v", len(ents), ents)
	}
}

// TestMissingObjectAfterMount: an object deleted under a mounted view fails the open
// of that file only (ENOENT), and putting it back heals it.
func TestMissingObjectAfterMount(t *testing.T) {
	requireKernel(t)
	s := casstoretest.NewStore(t)
	root := fixture(t, s)
	dir := mountT(t, newHost(t, s), Spec{Root: root})
	gone := casstore.Sum([]byte("package b\n"))
	if err := os.Remove(s.Path(gone)); err != nil {
		t.Fatal(err)
	}
	if _, err := os.ReadFile(filepath.Join(dir, "src/a/b/deep.go")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("read of a file whose object is gone: %v, want ENOENT", err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "src/main.go")); err != nil || string(b) != "package main\n" {
		t.Fatalf("another file: %q, %v", b, err)
	}
	if fi, err := os.Stat(filepath.Join(dir, "src/a/b/deep.go")); err != nil || fi.Size() != 10 {
		t.Fatalf("stat of the file still works: %v %v", fi, err)
	}
	if _, err := s.PutBytes([]byte("package b\n")); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "src/a/b/deep.go")); err != nil || string(b) != "package b\n" {
		t.Fatalf("after the object came back: %q, %v", b, err)
	}
}

// TestMountRefusesMissing: a tree whose objects are not all local is not mounted, the
// error names the object, and nothing is left mounted; a hydrator that brings the
// object makes the mount work.
func TestMountRefusesMissing(t *testing.T) {
	requireKernel(t)
	s := casstoretest.NewStore(t)
	root := fixture(t, s)
	gone := casstore.Sum([]byte("package b\n"))
	removeObject(t, s, gone)
	h := newHost(t, s)
	dir := t.TempDir()
	err := h.Mount(context.Background(), dir, Spec{Root: root})
	var miss *MissingError
	if !errors.As(err, &miss) || !errdefs.IsNotFound(err) || len(miss.Objects) != 1 || miss.Objects[0] != gone {
		t.Fatalf("mount with a missing object: %v", err)
	}
	if IsMounted(dir) {
		t.Fatal("a view was mounted anyway")
	}
	// The cached image (if any) must not make a second try pass.
	if err := h.Mount(context.Background(), dir, Spec{Root: root}); !errors.As(err, &miss) {
		t.Fatalf("second mount with a missing object: %v", err)
	}
	h.Hydrator = hydrateFunc(func(ctx context.Context, objs []casstore.Hash) error {
		if len(objs) != 1 || objs[0] != gone {
			t.Errorf("hydrate %v, want [%s]", objs, gone)
		}
		_, err := s.PutBytes([]byte("package b\n"))
		return err
	})
	dir = mountT(t, h, Spec{Root: root})
	if b, err := os.ReadFile(filepath.Join(dir, "src/a/b/deep.go")); err != nil || string(b) != "package b\n" {
		t.Fatalf("hydrated view: %q, %v", b, err)
	}
}

type hydrateFunc func(context.Context, []casstore.Hash) error

func (f hydrateFunc) Hydrate(ctx context.Context, objs []casstore.Hash) error { return f(ctx, objs) }

// TestCacheSharedAndCollected: concurrent mounts of one spec build one image; Collect
// keeps it while a view uses it and removes it after; the view keeps working after
// its image file is gone.
func TestCacheSharedAndCollected(t *testing.T) {
	requireKernel(t)
	s := casstoretest.NewStore(t)
	root := fixture(t, s)
	h := newHost(t, s)
	spec := Spec{Root: root, Prefix: "app", UID: 1, GID: 1}
	const n = 8
	dirs := make([]string, n)
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range dirs {
		dirs[i] = t.TempDir()
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = h.Mount(context.Background(), dirs[i], spec)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("mount %d: %v", i, err)
		}
		defer unix.Unmount(dirs[i], unix.MNT_DETACH)
	}
	if b, hits := h.Stats().Builds.Load(), h.Stats().CacheHits.Load(); b != 1 || hits != n-1 {
		t.Errorf("%d builds, %d cache hits; want 1 and %d", b, hits, n-1)
	}
	if err := h.Mount(context.Background(), dirs[0], spec); !errdefs.IsAlreadyExists(err) {
		t.Errorf("second mount at one dir: %v, want AlreadyExists", err)
	}
	img := filepath.Join(h.Cache().Dir(), spec.Key()+".erofs")
	if removed, err := h.Cache().Collect(context.Background(), 0); err != nil || removed != 0 {
		t.Fatalf("collect with views mounted: removed %d, %v", removed, err)
	}
	roots, err := h.Cache().MountedRoots()
	if err != nil || len(roots) != 1 || roots[0] != root {
		t.Errorf("mounted roots %v, %v; want [%s]", roots, err, root)
	}
	for i := 1; i < n; i++ {
		if err := h.Unmount(context.Background(), dirs[i]); err != nil {
			t.Fatal(err)
		}
		if IsMounted(dirs[i]) {
			t.Fatalf("%s still mounted", dirs[i])
		}
	}
	if _, err := os.Stat(img); err != nil {
		t.Fatalf("image gone while a view uses it: %v", err)
	}
	// The image file is only needed to mount: remove it under the live view.
	if err := os.Remove(img); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(dirs[0], "app/README.md")); err != nil || string(b) != "hello\n" {
		t.Fatalf("view after its image file was removed: %q, %v", b, err)
	}
	if err := h.Unmount(context.Background(), dirs[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := h.Cache().Collect(context.Background(), 0); err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(h.Cache().Dir()); len(ents) != 0 {
		t.Errorf("cache not empty after collection with no views: %v", ents)
	}
	if err := h.Unmount(context.Background(), dirs[0]); err != nil {
		t.Errorf("unmount of a dir with no view: %v", err)
	}
}

// TestMountImageDirect: an image mounted alone is found in the mount table as an
// image (its key, for collection and GC), and an overlay that layers it directly (the
// legacy mount(2) option string containerd uses: image, then "::" and the object
// directory as data-only layer, metacopy=on, redirect_dir=on) shows the tree, takes
// writes and keeps working after the image mount is detached and the image file
// removed.
func TestMountImageDirect(t *testing.T) {
	requireKernel(t)
	s := casstoretest.NewStore(t)
	root := fixture(t, s)
	h := newHost(t, s)
	spec := Spec{Root: root, Prefix: "app"}
	img := t.TempDir()
	if err := h.MountImage(context.Background(), img, spec); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(img, unix.MNT_DETACH) })
	m, err := MountedAt(img)
	if err != nil || m == nil || !m.Image || m.Key != spec.Key() {
		t.Fatalf("mount table: %+v, %v; want the image of key %s", m, err, spec.Key())
	}
	if roots, err := h.Cache().MountedRoots(); err != nil || len(roots) != 1 || roots[0] != root {
		t.Fatalf("mounted roots %v, %v; want [%s]", roots, err, root)
	}
	if removed, err := h.Cache().Collect(context.Background(), 0); err != nil || removed != 0 {
		t.Fatalf("collect with the image mounted: removed %d, %v", removed, err)
	}

	tmp := t.TempDir()
	upper, work, merged := filepath.Join(tmp, "upper"), filepath.Join(tmp, "work"), filepath.Join(tmp, "merged")
	for _, d := range []string{upper, work, merged} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	opts := "lowerdir=" + img + "::" + h.DataDir() + ",upperdir=" + upper + ",workdir=" + work + ",metacopy=on,redirect_dir=on"
	if err := unix.Mount("overlay", merged, "overlay", 0, opts); err != nil {
		t.Fatalf("mount overlay %s: %v", opts, err)
	}
	t.Cleanup(func() { _ = unix.Unmount(merged, unix.MNT_DETACH) })
	if b, err := os.ReadFile(filepath.Join(merged, "app/README.md")); err != nil || string(b) != "hello\n" {
		t.Fatalf("read through the overlay: %q, %v", b, err)
	}
	// The image mount can go (the overlay holds its own reference), and its file too.
	if err := h.Unmount(context.Background(), img); err != nil {
		t.Fatal(err)
	}
	if IsMounted(img) {
		t.Fatal("image still mounted")
	}
	if err := os.Remove(filepath.Join(h.Cache().Dir(), spec.Key()+".erofs")); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Join(merged, "app/README.md"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(merged, "app/src"), filepath.Join(merged, "app/src2")); err != nil {
		t.Fatalf("rename of an image dir (redirect_dir=on): %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(merged, "app/src2/main.go")); err != nil || string(b) != "package main\n" {
		t.Fatalf("read in the renamed dir: %q, %v", b, err)
	}
	if b, err := os.ReadFile(filepath.Join(merged, "app/README.md")); err != nil || string(b) != "hello\n" {
		t.Fatalf("read after chmod: %q, %v", b, err)
	}
	if fi, err := os.Stat(filepath.Join(upper, "app/README.md")); err != nil || fi.Size() != int64(len("hello\n")) {
		t.Fatalf("upper after chmod: %v, %v", fi, err)
	}
	// A missing object fails the open of that file only, with ENOENT.
	if err := os.Remove(s.Path(casstore.Sum([]byte("package b\n")))); err != nil {
		t.Fatal(err)
	}
	if _, err := os.ReadFile(filepath.Join(merged, "app/src2/a/b/deep.go")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("read of a file whose object is gone: %v, want ENOENT", err)
	}
	if b, err := os.ReadFile(filepath.Join(merged, "app/src2/same.go")); err != nil || string(b) != "package main\n" {
		t.Fatalf("another file: %q, %v", b, err)
	}
}

// TestMountObjectsInJournal: objects that are only in a journal (another process's
// pull or branch whose objects have not reached their names yet, or a dead writer's)
// are put in place by the view's scan; the view mounts with no hydrator, shows their
// bytes, and every object it names is a file under its name.
func TestMountObjectsInJournal(t *testing.T) {
	requireKernel(t)
	src := casstoretest.NewStore(t)
	root := fixture(t, src)
	var objs []casstore.Hash
	if err := src.Walk(func(h casstore.Hash, _ string) error { objs = append(objs, h); return nil }); err != nil {
		t.Fatal(err)
	}
	s2 := casstoretest.NewStore(t)
	casstoretest.DeadJournal(t, s2, src, objs...)
	h := newHost(t, s2)
	dir := mountT(t, h, Spec{Root: root})
	if b, err := os.ReadFile(filepath.Join(dir, "src/a/b/large.bin")); err != nil || len(b) != 16*70000 {
		t.Fatalf("view of journaled objects: %d bytes, %v", len(b), err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "bin/run.sh")); err != nil || string(b) != "#!/bin/sh\necho run\n" {
		t.Fatalf("view of journaled objects: %q, %v", b, err)
	}
	for _, o := range objs {
		if o == casstore.EmptyHash {
			continue // an empty file needs no object file
		}
		if _, err := os.Lstat(s2.Path(o)); err != nil {
			t.Fatalf("object %s named by the view is not under its name: %v", o, err)
		}
	}
}
