package snapshotter_test

import (
	"context"
	"flag"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/testsuite"
	"github.com/containerd/errdefs"

	"github.com/tidepool-dev/tidepool/binding"
	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/casstore/forks"
	"github.com/tidepool-dev/tidepool/casstore/ingest"
	"github.com/tidepool-dev/tidepool/casstore/treediff"
	"github.com/tidepool-dev/tidepool/fuse"
	"github.com/tidepool-dev/tidepool/plugin"
	"github.com/tidepool-dev/tidepool/snapshotter"
)

func TestMain(m *testing.M) {
	if os.Geteuid() == 0 {
		// containerd's test suite skips root tests unless -test.root is set; as root
		// we always want them.
		flag.Parse()
		if f := flag.Lookup("test.root"); f != nil {
			f.Value.Set("true")
		}
	}
	os.Exit(m.Run())
}

func requireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: real overlay and FUSE mounts")
	}
}

// env is one snapshotter with its store, fork database and in-process view host.
type env struct {
	root  string
	store *casstore.Store
	db    *forks.DB
	views *plugin.ViewHost
	sn    *snapshotter.Snapshotter
}

// viewsMode is the views.mode the tests run with: TIDEPOOL_VIEWS_MODE, default auto
// (kernel views where the kernel supports them). `make test` runs them with fuse too.
func viewsMode() string {
	if m := os.Getenv("TIDEPOOL_VIEWS_MODE"); m != "" {
		return m
	}
	return plugin.ModeAuto
}

func newEnv(t testing.TB, root string) *env {
	t.Helper()
	ctx := context.Background()
	store, err := casstore.Open(filepath.Join(root, "cas"))
	if err != nil {
		t.Fatal(err)
	}
	db, err := forks.OpenDB(filepath.Join(root, "forks.db"), time.Second)
	if err != nil {
		t.Fatal(err)
	}
	cfg := plugin.DefaultConfig().Views
	cfg.Mode = viewsMode()
	views, err := plugin.NewViewHost(store, cfg, root)
	if err != nil {
		t.Fatal(err)
	}
	sn, err := snapshotter.New(ctx, snapshotter.Config{Root: root, ViewLayering: os.Getenv("TIDEPOOL_VIEWS_LAYERING")}, store, db, views)
	if err != nil {
		db.Close()
		t.Fatal(err)
	}
	e := &env{root: root, store: store, db: db, views: views, sn: sn}
	t.Cleanup(func() { e.close(t) })
	return e
}

func (e *env) close(t testing.TB) {
	if e.sn == nil {
		return
	}
	if err := e.sn.Close(); err != nil {
		t.Error(err)
	}
	e.store.Settle() // journaled branches settle before the temp dir goes
	if err := e.views.Close(context.Background()); err != nil {
		t.Error(err)
	}
	e.db.Close()
	e.sn = nil
}

// TestSnapshotterSuite runs containerd's conformance suite, 128-layer mount included,
// on the tidepool snapshotter without forks: it must behave as overlayfs. The suite is
// told the name "overlayfs" because its only use of the name is to expect overlayfs's
// documented limit (renaming a lower directory needs redirect_dir), which applies to
// tidepool exactly as it does to containerd's overlay snapshotter.
func TestSnapshotterSuite(t *testing.T) {
	requireRoot(t)
	testsuite.SnapshotterSuite(t, "overlayfs", func(ctx context.Context, root string) (snapshots.Snapshotter, func() error, error) {
		e := newEnv(t, root)
		return e.sn, func() error { e.close(t); return nil }, nil
	})
}

