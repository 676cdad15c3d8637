package fuse

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
)

func TestUnmountAndCleanup(t *testing.T) {
	requireRoot(t)
	s := newStore(t)
	root := ingestTree(t, s, writeFixture(t))
	base := t.TempDir()
	mk := func(name string) string {
		d := filepath.Join(base, name)
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		return d
	}
	mountAt := func(dir string) *View {
		v, err := Mount(t.Context(), s, root, dir, Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = UnmountStale(dir) })
		return v
	}

	t.Run("Mounts lists views under a directory", func(t *testing.T) {
		a, b := mk("views/a b"), mk("views/sub/c")
		other := mk("elsewhere")
		va, vb, vo := mountAt(a), mountAt(b), mountAt(other)
		got, err := Mounts(filepath.Join(base, "views"))
		if err != nil {
			t.Fatal(err)
		}
		if strings.Join(got, "|") != b+"|"+a {
			t.Errorf("Mounts = %q, want %q then %q", got, b, a)
		}
		// The mount table escapes the space in "a b"; "/" holds every view.
		everywhere, err := Mounts("/")
		if err != nil || !slices.Contains(everywhere, a) || !slices.Contains(everywhere, other) {
			t.Errorf("Mounts(/) = %q, %v: lacks %q or %q", everywhere, err, a, other)
		}
		for _, v := range []*View{va, vb, vo} {
			if err := v.Unmount(); err != nil {
				t.Fatal(err)
			}
			if mounted(t, v.Dir()) {
				t.Errorf("%s still in mountinfo after Unmount", v.Dir())
			}
			select {
			case <-v.Done():
			default:
				t.Error("server still running after Unmount")
			}
		}
		if got, err := Mounts(base); err != nil || len(got) != 0 {
			t.Errorf("Mounts after unmount = %q, %v", got, err)
		}
	})

	t.Run("busy view stays mounted and serving", func(t *testing.T) {
		v := mountAt(mk("busy"))
		f, err := os.Open(filepath.Join(v.Dir(), "README.md"))
		if err != nil {
			t.Fatal(err)
		}
		if err := v.Unmount(); !errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Errorf("Unmount with an open file: %v, want failed precondition", err)
		}
		buf := make([]byte, 9)
		if _, err := f.Read(buf); err != nil || string(buf) != "# fixture" {
			t.Errorf("read after refused unmount: %q %v", buf, err)
		}
		f.Close()
		if err := v.Unmount(); err != nil {
			t.Fatal(err)
		}
		if mounted(t, v.Dir()) {
			t.Error("still mounted")
		}
	})

	t.Run("a mount over the view is not taken", func(t *testing.T) {
		v := mountAt(mk("covered"))
		if err := unix.Mount("tmpfs", v.Dir(), "tmpfs", 0, ""); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Unmount(v.Dir(), unix.MNT_DETACH) })
		if err := v.Unmount(); !errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Errorf("Unmount under a tmpfs: %v, want failed precondition", err)
		}
		if err := unix.Unmount(v.Dir(), 0); err != nil {
			t.Fatal(err)
		}
		if err := v.Unmount(); err != nil {
			t.Fatal(err)
		}
		if mounted(t, v.Dir()) {
			t.Error("still mounted")
		}
	})

	t.Run("unmounted by someone else", func(t *testing.T) {
		v := mountAt(mk("external"))
		if err := UnmountDir(v.Dir()); err != nil {
			t.Fatal(err)
		}
		select {
		case <-v.Done():
		case <-time.After(10 * time.Second):
			t.Fatal("server did not exit after an external unmount")
		}
		if err := v.Unmount(); err != nil {
			t.Errorf("Unmount after external unmount: %v", err)
		}
		if err := UnmountDir(v.Dir()); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("UnmountDir of a plain directory: %v, want not found", err)
		}
	})

	t.Run("UnmountStale", func(t *testing.T) {
		plain := mk("plain")
		if err := UnmountStale(plain); err != nil {
			t.Errorf("UnmountStale of an unmounted dir: %v", err)
		}
		if err := UnmountStale(filepath.Join(base, "does-not-exist")); err != nil {
			t.Errorf("UnmountStale of a missing dir: %v", err)
		}
		// Something else mounted there is left alone.
		tmpfs := mk("tmpfs")
		if err := unix.Mount("tmpfs", tmpfs, "tmpfs", 0, ""); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Unmount(tmpfs, unix.MNT_DETACH) })
		if err := UnmountStale(tmpfs); err == nil || !mounted(t, tmpfs) {
			t.Errorf("UnmountStale detached a tmpfs: %v", err)
		}
		// A busy view is detached at once; its server exits when the last user goes.
		v := mountAt(mk("stale"))
		f, err := os.Open(filepath.Join(v.Dir(), "README.md"))
		if err != nil {
			t.Fatal(err)
		}
		if err := UnmountStale(v.Dir()); err != nil {
			t.Fatal(err)
		}
		if mounted(t, v.Dir()) {
			t.Error("still in mountinfo after a lazy detach")
		}
		f.Close()
		select {
		case <-v.Done():
		case <-time.After(10 * time.Second):
			t.Fatal("server did not exit after its last user left a detached view")
		}
	})
}
