package mountapi

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

func TestMountpoint(t *testing.T) {
	base, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	real := filepath.Join(base, "real")
	if err := os.MkdirAll(filepath.Join(real, "dir"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("real", filepath.Join(base, "link")); err != nil {
		t.Fatal(err)
	}
	t.Chdir(base)
	for _, c := range []struct{ in, want string }{
		{"real/dir", filepath.Join(real, "dir")},
		{"link/dir", filepath.Join(real, "dir")},
		{filepath.Join(base, "link", "dir"), filepath.Join(real, "dir")},
		{filepath.Join(base, "link", "x", "..", "dir"), filepath.Join(real, "dir")},
		// The directory itself is not resolved (it may be a dead FUSE mount).
		{filepath.Join(base, "link"), filepath.Join(base, "link")},
		// A missing parent leaves the path as it is.
		{"gone/dir", filepath.Join(base, "gone", "dir")},
		{"/", "/"},
	} {
		got, err := Mountpoint(c.in)
		if err != nil || got != c.want {
			t.Errorf("Mountpoint(%q) = %q, %v; want %q", c.in, got, err, c.want)
		}
	}
}

// TestStackThroughSymlink: a mount at a directory reached through a symbolic link,
// or by a relative path, is found: the mount table names the real path.
func TestStackThroughSymlink(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts a tmpfs")
	}
	base, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(base, "real", "mnt")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("real", filepath.Join(base, "link")); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	t.Chdir(base)
	for _, p := range []string{dir, filepath.Join(base, "link", "mnt"), "link/mnt", "real/mnt"} {
		ms, err := Stack(p)
		if err != nil || len(ms) != 1 || ms[0].FSType != "tmpfs" {
			t.Errorf("Stack(%q) = %d mounts, %v; want the tmpfs", p, len(ms), err)
		}
	}
}
