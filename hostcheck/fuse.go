package hostcheck

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/tidepool-dev/tidepool/casstore"
	"github.com/tidepool-dev/tidepool/fuse"
)

// FUSE opens /dev/fuse: every FUSE view needs it.
func FUSE() Check {
	c := Check{Name: "fuse", Required: true,
		Fix: "modprobe fuse (CONFIG_FUSE_FS); in a container, pass the device /dev/fuse"}
	f, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0)
	if err != nil {
		return failed(c, Missing, fmt.Errorf("open /dev/fuse: %w", err))
	}
	f.Close()
	return ok(c.Name, "/dev/fuse opens")
}

// FUSEPassthrough mounts a real fork view (of the empty tree) over a scratch store
// on the root's filesystem and asks it whether passthrough came up: the view's own
// probe registers a backing file from the store with the kernel, exactly as views
// serving containers do, so this check and tidepoold agree.
func FUSEPassthrough(ctx context.Context, root string, k KernelVersion) Check {
	c := Check{Name: "fuse passthrough",
		Fix: "kernel >= " + fuseBacking + " with CONFIG_FUSE_PASSTHROUGH, and the root on a non-stacked filesystem (not overlay or FUSE); without it reads go through tidepoold"}
	if os.Geteuid() != 0 {
		return notProbed(c, errNotRoot)
	}
	root, err := probeDir(root)
	if err != nil {
		return failed(c, Degraded, err)
	}
	dir, err := os.MkdirTemp(root, ".hostcheck-fuse-")
	if err != nil {
		return failed(c, Degraded, err)
	}
	defer os.RemoveAll(dir)
	store, err := casstore.Open(filepath.Join(dir, "cas"))
	if err != nil {
		return failed(c, Degraded, err)
	}
	mnt := filepath.Join(dir, "m")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		return failed(c, Degraded, err)
	}
	v, err := fuse.Mount(ctx, store, casstore.EmptyHash, mnt, fuse.Options{})
	if err != nil {
		return failed(c, Missing, fmt.Errorf("mount a FUSE view: %w", err))
	}
	active := v.PassthroughActive()
	if err := v.Unmount(); err != nil {
		unix.Unmount(mnt, unix.MNT_DETACH)
	}
	if !active {
		return failed(c, Degraded, fmt.Errorf("kernel %s did not accept a backing file from %s", k.Release, root))
	}
	return ok(c.Name, "a backing file from "+root+" registers")
}

// TrustedXattrs sets and reads back a trusted.* attribute on a file under root:
// kernel views keep overlay metadata (trusted.overlay.*) beside the store.
func TrustedXattrs(root string) Check {
	c := Check{Name: "trusted.* xattrs on the root",
		Fix: "put the Tidepool root on a filesystem with extended attributes (ext4, xfs, btrfs) and run tidepoold as root"}
	root, err := probeDir(root)
	if err != nil {
		return failed(c, Degraded, err)
	}
	f, err := os.CreateTemp(root, ".hostcheck-xattr-")
	if err != nil {
		return failed(c, Degraded, err)
	}
	name := f.Name()
	f.Close()
	defer os.Remove(name)
	if err := unix.Setxattr(name, "trusted.tidepool.probe", []byte(probeData), 0); err != nil {
		return failed(c, Missing, fmt.Errorf("setxattr trusted.tidepool.probe on %s: %w", root, err))
	}
	buf := make([]byte, 64)
	n, err := unix.Getxattr(name, "trusted.tidepool.probe", buf)
	if err != nil || string(buf[:n]) != probeData {
		return failed(c, Missing, fmt.Errorf("getxattr trusted.tidepool.probe on %s: %q, %v", root, buf[:max(n, 0)], err))
	}
	if fs, _ := filesystemOf(root); fs != "" {
		return ok(c.Name, root+" ("+fs+")")
	}
	return ok(c.Name, root)
}
