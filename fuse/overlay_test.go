package fuse

import (
	"errors"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/tidepool-dev/tidepool/casstore"
)

// writeImage is a stand-in for a baked image's rootfs: its own /app with
// node_modules, and other top-level directories.
func writeImage(tb testing.TB) string {
	tb.Helper()
	dir := sharedDir(tb)
	for name, content := range map[string]string{
		"app/node_modules/x.js": "module.exports = 1\n",
		"app/package.json":      "{}\n",
		"etc/hostname":          "image\n",
	} {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			tb.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			tb.Fatal(err)
		}
	}
	return dir
}

func listNames(tb testing.TB, dir string) []string {
	tb.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		tb.Fatalf("readdir %s: %v", dir, err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	sort.Strings(names)
	return names
}

func readString(tb testing.TB, p string) string {
	tb.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		tb.Fatalf("read %s: %v", p, err)
	}
	return string(b)
}

// checkMergedApp checks the fork and the image's /app are united in merged/app and
// that the owner can write there and copy fork files up.
func checkMergedApp(t *testing.T, v *View, merged, upper string) {
	t.Helper()
	app := filepath.Join(merged, "app")
	want := []string{"README.md", "big.bin", "bin", "empty", "emptydir", "link", "node_modules", "package.json", "src"}
	if got := listNames(t, app); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("merged app lists %v, want %v", got, want)
	}
	if got := readString(t, filepath.Join(app, "node_modules/x.js")); got != "module.exports = 1\n" {
		t.Errorf("image file through overlay: %q", got)
	}
	if got := readString(t, filepath.Join(app, "src/main.go")); got != "package main\n\nfunc main() {}\n" {
		t.Errorf("fork file through overlay: %q", got)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(app, &st); err != nil || st.Uid != testUID || st.Gid != testGID {
		t.Errorf("merged app owner %d:%d (%v), want %d:%d", st.Uid, st.Gid, err, testUID, testGID)
	}

	// The owner (not root) writes a new file: it lands in the upper dir.
	if out, err := runAs(t, testUID, testGID, "sh", "-c", "echo hello > "+filepath.Join(app, "new.txt")); err != nil {
		t.Fatalf("write as owner: %v\n%s", err, out)
	}
	if got := readString(t, filepath.Join(upper, "app/new.txt")); got != "hello\n" {
		t.Errorf("upper app/new.txt = %q", got)
	}
	if err := syscall.Stat(filepath.Join(upper, "app/new.txt"), &st); err != nil || st.Uid != testUID {
		t.Errorf("new file owner %d (%v), want %d", st.Uid, err, testUID)
	}
	// The owner edits a fork file: overlay copies it up from the view.
	if out, err := runAs(t, testUID, testGID, "sh", "-c", "echo edited >> "+filepath.Join(app, "src/main.go")); err != nil {
		t.Fatalf("append as owner: %v\n%s", err, out)
	}
	if got := readString(t, filepath.Join(upper, "app/src/main.go")); got != "package main\n\nfunc main() {}\nedited\n" {
		t.Errorf("copied-up file = %q", got)
	}
	if got := readString(t, filepath.Join(v.Dir(), "app/src/main.go")); got != "package main\n\nfunc main() {}\n" {
		t.Errorf("view changed under copy-up: %q", got)
	}
	// Executables keep their mode through copy-up.
	if out, err := runAs(t, testUID, testGID, "sh", "-c", "echo '# x' >> "+filepath.Join(app, "bin/run.sh")); err != nil {
		t.Fatalf("append to script: %v\n%s", err, out)
	}
	if info, err := os.Stat(filepath.Join(upper, "app/bin/run.sh")); err != nil || info.Mode().Perm() != 0o755 {
		t.Errorf("copied-up script mode %v (%v), want 0755", info.Mode(), err)
	}
}

func TestOverlayMergesFork(t *testing.T) {
	requireRoot(t)
	s := newStore(t)
	root := ingestTree(t, s, writeFixture(t))
	image := writeImage(t)
	v := mount(t, s, root, Options{Prefix: "app", UID: testUID, GID: testGID})
	merged, upper := mountOverlay(t, v.Dir(), image)

	checkMergedApp(t, v, merged, upper)
	if got := readString(t, filepath.Join(merged, "etc/hostname")); got != "image\n" {
		t.Errorf("image /etc through overlay: %q", got)
	}
	if got := readString(t, filepath.Join(merged, "app/big.bin")); len(got) != 1<<20 {
		t.Errorf("big file through overlay: %d bytes", len(got))
	}
	if v.PassthroughActive() {
		if n := v.Stats().Reads.Load(); n != 0 {
			t.Errorf("%d READ requests reached the server under overlay with passthrough", n)
		}
	}
}

