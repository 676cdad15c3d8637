package hostcheck

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestParseKernel(t *testing.T) {
	for _, tc := range []struct {
		in           string
		major, minor int
	}{
		{"6.18.44-fc-v769", 6, 18},
		{"6.5.0", 6, 5},
		{"5.15.0-91-generic", 5, 15},
		{"6.12-rc1", 6, 12},
		{"6.1+deb", 6, 1},
		{"garbage", 0, 0},
	} {
		k := ParseKernel(tc.in)
		if k.Major != tc.major || k.Minor != tc.minor {
			t.Errorf("ParseKernel(%q) = %d.%d, want %d.%d", tc.in, k.Major, k.Minor, tc.major, tc.minor)
		}
	}
	if !ParseKernel("6.12.1").atLeast(erofsFile) || ParseKernel("6.11.9").atLeast(erofsFile) || !ParseKernel("7.0").atLeast(erofsFile) {
		t.Error("atLeast is wrong around 6.12")
	}
	if c := ParseKernel("6.1.0").Check(); c.Status != Degraded || c.Fix == "" {
		t.Errorf("kernel 6.1: %+v, want degraded with a fix", c)
	}
}

func scratchMounts(t *testing.T) []string {
	t.Helper()
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if strings.Contains(sc.Text(), "tidepool-hostcheck") || strings.Contains(sc.Text(), ".hostcheck-") {
			out = append(out, sc.Text())
		}
	}
	return out
}

func requireRoot(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
}

// This machine (kernel 6.18, cgroup v1 with freezer) has everything: every probe must
// pass for real, and leave no mount and no file behind.
func TestHostAllOK(t *testing.T) {
	requireRoot(t)
	root := t.TempDir()
	checks := Host(context.Background(), Options{Root: root})
	names := map[string]bool{}
	for _, c := range checks {
		names[c.Name] = true
		if !c.OK() {
			t.Errorf("%s: %s: %s (fix: %s)", c.Name, c.Status, c.Detail, c.Fix)
		}
	}
	for _, want := range []string{"kernel", "overlayfs", "overlayfs data-only lowers + metacopy", "erofs file-backed mounts",
		"fuse", "fuse passthrough", "trusted.* xattrs on the root", "cgroups", "cgroup freezer"} {
		if !names[want] {
			t.Errorf("no check named %q", want)
		}
	}
	if err := KernelViews(context.Background(), root); err != nil {
		t.Errorf("KernelViews: %v", err)
	}
	if left := scratchMounts(t); len(left) > 0 {
		t.Errorf("probes left mounts: %q", left)
	}
	if ents, _ := os.ReadDir(root); len(ents) > 0 {
		t.Errorf("probes left files in the root: %v", ents)
	}
	// A root that does not exist yet is probed on its nearest existing parent and
	// is not created.
	missing := filepath.Join(root, "not", "yet")
	if c := TrustedXattrs(missing); !c.OK() {
		t.Errorf("xattrs under a missing root: %+v", c)
	}
	if c := FUSEPassthrough(context.Background(), missing, Kernel()); !c.OK() {
		t.Errorf("passthrough under a missing root: %+v", c)
	}
	if _, err := os.Stat(filepath.Join(root, "not")); !os.IsNotExist(err) {
		t.Errorf("probing a missing root created it (stat: %v)", err)
	}
}