func writeFiles(t testing.TB, dir string, files map[string]string) {
	t.Helper()
	for p, content := range files {
		full := filepath.Join(dir, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func ingestFiles(t testing.TB, s *casstore.Store, files map[string]string) casstore.Hash {
	t.Helper()
	dir := t.TempDir()
	writeFiles(t, dir, files)
	root, _, err := ingest.Dir(context.Background(), s, dir, ingest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// imageLayer commits a layer holding files, as an image unpack would.
func (e *env) imageLayer(t testing.TB, name string, files map[string]string) {
	t.Helper()
	ctx := context.Background()
	key := name + "-active"
	mounts, err := e.sn.Prepare(ctx, key, "")
	if err != nil {
		t.Fatal(err)
	}
	withMounted(t, mounts, func(dir string) { writeFiles(t, dir, files) })
	if err := e.sn.Commit(ctx, name, key); err != nil {
		t.Fatal(err)
	}
}

func withMounted(t testing.TB, mounts []mount.Mount, fn func(dir string)) {
	t.Helper()
	dir := t.TempDir()
	if err := mount.All(mounts, dir); err != nil {
		t.Fatalf("mount %+v: %v", mounts, err)
	}
	defer func() {
		if err := mount.UnmountAll(dir, 0); err != nil {
			t.Errorf("unmount: %v", err)
		}
	}()
	fn(dir)
}

func readFile(t testing.TB, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func labels(kv ...string) snapshots.Opt {
	m := map[string]string{}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return snapshots.WithLabels(m)
}

func changes(t testing.TB, s *casstore.Store, a, b casstore.Hash) []string {
	t.Helper()
	cs, err := treediff.Diff(context.Background(), s, a, b)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, c := range cs {
		out = append(out, c.String())
	}
	sort.Strings(out)
	return out
}

func forkOf(t testing.TB, db *forks.DB, label string) *forks.Fork {
	t.Helper()
	f, err := db.Get(context.Background(), label)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

var sourceFiles = map[string]string{
	"README.md":   "# demo\n",
	"src/main.js": "console.log(require('dep'))\n",
	"src/old.js":  "old\n",
}

var imageFiles = map[string]string{
	"app/node_modules/dep/index.js": "module.exports = 'dep'\n",
	"bin/tool":                      "#!/bin/sh\n",
}

// TestForkFromLabels: baked layer + fork view + upper, then the changes become the
// fork's next root when the snapshot is removed.
func TestForkFromLabels(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	e := newEnv(t, t.TempDir())
	e.imageLayer(t, "layer1", imageFiles)
	root := ingestFiles(t, e.store, sourceFiles)

	mounts, err := e.sn.Prepare(ctx, "c1", "layer1", labels(binding.LabelFork, root.String(), binding.LabelWorkdir, "/app"))
	if err != nil {
		t.Fatal(err)
	}
	withMounted(t, mounts, func(dir string) {
		if got := readFile(t, filepath.Join(dir, "app/node_modules/dep/index.js")); got != imageFiles["app/node_modules/dep/index.js"] {
			t.Errorf("image file through the overlay: %q", got)
		}
		if got := readFile(t, filepath.Join(dir, "app/src/main.js")); got != sourceFiles["src/main.js"] {
			t.Errorf("fork file through the overlay: %q", got)
		}
		if _, err := os.Stat(filepath.Join(dir, "bin/tool")); err != nil {
			t.Error(err)
		}
		writeFiles(t, dir, map[string]string{"app/new.txt": "new\n", "app/README.md": "# changed\n", "etc/outside-workdir": "x"})
		if err := os.Remove(filepath.Join(dir, "app/src/old.js")); err != nil {
			t.Fatal(err)
		}
	})
	f := forkOf(t, e.db, "c1")
	if f.Root != root {
		t.Fatalf("fork at %s before remove, want %s", f.Root, root)
	}
	if err := e.sn.Remove(ctx, "c1"); err != nil {
		t.Fatal(err)
	}
	f = forkOf(t, e.db, f.ID)
	want := []string{"A new.txt", "D src/old.js", "M README.md"}
	if got := changes(t, e.store, root, f.Root); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Fatalf("fork changes %v, want %v", got, want)
	}
	if ents, _ := os.ReadDir(filepath.Join(e.root, "views")); len(ents) != 0 {
		t.Errorf("view dirs left: %v", ents)
	}
	assertNoViewMounts(t, e.root)
}

func assertNoViewMounts(t testing.TB, root string) {
	t.Helper()
	left, err := fuse.Mounts(root)
	if err != nil {
		t.Fatal(err)
	}
	if len(left) > 0 {
		t.Errorf("fork views still mounted: %v", left)
	}
}

func TestBadLabelsLeaveNothing(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	e := newEnv(t, t.TempDir())
	e.imageLayer(t, "layer1", imageFiles)
	root := ingestFiles(t, e.store, sourceFiles)
	missing := casstore.Sum([]byte("not in the store"))
	cases := []struct {
		name   string
		labels []string
		key    string
	}{
		{"malformed hash", []string{binding.LabelFork, strings.Repeat("z", 64)}, binding.LabelFork},
		{"unknown fork", []string{binding.LabelFork, "0123456789abcdef"}, binding.LabelFork},
		{"missing root", []string{binding.LabelFork, missing.String()}, binding.LabelFork},
		{"relative workdir", []string{binding.LabelFork, root.String(), binding.LabelWorkdir, "app"}, binding.LabelWorkdir},
		{"escaping workdir", []string{binding.LabelFork, root.String(), binding.LabelWorkdir, "/app/../../.."}, binding.LabelWorkdir},
		{"bad owner", []string{binding.LabelFork, root.String(), binding.LabelOwner, "agent"}, binding.LabelOwner},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := e.sn.Prepare(ctx, "bad", "layer1", labels(c.labels...))
			if err == nil || !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), c.key) {
				t.Fatalf("err = %v, want invalid argument naming %s", err, c.key)
			}
			if _, err := e.sn.Stat(ctx, "bad"); !errdefs.IsNotFound(err) {
				t.Fatalf("snapshot left behind: %v", err)
			}
		})
	}
	list, err := e.db.List(ctx)
	if err != nil || len(list) != 0 {
		t.Errorf("fork records left: %v %v", list, err)
	}
	if ents, _ := os.ReadDir(filepath.Join(e.root, "views")); len(ents) != 0 {
		t.Errorf("view dirs left: %v", ents)
	}
	assertNoViewMounts(t, e.root)
}

// TestBindByMounts is the runtime shim's path: the snapshot exists without labels, the
// shim recognises it from the rootfs mounts and binds the fork before mounting.
func TestBindByMounts(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	e := newEnv(t, t.TempDir())
	e.imageLayer(t, "layer1", imageFiles)
	root := ingestFiles(t, e.store, sourceFiles)
	other := ingestFiles(t, e.store, map[string]string{"x": "y"})

	plain, err := e.sn.Prepare(ctx, "c2", "layer1")
	if err != nil {
		t.Fatal(err)
	}
	res, err := e.sn.Bind(ctx, snapshotter.BindRequest{Rootfs: plain, Fork: root.String(), Workdir: "/app", Owner: "1000:1000"})
	if err != nil {
		t.Fatal(err)
	}
	if res.Key != "c2" || res.Root != root || res.ForkID == "" {
		t.Fatalf("bind result %+v", res)
	}
	withMounted(t, res.Mounts, func(dir string) {
		assertOwner(t, filepath.Join(dir, "app/src/main.js"), 1000, 1000)
		if _, err := os.Stat(filepath.Join(dir, "app/node_modules/dep/index.js")); err != nil {
			t.Error(err)
		}
	})
	// Same fork again: the binding in force. Another fork: a conflict.
	if again, err := e.sn.Bind(ctx, snapshotter.BindRequest{Key: "c2", Fork: res.ForkID}); err != nil || again.Root != root {
		t.Fatalf("rebind same fork: %+v %v", again, err)
	}
	if _, err := e.sn.Bind(ctx, snapshotter.BindRequest{Key: "c2", Fork: other.String()}); !errdefs.IsConflict(err) {
		t.Fatalf("rebind other fork: err = %v, want conflict", err)
	}
	m, err := e.sn.Mounts(ctx, "c2")
	if err != nil || !strings.Contains(strings.Join(m[0].Options, ","), filepath.Join(e.root, "views")) {
		t.Fatalf("Mounts after bind does not carry the view: %+v %v", m, err)
	}
	if err := e.sn.Commit(ctx, "as-layer", "c2"); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("commit of a fork-bearing snapshot: %v", err)
	}
	if err := e.sn.Remove(ctx, "c2"); err != nil {
		t.Fatal(err)
	}
}

func TestLateBind(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	e := newEnv(t, t.TempDir())
	e.imageLayer(t, "layer1", imageFiles)
	root := ingestFiles(t, e.store, sourceFiles)

	late := labels(binding.LabelLateBind, "true", binding.LabelWorkdir, "/app")
	mounts, err := e.sn.Prepare(ctx, "member", "layer1", late)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := mount.All(mounts, dir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mount.UnmountAll(dir, 0) })
	if _, err := os.Stat(filepath.Join(dir, "bin/tool")); err != nil {
		t.Fatal(err)
	}
	res, err := e.sn.Bind(ctx, snapshotter.BindRequest{Key: "member", Fork: root.String()})
	if err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, filepath.Join(dir, "app/src/main.js")); got != sourceFiles["src/main.js"] {
		t.Fatalf("fork after late bind: %q", got)
	}
	if _, err := os.Stat(filepath.Join(dir, "app/node_modules/dep/index.js")); err != nil {
		t.Fatal(err)
	}
	writeFiles(t, dir, map[string]string{"app/src/main.js": "changed\n"})
	if err := mount.UnmountAll(dir, 0); err != nil {
		t.Fatal(err)
	}
	if err := e.sn.Remove(ctx, "member"); err != nil {
		t.Fatal(err)
	}
	f := forkOf(t, e.db, res.ForkID)
	if got := changes(t, e.store, root, f.Root); len(got) != 1 || got[0] != "M src/main.js" {
		t.Fatalf("changes %v", got)
	}

	// A member whose workdir was looked up before the bind must not be bound.
	mounts, err = e.sn.Prepare(ctx, "tainted", "layer1", late)
	if err != nil {
		t.Fatal(err)
	}
	dir2 := t.TempDir()
	if err := mount.All(mounts, dir2); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mount.UnmountAll(dir2, 0) })
	os.Stat(filepath.Join(dir2, "app/src"))
	if _, err := e.sn.Bind(ctx, snapshotter.BindRequest{Key: "tainted", Fork: root.String()}); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("bind of a tainted member: err = %v", err)
	}
	mount.UnmountAll(dir2, 0)
	if err := e.sn.Remove(ctx, "tainted"); err != nil {
		t.Fatal(err)
	}
}