func TestLateBinding(t *testing.T) {
	requireRoot(t)
	s := newStore(t)
	root := ingestTree(t, s, writeFixture(t))
	image := writeImage(t)

	t.Run("bind before the workdir is seen", func(t *testing.T) {
		v := mount(t, s, casstore.Hash{}, Options{Prefix: "app", UID: testUID, GID: testGID})
		if !v.Root().IsZero() {
			t.Fatal("unbound view reports a root")
		}
		merged, upper := mountOverlay(t, v.Dir(), image)
		// A container starting up touches the image everywhere but the workdir.
		if got := readString(t, filepath.Join(merged, "etc/hostname")); got != "image\n" {
			t.Errorf("etc/hostname = %q", got)
		}
		if _, err := os.Stat(filepath.Join(merged, "nonexistent")); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("stat nonexistent: %v", err)
		}
		if v.Tainted() {
			t.Fatal("lookups outside the workdir tainted the view")
		}
		if err := v.Bind(root); err != nil {
			t.Fatal(err)
		}
		if v.Root() != root {
			t.Errorf("Root() = %s after Bind", v.Root())
		}
		checkMergedApp(t, v, merged, upper)
		if v.Tainted() {
			t.Error("view tainted although nothing saw the workdir before Bind")
		}
		if err := v.Bind(root); !errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Errorf("second Bind: %v, want failed precondition", err)
		}
	})

	t.Run("workdir looked up before bind", func(t *testing.T) {
		v := mount(t, s, casstore.Hash{}, Options{Prefix: "app", UID: testUID, GID: testGID})
		merged, _ := mountOverlay(t, v.Dir(), image)
		if got := listNames(t, filepath.Join(merged, "app")); strings.Join(got, ",") != "node_modules,package.json" {
			t.Errorf("unbound: merged app = %v, want the image's only", got)
		}
		if !v.Tainted() {
			t.Fatal("lookup of the workdir before Bind did not taint the view")
		}
		if err := v.Bind(root); err != nil {
			t.Fatal(err)
		}
		if !v.Tainted() {
			t.Error("Bind cleared the taint")
		}
	})

	t.Run("root opened but not listed before bind", func(t *testing.T) {
		// containerd 2.4 opens every lower directory of a rootfs as an os.Root to read
		// /etc/group for a container's spec, without mounting or listing it.
		v := mount(t, s, casstore.Hash{}, Options{Prefix: "app"})
		r, err := os.OpenRoot(v.Dir())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := r.Open("etc/group"); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("etc/group in an unbound view: %v", err)
		}
		r.Close()
		if v.Tainted() {
			t.Fatal("opening the view root without listing it tainted the view")
		}
	})

	t.Run("root listed before bind", func(t *testing.T) {
		v := mount(t, s, casstore.Hash{}, Options{Prefix: "srv/api"})
		merged, _ := mountOverlay(t, v.Dir(), image)
		if got := listNames(t, merged); strings.Join(got, ",") != "app,etc" {
			t.Errorf("merged root = %v", got)
		}
		if !v.Tainted() {
			t.Fatal("listing the root before Bind did not taint the view")
		}
	})

	t.Run("no prefix: any lookup taints", func(t *testing.T) {
		v := mount(t, s, casstore.Hash{}, Options{})
		if got := listNames(t, v.Dir()); len(got) != 0 {
			t.Errorf("unbound root lists %v", got)
		}
		if !v.Tainted() {
			t.Error("readdir of an unbound root did not taint")
		}
		v2 := mount(t, s, casstore.Hash{}, Options{})
		if _, err := os.Stat(filepath.Join(v2.Dir(), "README.md")); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("lookup in unbound view: %v", err)
		}
		if !v2.Tainted() {
			t.Error("lookup in an unbound unprefixed view did not taint")
		}
		if err := v2.Bind(root); err != nil {
			t.Fatal(err)
		}
		// Negative lookups are not cached: the file appears at once.
		if got := readString(t, filepath.Join(v2.Dir(), "README.md")); got != "# fixture\n" {
			t.Errorf("after Bind: %q", got)
		}
	})

	t.Run("bind errors", func(t *testing.T) {
		v := mount(t, s, casstore.Hash{}, Options{Prefix: "app"})
		if err := v.Bind(casstore.Hash{}); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Bind(zero): %v", err)
		}
		if err := v.Bind(casstore.Sum([]byte("absent"))); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Bind(absent): %v", err)
		}
		if v.Tainted() || !v.Root().IsZero() {
			t.Error("failed binds changed the view")
		}
		if err := v.Bind(root); err != nil {
			t.Fatal(err)
		}
		if got := readString(t, filepath.Join(v.Dir(), "app/README.md")); got != "# fixture\n" {
			t.Errorf("after Bind: %q", got)
		}
	})
}