// A root on a filesystem without trusted.* xattrs (ramfs) makes the xattr check
// missing and KernelViews refuse, naming it.
func TestKernelViewsRefusesRootWithoutXattrs(t *testing.T) {
	requireRoot(t)
	root := t.TempDir()
	if err := unix.Mount("ramfs", root, "ramfs", 0, ""); err != nil {
		t.Skipf("mount ramfs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(root, unix.MNT_DETACH) })
	c := TrustedXattrs(root)
	if c.Status != Missing || c.Fix == "" || !strings.Contains(c.Detail, "trusted.tidepool.probe") {
		t.Fatalf("xattr check on ramfs: %+v, want missing naming the attribute, with a fix", c)
	}
	err := KernelViews(context.Background(), root)
	if err == nil || !errors.Is(err, ErrUnsupported) || !strings.Contains(err.Error(), "trusted.* xattrs on the root") {
		t.Fatalf("KernelViews on ramfs: %v, want ErrUnsupported naming the xattr check", err)
	}
}

func TestNotRootNeverOK(t *testing.T) {
	c := notProbed(Check{Name: "x", Fix: "f"}, errNotRoot)
	if c.OK() || !strings.Contains(c.Fix, "root") {
		t.Fatalf("%+v", c)
	}
}

// A root on tmpfs or overlayfs, which cannot back an EROFS image file, fails the
// EROFS check naming that filesystem and what to do, not the kernel's version.
func TestEROFSNamesARootThatCannotBackImages(t *testing.T) {
	requireRoot(t)
	k := Kernel()
	if !k.atLeast(erofsFile) {
		t.Skipf("kernel %s has no file-backed EROFS", k.Release)
	}
	if c := EROFS(context.Background(), t.TempDir(), k); !c.OK() {
		t.Skipf("EROFS from a file fails here on the test's own filesystem too: %+v", c)
	}
	base := t.TempDir()
	// Named so that no path can spell what the messages must say.
	tmp := filepath.Join(base, "t")
	ovl := filepath.Join(base, "o")
	for _, d := range []string{tmp, ovl, filepath.Join(base, "l"), filepath.Join(base, "u"), filepath.Join(base, "w")} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if err := unix.Mount("tmpfs", tmp, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(tmp, unix.MNT_DETACH) })
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", filepath.Join(base, "l"), filepath.Join(base, "u"), filepath.Join(base, "w"))
	if err := unix.Mount("overlay", ovl, "overlay", 0, opts); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(ovl, unix.MNT_DETACH) })
	for _, c := range []struct{ root, fs string }{{tmp, "tmpfs"}, {ovl, "overlayfs"}} {
		got := EROFS(context.Background(), c.root, k)
		if got.Status != Missing || !strings.Contains(got.Detail, "is on "+c.fs+", which cannot back an EROFS image file") ||
			strings.Contains(got.Detail, "need >=") || !strings.Contains(got.Fix, "not "+c.fs) {
			t.Errorf("EROFS check with the root on %s: %+v", c.fs, got)
		}
		err := KernelViews(context.Background(), c.root)
		if err == nil || !errors.Is(err, ErrUnsupported) || !strings.Contains(err.Error(), c.fs) {
			t.Errorf("KernelViews with the root on %s: %v, want ErrUnsupported naming it", c.fs, err)
		}
	}
}

// A root whose filesystem is full fails the checks that write there as degraded, with
// a fix that says to free space, not to change the kernel; KernelViews wraps
// ErrRootFull, not ErrUnsupported: the host may well support kernel views.
func TestKernelViewsOnAFullRoot(t *testing.T) {
	requireRoot(t)
	root := t.TempDir()
	if err := unix.Mount("tmpfs", root, "tmpfs", 0, "size=64k"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(root, unix.MNT_DETACH) })
	f, err := os.Create(filepath.Join(root, "filler"))
	if err != nil {
		t.Fatal(err)
	}
	for buf := make([]byte, 4096); err == nil; {
		_, err = f.Write(buf)
	}
	f.Close()
	if !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("filling the root: %v", err)
	}
	c := EROFS(context.Background(), root, Kernel())
	if c.Status != Degraded || !strings.Contains(c.Detail, "no space left") || !strings.Contains(c.Fix, "free space") || strings.Contains(c.Fix, "kernel >=") {
		t.Errorf("EROFS check on a full root: %+v", c)
	}
	err = KernelViews(context.Background(), root)
	if !errors.Is(err, ErrRootFull) || errors.Is(err, ErrUnsupported) || !strings.Contains(err.Error(), "no space left") {
		t.Errorf("KernelViews on a full root: %v, want ErrRootFull naming the write that failed", err)
	}
}