// TestLateBindRecordFails: a late bind's labels are written behind the claim; when
// that write fails, the snapshot's next operation (here its removal) writes them
// before it reads the binding, so the container's changes still reach the fork.
func TestLateBindRecordFails(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	e := newEnv(t, t.TempDir())
	e.imageLayer(t, "layer1", imageFiles)
	root := ingestFiles(t, e.store, sourceFiles)
	mounts, err := e.sn.Prepare(ctx, "member", "layer1", labels(binding.LabelLateBind, "true", binding.LabelWorkdir, "/app"))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := mount.All(mounts, dir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mount.UnmountAll(dir, 0) })
	snapshotter.FailLabelWrites(e.sn, 1)
	res, err := e.sn.Bind(ctx, snapshotter.BindRequest{Key: "member", Fork: root.String()})
	if err != nil {
		t.Fatal(err)
	}
	writeFiles(t, dir, map[string]string{"app/src/main.js": "changed\n"})
	if err := mount.UnmountAll(dir, 0); err != nil {
		t.Fatal(err)
	}
	if err := e.sn.Remove(ctx, "member"); err != nil {
		t.Fatal(err)
	}
	f := forkOf(t, e.db, res.ForkID)
	if got := changes(t, e.store, root, f.Root); len(got) != 1 || got[0] != "M src/main.js" {
		t.Fatalf("changes after a failed bind record: %v", got)
	}
}

func TestDiscardAndRestart(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	root := t.TempDir()
	e := newEnv(t, root)
	e.imageLayer(t, "layer1", imageFiles)
	src := ingestFiles(t, e.store, sourceFiles)
	if _, err := e.sn.Prepare(ctx, "keep", "layer1", labels(binding.LabelFork, src.String(), binding.LabelWorkdir, "/app")); err != nil {
		t.Fatal(err)
	}
	mounts, err := e.sn.Prepare(ctx, "throwaway", "layer1", labels(binding.LabelFork, src.String(), binding.LabelDiscard, "true"))
	if err != nil {
		t.Fatal(err)
	}
	withMounted(t, mounts, func(dir string) { writeFiles(t, dir, map[string]string{"workspace/scratch": "x"}) })
	if err := e.sn.Remove(ctx, "throwaway"); err != nil {
		t.Fatal(err)
	}
	if f := forkOf(t, e.db, "throwaway"); f.Root != src {
		t.Fatalf("discarded snapshot moved its fork to %s", f.Root)
	}

	// Restart: a new process (snapshotter and view host) over the same root serves
	// the surviving snapshot's view again on its first Mounts.
	e.close(t)
	e2 := newEnv(t, root)
	mounts, err = e2.sn.Mounts(ctx, "keep")
	if err != nil {
		t.Fatal(err)
	}
	withMounted(t, mounts, func(dir string) {
		if got := readFile(t, filepath.Join(dir, "app/README.md")); got != sourceFiles["README.md"] {
			t.Fatalf("after restart: %q", got)
		}
	})
	if err := e2.sn.Remove(ctx, "keep"); err != nil {
		t.Fatal(err)
	}
	if _, err := e2.db.Get(ctx, "keep"); err != nil {
		t.Fatal(err)
	}
}

func assertOwner(t testing.TB, p string, uid, gid uint32) {
	t.Helper()
	st, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	sys := st.Sys().(*syscall.Stat_t)
	if sys.Uid != uid || sys.Gid != gid {
		t.Errorf("%s owned by %d:%d, want %d:%d", p, sys.Uid, sys.Gid, uid, gid)
	}
}
